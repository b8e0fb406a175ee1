"""Per-GPU memory of a layout, and the layouts that fit a cluster (formulas: parallel/memory_plan.py).

    python scripts/estimate_memory.py --model llama2-70b --stages 8 --dp 2 --zero 1 --offload optimizer \\
        --micro-batch 1 --seq-len 4096 --grad-accum 16 --checkpointing
    python scripts/estimate_memory.py --model llama2-70b --gpus 16 --gpu-mem 80 --seq-len 4096
    python scripts/estimate_memory.py --model llama3-8b --stages 2 --sp 4 --zero 1 --seq-len 131072 --checkpointing
    python scripts/estimate_memory.py --model 7.5e9 --dp 64 --zero 3        # a bare parameter count
    python scripts/estimate_memory.py --model llama2-70b --gpus 16 --gpu-mem 80 --seq-len 4096 --lora-rank 16 [--nf4]
    python scripts/estimate_memory.py --model llama3-8b --stages 4 --grad-accum 16 --schedule both
    python scripts/estimate_memory.py --model qwen3-30b-a3b --gpus 8 --gpu-mem 80 --dtype fp32   # tries --ep too
    python scripts/estimate_memory.py --model mixtral-8x7b --stages 2 --dp 4 --ep 4 --zero 0 --dtype fp32
    python scripts/estimate_memory.py --model gpt-oss-120b --gpus 8 --gpu-mem 80 --seq-len 4096   # docs/moe.md's tables
    python scripts/estimate_memory.py --model llama3-8b --stages 2 --dp 4 --zero 1 --seq-len 1536 --grad-accum 16 \\
        --loss-chunk-tokens 1024 --grpo-completion-length 1024 --grpo-beta 0.04       # train_objective=grpo
    python scripts/estimate_memory.py --model llama3.2-3b --seq-len 4096 --micro-batch 1 --grad-accum 2 --fp8 rowwise

--model is a conf/model name, a Hugging Face config.json (or its directory), or a parameter count
(model states only: activations need an architecture). --grpo-completion-length counts train_objective=grpo: each
data-parallel rank's micro x grad_acc rows generated before the step, their KV cache and logits (the larger of the
generation and the training step), and with --grpo-beta > 0 the reference weights. --fp8 counts torchao's float8
casts of the widest decoder linear's backward (train.py's fp8; the fp8 column, parallel/memory_plan.py's model).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from training.observation.logs import quiet_dependencies  # noqa: E402

quiet_dependencies("warning")  # before models.llama_pipe imports DeepSpeed (training/observation/logs.py)

from models.fp8 import RECIPES, fp8_objective_problems  # noqa: E402
from models.peft_targets import DECODER_LINEARS  # noqa: E402
from parallel.axes import fp8_layout_problems, grpo_layout_problems  # noqa: E402
from parallel.axis import RuleSettings  # noqa: E402
from parallel.dualpipev import DualPipeVPlan  # noqa: E402
from parallel.expert_parallel import ExpertParallelPlan  # noqa: E402
from parallel.generation_memory import cache_windows, generation_plan, prompt_tokens  # noqa: E402
from parallel.layout import GenerationBatch, Layout, count_arg, layout_problems  # noqa: E402
from parallel.memory_plan import (  # noqa: E402
    GB,
    OFFLOADS,
    expert_all_to_all_step_bytes,
    expert_report,
    fitting,
    layout_bubble,
    model_facts,
    schedule_report,
    sequence_report,
    shape_of,
    stage_table,
)
from parallel.partition import DEFAULT_PARTITION_METHOD, splitter  # noqa: E402
from parallel.sequence_parallel import SequenceParallelPlan  # noqa: E402
from parallel.tensor_parallel import TensorParallelPlan  # noqa: E402
from training.configuration.schema import TrainConfig  # noqa: E402

SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
GPU_MEM_MAX_GB = 4096  # --gpu-mem: past any accelerator's memory (a few hundred GB)


def load_model(spec: str):
    """(Hugging Face config or None, total parameters)."""
    m = re.fullmatch(r"([\d.]+(?:e\d+)?)([KMBT]?)", spec.strip(), re.IGNORECASE)
    if m:
        return None, float(m.group(1)) * SUFFIX.get(m.group(2).upper(), 1)
    from training.configuration.model_source import model_group_config, model_group_names

    if spec in model_group_names():
        config = model_group_config(spec)
        if config is None:
            raise SystemExit(
                f"conf/model/{spec}.yaml takes its architecture from a checkpoint: pass that checkpoint's config.json"
            )
    elif os.path.exists(spec):
        from models.families import UnsupportedModelError, load_config

        try:
            config = load_config(os.path.dirname(spec) if spec.endswith(".json") else spec)
        except UnsupportedModelError as e:
            raise SystemExit(str(e)) from None
    else:
        raise SystemExit(f"--model {spec!r}: not a parameter count, a file, or one of {model_group_names()}")
    return config, None


def report(config, total, layout: Layout, method: str) -> None:
    split = splitter(config, total, method)
    params, layers = split(layout)
    stages = generation_plan(windows_of(config, layout))(params, layout, shape_of(config), layers)
    e = max(stages, key=lambda s: s.total)
    print(f"layout: {layout.describe()}")
    pieces = f" ({layout.pieces} pieces, two per rank)" if layout.pieces != layout.stages else ""
    print(
        f"parameters: {sum(params) / 1e9:.3f} B in {layout.stages} stage(s){pieces} (partition_method={method}), "
        f"most loaded: stage {e.stage} ({e.parameters / 1e9:.3f} B)"
    )
    for line in stage_table(stages, layers, layout):
        print("  " + line)
    if e.activations is None:
        print("  (activations need an architecture: pass a conf/model name or a config.json)")
    else:
        print(f"most loaded GPU: stage {e.stage}, {e.total / GB:.2f} GB")
    if e.host:
        print(f"host memory per rank (offloaded states, not in the GPU totals): up to {e.host / GB:.2f} GB")
    if layout.fp8:
        print(
            f"fp8 {layout.fp8} (--fp8): the widest decoder linear's float8 casts in its backward, {e.fp8 / GB:.2f} GB "
            f"on stage {e.stage} (fp8), eager's upper bound; weights, gradients, states and saved activations unchanged"
        )
    g = layout.generation
    if g is not None:
        print(
            f"generation (--grpo-completion-length): {layout.rank_batch} rows per data-parallel rank, prompts of up to "
            f"{prompt_tokens(layout)} + {g.completion_len} tokens; on stage "
            f"{e.stage} its KV cache {e.kv_cache / GB:.2f} GB of {e.generation / GB:.2f} GB (gen), beside the training "
            f"step's {e.training / GB:.2f} GB: the larger counts; reference weights {e.reference / GB:.2f} GB (ref, "
            "--grpo-beta > 0)"
        )
    shape = shape_of(config)
    for line in schedule_report(split, layout, shape) + sequence_report(layout, shape, layers):
        print(line)
    for line in expert_report(layout, shape, layers):
        print(line)


def fits(config, total, gpus: int, gpu_mem: float, args) -> None:
    num_layers = config.num_hidden_layers if config is not None else None
    split = splitter(config, total, args.partition_method)
    refusals: list[str] = []
    found = fitting(
        split,
        shape_of(config),
        gpus,
        gpu_mem,
        num_layers,
        args.micro_batch,
        args.seq_len,
        args.grad_accum,
        args.dtype,
        args.loss_chunk_tokens,
        lora(args),
        args.max_sp,
        schedules(args),
        None if args.ep is None else (args.ep,),
        (args.zero,) if args.zero is not None else {"optimizer": (1, 2, 3), "params": (3,)}.get(args.offload, range(4)),
        OFFLOADS if args.offload is None else (args.offload,),
        refusals,
        generation(args),
        generation_plan(windows_of(config, Layout(generation=generation(args)))),
        fp8(args),
    )
    # train.py refuses every layout of these flags (of the ZeRO stages that run the offload): its lines, the same as
    # for one layout, not a call for GPUs
    refuse(refusals, f"train.py runs no layout of {gpus} GPUs with these flags:")
    print(
        f"layouts that fit {gpus} x {gpu_mem:g} GB, cheapest first (estimate incl. activations, GB per GPU; bubble: "
        "the share of a step the pipeline ranks idle, DeepSpeed's schedule simulated with equal per-layer times):"
    )
    shape = shape_of(config)
    moe = shape is not None and shape.moe is not None  # a MoE model: each layout's expert all-to-all bytes too
    print(f"  {'GB':>7}  {'schedule':<9}  {'bubble':>6}  " + (f"{'a2a GB':>6}  " if moe else "") + "layout")
    for layout, e in found[: args.top]:
        bubble = layout_bubble(layout, split.work(layout))
        a2a = f"{expert_a2a_per_step(shape, layout, split) / GB:6.1f}  " if moe else ""
        print(f"  {e.total / GB:7.1f}  {layout.schedule:<9}  {bubble:6.0%}  {a2a}{layout.describe()}")
    if moe:
        print(
            "  (experts N: expert parallelism, each MoE layer's experts split over N data-parallel ranks; a2a GB: the "
            "bytes a rank of the stage with the most layers sends in the experts' all-to-alls per step)"
        )
        note = expert_parallel_note(shape)
        if note:
            print(f"  ({note})")
    if any(layout.sp > 1 for layout, _ in found[: args.top]):
        print(
            "  (x sequence N: Ulysses sequence parallelism; --sp N with the layout's sizes shows its all-to-all bytes)"
        )
    if not found:
        print("  none: add GPUs, shorten sequences or use a smaller micro-batch")


def expert_parallel_note(shape) -> str | None:
    """Why the search proposes no expert parallelism for a MoE model: train.py's rule for ep 2 where it refuses it
    (llama4_text)."""
    problems = ExpertParallelPlan.layout_problems(Layout(dp=2, ep=2), model_facts(shape))
    return f"no expert parallelism: {in_flags(problems[0])}" if problems else None


def expert_a2a_per_step(shape, layout: Layout, split) -> float:
    """Bytes a rank of ``layout``'s stage with the most decoder layers sends in the experts' all-to-alls per step."""
    _, layers = split(layout)
    return max(expert_all_to_all_step_bytes(shape, layout, n) for n in layers)


def lora(args) -> tuple[int, tuple[str, ...], bool]:
    """(rank, target modules, nf4) of --lora-rank / --lora-targets / --nf4: the Layout's LoRA fields."""
    if args.lora_rank and not args.model_config_given:
        raise SystemExit("--lora-rank needs an architecture (a conf/model name or a config.json), not a bare count")
    if args.nf4 and not args.lora_rank:
        raise SystemExit("--nf4 (QLoRA) quantises the frozen base of a LoRA run: give --lora-rank too")
    targets = tuple(args.lora_targets.split(",")) if args.lora_rank else ()
    unknown = sorted(set(targets) - set(DECODER_LINEARS))
    if unknown:
        raise SystemExit(f"--lora-targets {', '.join(unknown)} unknown: choose from {','.join(DECODER_LINEARS)}")
    return (args.lora_rank, targets, args.nf4)


def fp8(args) -> str | None:
    """--fp8's recipe (None: off); it needs an architecture, the linears' widths, and an objective it runs with
    (train.py's rule, the same for every layout)."""
    if args.fp8 and not args.model_config_given:
        raise SystemExit("--fp8 needs an architecture (a conf/model name or a config.json), not a bare count")
    refuse(fp8_objective_problems(args.fp8, "grpo" if args.grpo_completion_length else "sft"))
    return args.fp8


def generation(args) -> GenerationBatch | None:
    """train_objective=grpo's generation of --grpo-completion-length, --grpo-beta, --grpo-generation-micro-batches
    (None: another objective)."""
    if not args.grpo_completion_length:
        return None
    if not args.model_config_given:
        raise SystemExit("--grpo-completion-length needs an architecture (a conf/model name or a config.json)")
    if args.grpo_completion_length >= args.seq_len:
        raise SystemExit(
            f"--grpo-completion-length {args.grpo_completion_length} leaves no token of --seq-len {args.seq_len} for "
            "the prompt: raise --seq-len or lower --grpo-completion-length"
        )
    return GenerationBatch(args.grpo_completion_length, args.grpo_generation_micro_batches, beta=args.grpo_beta)


def windows_of(config, layout: Layout):
    """The model's cache windows where ``layout`` generates (parallel.generation_memory.cache_windows)."""
    return cache_windows(config) if layout.generation is not None else None


def schedules(args) -> tuple[str, ...]:
    """The pipeline schedules of --schedule."""
    return ("1f1b", "dualpipev") if args.schedule == "both" else (args.schedule,)


def flag_config(args) -> TrainConfig:
    """The training config this script's flags stand for, for train.py's own rule functions: rows fed whole
    (data.pad_to_multiple_of=0), as the planner counts them."""
    cfg = TrainConfig(
        model_name_or_path=args.model,
        num_stages=args.stages,
        partition_method=args.partition_method,
        tensor_parallel=args.tp,
        sequence_parallel=args.sp,
        expert_parallel=args.ep or 1,
        ds_config=f"zero{args.zero}",
        micro_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        loss_chunk_tokens=args.loss_chunk_tokens,
    )
    cfg.data.max_seq_length, cfg.data.pad_to_multiple_of = args.seq_len, 0
    if args.lora_rank:
        cfg.peft.method, cfg.peft.r, cfg.peft.target_modules = "lora", args.lora_rank, args.lora_targets.split(",")
    return cfg


def train_problems(config, layout: Layout, args) -> list[str]:
    """train.py's lines for this layout beyond its sizes: the rules of tensor and sequence parallelism, DualPipeV,
    Mixture-of-Experts models and LoRA, asked of the same functions training.configuration.validate.resolve asks (the
    experts' on the layout and the model's facts, which a bare parameter count, no model, reaches too), given the
    config the flags stand for."""
    from models.lora_rules import peft_problems

    cfg = flag_config(args)
    problems = TensorParallelPlan.problems(cfg, config, layout) + SequenceParallelPlan.problems(cfg, config, layout)
    problems += DualPipeVPlan.problems(cfg, config, layout)
    problems += ExpertParallelPlan.layout_problems(layout, model_facts(shape_of(config)), RuleSettings.of(cfg))
    if layout.generation is not None:
        problems += grpo_layout_problems(layout, cfg.ds_config)
    if layout.fp8:
        problems += fp8_layout_problems(layout, layout.fp8, cfg.ds_config)
    return problems + (peft_problems(cfg, config, layout) if layout.lora_rank else [])


# train.py's knobs in its rules' lines -> this script's flags, in order (a knob's value follows it: "num_stages=1"
# and "num_stages 1" both read "--stages 1"); a test checks that no refusal names a knob of train.py.
SETTINGS = (
    (r"ds_config offloads the optimizer \(zero_optimization.offload_optimizer\)", "--offload optimizer"),
    (r"ds_config offloads the parameters \(zero_optimization.offload_param\)", "--offload params"),
    (r"ds_config=zero1_offload, or remove offload_optimizer from the JSON", "--zero 1, or --offload none"),
    (r"ds_config=zero3_offload, or remove offload_param from the JSON", "--zero 3, or --offload optimizer"),
    (r"remove offload_optimizer from the JSON", "use --offload none"),
    # the experts' refusal of an offloaded optimizer: the flag that offloads it, and the one that keeps it on the GPU
    (r"the optimizer offloaded \((?:ds_config|ds)=[\w./-]+\)", "--offload optimizer"),
    (
        r"\(ds=zero1 shards them over the data axis, without offloading\)",
        "(--offload none; --zero 1 shards them over the data axis)",
    ),
    (r"(?:ds_config|ds)=zero(\d)", r"--zero \1"),
    (r"peft\.method=lora", "--lora-rank"),
    (r"full training \(peft\.method=none\)", "full training (no --lora-rank)"),
    (r"precision=(\w+)", r"--dtype \1"),
    (r"train_objective=grpo", "--grpo-completion-length"),
    (r"fp8=null", "no --fp8"),
    (r"fp8=(\w+)", r"--fp8 \1"),
)
FLAGS = {
    "data.max_seq_length": "--seq-len",
    "num_stages": "--stages",
    "tensor_parallel": "--tp",
    "sequence_parallel": "--sp",
    "expert_parallel": "--ep",
    "micro_batch_size": "--micro-batch",
    "gradient_accumulation_steps": "--grad-accum",
    "loss_chunk_tokens": "--loss-chunk-tokens",
    "partition_method": "--partition-method",
    "pipeline_schedule": "--schedule",
}


def in_flags(line: str) -> str:
    """A line of train.py's rules in this script's flags."""
    for pattern, flag in SETTINGS:
        line = re.sub(pattern, flag, line)
    for knob, flag in FLAGS.items():
        line = re.sub(rf"(?<![\w.-]){re.escape(knob)}(?![\w.])(=?)", lambda m, f=flag: f + " " * len(m[1]), line)
    return line


def refuse(problems: list[str], lead: str | None = None) -> None:
    """Exit with train.py's lines for a layout it would refuse, in this script's flags (after ``lead``, a line of
    its own): no plan is printed for it."""
    if problems:
        lines = ([lead] if lead else []) + list(dict.fromkeys(in_flags(p) for p in problems))
        print("\n".join(f"estimate_memory.py: error: {line}" for line in lines), file=sys.stderr)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    # The layout's sizes (--stages, --micro-batch, --seq-len, --grad-accum, --loss-chunk-tokens) are checked by
    # parallel.layout.layout_problems, which says train.py's line; the others by argparse.
    p.add_argument("--stages", type=int, default=1, help="pipeline stages")
    p.add_argument(
        "--dp", type=count_arg(1), default=1, help="data-parallel degree (sample groups; with --sp, each of sp ranks)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism inside each stage (tensor_parallel)")
    p.add_argument(
        "--sp",
        type=int,
        default=1,
        help="sequence parallelism (sequence_parallel, DeepSpeed Ulysses): ranks each sample's sequence is split over",
    )
    p.add_argument(
        "--ep",
        type=count_arg(1),
        help="expert parallelism (expert_parallel, Mixture-of-Experts models): data-parallel ranks each MoE layer's "
        "experts are split over; with --gpus, only this value (default: each divisor of the data axis and the experts)",
    )
    p.add_argument(
        "--max-sp",
        type=count_arg(1),
        default=8,
        help="with --gpus: the largest sequence_parallel the search tries (1: layouts without it)",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=range(4),
        help="ZeRO stage (default 0); with --gpus, only this stage (default: each train.py runs)",
    )
    p.add_argument(
        "--offload",
        choices=OFFLOADS,
        help="optimizer: optimizer states on the host; params: weights too (ZeRO-3); default none; with --gpus, only "
        "this (default: each train.py runs)",
    )
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=8, help="micro-batches per step (pipeline in-flight bound)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument(
        "--partition-method",
        default=DEFAULT_PARTITION_METHOD,
        help="train.py's partition_method: compute | parameters | memory | uniform | type:DecoderLayerPipe",
    )
    p.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=TrainConfig.loss_chunk_tokens,
        help="train.py's loss_chunk_tokens: tokens the LM head and loss take at once (0 = all)",
    )
    p.add_argument(
        "--lora-rank", type=count_arg(0), default=0, help="LoRA (train.py peft.method=lora peft.r=R): rank; 0 = full"
    )
    p.add_argument(
        "--lora-targets",
        default=",".join(DECODER_LINEARS),
        help="with --lora-rank: the decoder linear layers with adapters (peft.target_modules), comma-separated",
    )
    p.add_argument("--nf4", action="store_true", help="with --lora-rank: QLoRA (peft.quantize=nf4), a 4-bit base")
    p.add_argument(
        "--save-async",
        action="store_true",
        help="train.py's save_async: count each rank's host copy of a checkpoint in the host column",
    )
    p.add_argument(
        "--schedule",
        choices=("1f1b", "dualpipev", "both"),
        default="1f1b",
        help="train.py's pipeline_schedule; both: each (with --gpus, the search tries both)",
    )
    p.add_argument(
        "--grpo-completion-length",
        type=count_arg(0),
        default=0,
        help="train_objective=grpo's grpo.max_completion_length: count each step's generation (0: another objective)",
    )
    p.add_argument(
        "--grpo-beta",
        type=count_arg(0, float, maximum=1e6),
        default=0.0,
        help="with --grpo-completion-length: grpo.beta; > 0 counts the reference weights",
    )
    p.add_argument(
        "--grpo-generation-micro-batches",
        type=count_arg(0),
        default=0,
        help="with --grpo-completion-length: grpo.generation_micro_batches (0: one chunk of rows per stage)",
    )
    p.add_argument(
        "--fp8",
        choices=RECIPES,
        help="train.py's fp8: count torchao's float8 casts of the decoder linears (default: off)",
    )
    p.add_argument("--gpus", type=count_arg(1), help="with --gpu-mem: list the layouts that fit")
    p.add_argument("--gpu-mem", type=count_arg(0, float, strict=True, maximum=GPU_MEM_MAX_GB), help="GB per GPU")
    p.add_argument("--top", type=count_arg(1), default=10, help="how many fitting layouts to list")
    args = p.parse_args(argv)
    if (args.gpus is None) != (args.gpu_mem is None):
        p.error("--gpus and --gpu-mem go together: give both to list the layouts that fit, or neither")

    config, total = load_model(args.model)
    args.model_config_given = config is not None
    num_layers = config.num_hidden_layers if config is not None else None
    fit = args.gpus is not None
    # --gpus: the search tries each ZeRO stage and offload unless one is given; the layout checked first has the
    # lowest ZeRO stage that runs the given offload
    zero = args.zero if args.zero is not None else {"optimizer": 1, "params": 3}.get(args.offload, 0) if fit else 0
    offload = args.offload or "none"
    if not fit:
        args.zero, args.offload = zero, offload
    layout = Layout(
        1 if fit else args.stages,  # --gpus: every stage count that divides it is tried
        args.gpus if fit else args.dp,
        zero,
        offload != "none",
        offload == "params",
        args.micro_batch,
        args.seq_len,
        args.grad_accum,
        args.checkpointing,
        args.dtype,
        args.loss_chunk_tokens,
        *lora(args),
        tp=1 if fit else args.tp,  # --gpus: every tensor_parallel the model allows within a node is tried
        sp=1 if fit else args.sp,  # --gpus: and every sequence_parallel (parallel.memory_plan.SEQUENCE_PARALLEL_SIZES)
        ep=args.ep or 1,  # --gpus without --ep: every expert_parallel the model allows
        save_async=args.save_async,
        generation=generation(args),
        fp8=fp8(args),
    )
    refuse(layout_problems(layout, layout.world_size, args.partition_method, num_layers))
    if fit:
        fits(config, total, args.gpus, args.gpu_mem, args)  # the search tries only layouts train.py runs
        return
    scheduled = [dataclasses.replace(layout, schedule=schedule) for schedule in schedules(args)]
    refuse(list(dict.fromkeys(problem for one in scheduled for problem in train_problems(config, one, args))))
    for n, one in enumerate(scheduled):
        if n:
            print()
        report(config, total, one, args.partition_method)


if __name__ == "__main__":
    main()
