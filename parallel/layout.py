"""The one description of how a job is laid out over its ranks, and the batch arithmetic that follows.

Validation, the DeepSpeed JSON, the memory planner, preflight and the start-up announcement all read
these numbers from a ``Layout`` (in the spirit of torchtitan's ParallelDims) instead of multiplying
micro x grad_acc x dp where they need it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from enum import StrEnum

from parallel.engines import DataParallelEngine, PipelineEngine, engine_for

# Typed choices of train.py's config, as its other StrEnums (training/configuration/schema.py): OmegaConf refuses any
# other value with the list of these. A member's name is what the command line and train_config.yaml say, and "1f1b" or
# "type:DecoderLayerPipe" is no Python identifier: hence the functional form, each member named as its value
# (written out, as tools/config_docs.py reads it from the source).
# How the specs are split into stages (parallel/partition.py; of DeepSpeed's "type:<regex>" patterns, this one).
PartitionMethod = StrEnum(
    "PartitionMethod",
    {
        "parameters": "parameters",
        "compute": "compute",
        "memory": "memory",
        "uniform": "uniform",
        "type:DecoderLayerPipe": "type:DecoderLayerPipe",
    },
    module=__name__,
)
# The pipeline schedule (parallel/dualpipev.py).
PipelineSchedule = StrEnum("PipelineSchedule", {"1f1b": "1f1b", "dualpipev": "dualpipev"}, module=__name__)
# The values, for the checks of a config built in Python (a dataclass takes any string) and of scripts' flags.
PARTITION_METHODS = tuple(m.value for m in PartitionMethod)
PIPELINE_SCHEDULES = tuple(s.value for s in PipelineSchedule)


def tp_dividing(sizes, candidates) -> list[int]:
    """The tensor_parallel values of ``candidates`` that divide every size in ``sizes`` (a model's attention
    heads, KV heads, intermediate size and vocabulary: each rank keeps an equal share of each)."""
    sizes = list(sizes)
    return [t for t in candidates if all(n % t == 0 for n in sizes)]


def offloads(zero: dict) -> tuple[bool, bool]:
    """(optimizer offloaded, parameters offloaded) for a DeepSpeed JSON's ``zero_optimization`` section."""
    return tuple(zero.get(k, {}).get("device", "none") != "none" for k in ("offload_optimizer", "offload_param"))


@dataclass(frozen=True)
class GenerationBatch:
    """What a train_objective=grpo step generates on each data-parallel rank before it trains (grpo.*): the planner
    counts its KV cache and logits (parallel/generation_memory.py)."""

    completion_len: int  # grpo.max_completion_length; the prompts take up to seq_len - completion_len
    chunks: int = 0  # grpo.generation_micro_batches: chunks of rows in flight; 0 = one per stage
    temperature: float = 1.0  # grpo.temperature, top_k and top_p: what the sampling's temporaries are
    top_k: int = 0
    top_p: float = 1.0
    beta: float = 0.0  # grpo.beta: > 0 keeps the reference weights beside the trained ones for the whole run


@dataclass(frozen=True)
class Layout:
    """One way to run the job: pipe x tensor x sequence x data over ``stages * tp * sp * dp`` ranks, and what
    each step holds.

    ``dp`` counts the groups that read different samples; each group is ``sp`` ranks that split every sample's
    sequence (sequence parallelism). DeepSpeed sees both as its data axis (``data_axis = sp * dp`` replicas
    of the weights, whose gradients it averages)."""

    stages: int = 1
    dp: int = 1
    zero: int = 0  # 0..3
    offload_optimizer: bool = False
    offload_params: bool = False  # ZeRO-3 only
    micro_batch: int = 1  # samples per micro-batch per data-parallel rank
    seq_len: int = 2048
    grad_accum: int = 8  # micro-batches per step per data-parallel rank: how many are in flight in the pipeline
    checkpointing: bool = False
    dtype: str = "bf16"  # bf16 | fp16 (mixed precision, K=12) | fp32 (K=8)
    loss_chunk: int = 0  # tokens the last stage's LM head and loss take at once; 0 = all (loss_chunk_tokens)
    lora_rank: int = 0  # LoRA (peft.method=lora): the adapters' rank; 0 = every weight trained
    lora_targets: tuple[str, ...] = ()  # the decoder linear layers that get adapters (peft.target_modules)
    nf4: bool = False  # QLoRA (peft.quantize=nf4): the decoder's frozen linear weights stored in 4 bits
    tp: int = 1  # tensor parallelism inside each stage (tensor_parallel): ranks one layer is split over
    sp: int = 1  # sequence parallelism (sequence_parallel): ranks each sample's sequence is split over
    ep: int = 1  # expert parallelism (expert_parallel): data-parallel ranks of a stage the experts divide over
    schedule: str = "1f1b"  # pipeline_schedule: 1f1b | dualpipev (two pieces per pipeline rank)
    rows_per_sample: int = 1  # rows a sample is fed as: 2 for a preference pair (train_objective=dpo)
    # What computes the last stage's head cross entropy (loss_impl): chunked | liger. Down here, after the fields
    # parallel/memory_plan.py passes by position.
    loss_impl: str = "chunked"
    save_async: bool = False  # save_async: each rank holds a host copy of its checkpoint files while they are written
    generation: GenerationBatch | None = None  # train_objective=grpo: each step's generation; None otherwise
    fp8: str | None = None  # fp8: torchao's recipe for the decoder layers' linears (models/fp8.py); None: off

    @classmethod
    def of(cls, cfg, world_size: int, ds_json: dict) -> Layout:
        """The layout of a training config on ``world_size`` ranks (dp 0 when they do not divide)."""
        zero = ds_json.get("zero_optimization", {})
        offload_opt, offload_par = offloads(zero)
        k, tp, sp = cfg.num_stages, cfg.tensor_parallel, cfg.sequence_parallel
        n = k * tp * sp
        return cls(
            stages=k,
            dp=world_size // n if k >= 1 and tp >= 1 and sp >= 1 and world_size % n == 0 else 0,
            tp=tp,
            sp=sp,
            zero=zero.get("stage", 0),
            offload_optimizer=offload_opt,
            offload_params=offload_par,
            micro_batch=cfg.micro_batch_size,
            seq_len=cfg.data.max_seq_length,
            grad_accum=cfg.gradient_accumulation_steps,
            checkpointing=cfg.activation_checkpoint_interval > 0,
            dtype=cfg.precision,
            loss_chunk=cfg.loss_chunk_tokens,
            loss_impl=cfg.loss_impl,
            save_async=cfg.save_async,
            lora_rank=cfg.peft.r if cfg.peft.method == "lora" else 0,
            lora_targets=tuple(cfg.peft.target_modules) if cfg.peft.method == "lora" else (),
            nf4=cfg.peft.method == "lora" and cfg.peft.quantize == "nf4",
            ep=cfg.expert_parallel,
            schedule=cfg.pipeline_schedule,
            rows_per_sample=2 if cfg.train_objective == "dpo" else 1,
            generation=generation_batch(cfg.grpo) if cfg.train_objective == "grpo" else None,
            fp8=getattr(cfg, "fp8", None),
        )

    @property
    def world_size(self) -> int:
        return self.stages * self.tp * self.sp * self.dp

    @property
    def data_axis(self) -> int:
        """DeepSpeed's data-parallel degree: the ranks holding the same weights (sequence groups x dp)."""
        return self.sp * self.dp

    @property
    def ds_train_batch(self) -> int:
        """DeepSpeed's ``train_batch_size``: it counts a sample once per rank of its sequence group."""
        return self.global_batch * self.sp

    @property
    def rank_batch(self) -> int:
        """Samples per optimizer step on one data-parallel rank: what a GRPO step generates there in one call."""
        return self.micro_batch * self.grad_accum

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.rank_batch * self.dp

    @property
    def tokens_per_step(self) -> int:
        """Row tokens per optimizer step (padding included)."""
        return self.global_batch * self.rows_per_sample * self.seq_len

    @property
    def pieces(self) -> int:
        """Pipeline pieces the specs are cut into: a stage per pipeline rank, two with DualPipeV."""
        return 2 * self.stages if self.schedule == "dualpipev" else self.stages

    def rank_pieces(self, stage: int) -> list[int]:
        """The pieces pipeline rank ``stage`` holds: its own, and with DualPipeV also its mirror."""
        return [stage, 2 * self.stages - 1 - stage] if self.schedule == "dualpipev" else [stage]

    @property
    def reading_stages(self) -> tuple[int, ...]:
        """The pipeline ranks that read data: the first (inputs) and the last (labels); with DualPipeV the first
        alone, which holds both ends of the V."""
        return (0,) if self.schedule == "dualpipev" else tuple(sorted({0, self.stages - 1}))

    @property
    def label_stage(self) -> int:
        """The pipeline rank that holds the labels and computes the loss: the last; the first with DualPipeV."""
        return 0 if self.schedule == "dualpipev" else self.stages - 1

    @property
    def least_micro_batches(self) -> int:
        """Micro-batches per data-parallel rank a pipeline pass needs at least (an eval pass, DPO's reference
        pass): DualPipeV keeps 2 x stages in flight."""
        return 2 * self.stages if self.schedule == "dualpipev" else 1

    @property
    def batch_peers(self) -> int:
        """Ranks of a stage that read the same micro-batches: its tensor-parallel and sequence-parallel peers."""
        return self.tp * self.sp

    def data_coord(self, coord):
        """A rank's topology coordinate (DeepSpeed's, a named tuple with ``data``) with the data axis counted in
        groups that read different samples (``dp`` of them): the ranks of a sequence group read the same samples,
        so their data coordinate is the group's."""
        return coord._replace(data=coord.data // self.sp)

    def counts_labels(self, stage: int, data: int, tensor_rank: int) -> bool:
        """Whether the pipeline-engine rank at pipeline rank ``stage``, DeepSpeed data coordinate ``data`` and
        tensor-parallel rank ``tensor_rank`` counts its micro-batches' label tokens: the label stage's, of its
        tensor-parallel and sequence-parallel peers (which hold the same micro-batch) the first. Their sum over
        all ranks covers the global batch once."""
        return stage == self.label_stage and tensor_rank == 0 and data % self.sp == 0

    @property
    def feeds_rows_whole(self) -> bool:
        """Every row goes through whole, never cut to its micro-batch's longest: DualPipeV's engine takes fixed
        shapes (parallel/dualpipev.py)."""
        return self.schedule == "dualpipev"

    @property
    def engine(self) -> PipelineEngine | DataParallelEngine:
        """The DeepSpeed engine this layout runs on (parallel/engines.py), which says what differs between the two."""
        return engine_for(self)

    def axes(self) -> str:
        """``pipe P x data D``, with ``x tensor T`` and ``x sequence S`` where those are used."""
        tensor = f" x tensor {self.tp}" if self.tp > 1 else ""
        sequence = f" x sequence {self.sp}" if self.sp > 1 else ""
        schedule = " (DualPipeV)" if self.schedule == "dualpipev" else ""
        experts = f" (experts {self.ep})" if self.ep > 1 else ""
        return f"pipe {self.stages}{schedule}{tensor}{sequence} x data {self.dp}{experts}"

    def batch_line(self) -> str:
        return (
            f"global batch {self.global_batch} {'pairs' if self.rows_per_sample == 2 else 'samples'} = micro "
            f"{self.micro_batch} x grad_acc {self.grad_accum} x dp {self.dp} | {self.tokens_per_step} tokens/step"
        )

    def ds_batch_factors(self) -> str:
        """DeepSpeed's ``train_batch_size`` as a product: ``micro M x grad_acc G x dp D``, and ``x sequence_parallel
        S`` where a sample counts once per rank of its sequence group."""
        sp = f" x sequence_parallel {self.sp}" if self.sp > 1 else ""
        return f"micro {self.micro_batch} x grad_acc {self.grad_accum} x dp {self.dp}{sp}"

    def describe(self) -> str:
        off = "+offload(opt" + ("+params" if self.offload_params else "") + ")" if self.offload_optimizer else ""
        chunk = f", loss chunk {self.loss_chunk}" if self.loss_chunk else ""
        return (
            f"{self.axes()}, ZeRO-{self.zero}{off}, micro {self.micro_batch} x seq {self.seq_len}"
            f"{', act. ckpt' if self.checkpointing else ''}{chunk}, {self.dtype}"
            + (f", {'QLoRA (NF4)' if self.nf4 else 'LoRA'} r={self.lora_rank}" if self.lora_rank else "")
            + (f", fp8 {self.fp8}" if self.fp8 else "")
        )


def generation_batch(g) -> GenerationBatch:
    """The :class:`GenerationBatch` of a config's ``grpo`` section (training/configuration/schema.py's GRPOConfig)."""
    return GenerationBatch(g.max_completion_length, g.generation_micro_batches, g.temperature, g.top_k, g.top_p, g.beta)


def layout_problems(layout: Layout, world_size: int, partition_method: str, num_layers: int | None = None) -> list[str]:
    """Everything train.py refuses about a layout, each problem in train.py's words (its knob names): the
    one home of these rules, so train.py (``training.configuration.validate.resolve``), preflight and
    scripts/estimate_memory.py refuse the same layouts with the same lines. ``world_size``: the ranks
    launched (``layout.dp`` is 0 where they do not divide); ``num_layers``: the model's decoder layers,
    None for a bare parameter count."""
    problems, k, tp, sp = [], layout.stages, layout.tp, layout.sp
    axes = [("num_stages", k), ("tensor_parallel", tp), ("sequence_parallel", sp)]
    used = [(name, n) for name, n in axes if n > 1 or name == "num_stages"]
    product = k * tp * sp
    if k < 1:
        problems.append(f"num_stages {k} < 1: set num_stages to 1 or more")
    elif tp < 1:
        problems.append(f"tensor_parallel {tp} < 1: set tensor_parallel to 1 or more")
    elif sp < 1:
        problems.append(f"sequence_parallel {sp} < 1: set sequence_parallel to 1 or more")
    elif world_size < 1:
        problems.append(f"world size {world_size} < 1: launch 1 rank or more")
    elif world_size % product and len(used) == 1:
        problems.append(
            f"world size {world_size} is not divisible by num_stages {k}: "
            f"launch a multiple of {k} ranks or set num_stages to a divisor of {world_size}"
        )
    elif world_size % product:
        names = " x ".join(f"{name} {n}" for name, n in used)
        knobs = " and ".join(name for name, _ in used)
        problems.append(
            f"world size {world_size} is not divisible by {names} = {product}: launch a multiple of {product} "
            f"ranks, or set {knobs} so that their product divides {world_size}"
        )
    # a layer count below 1 is the model config's own problem (models/config_rules.py): no num_stages fits it
    if num_layers is not None and num_layers >= 1 and k > num_layers:
        problems.append(
            f"num_stages {k} > {num_layers} decoder layers: every stage needs at least one; "
            f"set num_stages <= {num_layers}"
        )
    if partition_method not in PARTITION_METHODS:
        problems.append(f"partition_method {partition_method!r} unknown: choose one of {list(PARTITION_METHODS)}")
    for name, value, minimum in (
        ("micro_batch_size", layout.micro_batch, 1),
        ("gradient_accumulation_steps", layout.grad_accum, 1),
        ("loss_chunk_tokens", layout.loss_chunk, 0),
    ):
        if value < minimum:
            problems.append(f"{name} {value} is out of range: set {name} >= {minimum}")
    if layout.seq_len < 2:
        problems.append(f"data.max_seq_length {layout.seq_len} < 2: a next-token loss needs 2 tokens or more")
    if layout.zero not in range(4):
        problems.append(
            f"ZeRO stage {layout.zero} unknown: DeepSpeed has stages 0 to 3; set zero_optimization.stage in the "
            "ds_config JSON"
        )
    elif layout.zero >= 2 and k > 1:
        problems.append(
            f"ZeRO stage {layout.zero} with num_stages={k}: DeepSpeed's pipeline engine supports ZeRO 0 and 1 only "
            f"('ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism'); set num_stages=1 or ds_config=zero1"
        )
    if layout.offload_optimizer and layout.zero == 0:
        # expert_parallel refuses the optimizer offloaded at any stage (its layout_problems): zero1_offload is no fix
        fix = (
            f"remove offload_optimizer from the JSON (expert_parallel {layout.ep} does not run with the optimizer "
            "offloaded; ds_config=zero1 shards the optimizer states over the data axis)"
            if layout.ep > 1
            else "use ds_config=zero1_offload, or remove offload_optimizer from the JSON"
        )
        problems.append(
            "ds_config offloads the optimizer (zero_optimization.offload_optimizer) with ZeRO stage 0, where "
            f"DeepSpeed ignores it: {fix}"
        )
    if layout.offload_params and layout.zero != 3:
        problems.append(
            f"ds_config offloads the parameters (zero_optimization.offload_param) with ZeRO stage {layout.zero}, "
            "where DeepSpeed ignores it (only ZeRO-3 offloads parameters): use ds_config=zero3_offload, or remove "
            "offload_param from the JSON"
        )
    return problems


# The axes' rules on a layout, in train.py's words, live with each axis: its plan's ``layout_problems``
# (parallel/axis.py's contract; parallel/tensor_parallel.py, sequence_parallel.py, expert_parallel.py, dualpipev.py).
# training.configuration.validate.resolve asks them with the config's settings (the plan's ``problems``), and the
# planner (parallel/memory_plan.py's layout search) asks the same ones which layouts train.py runs, each in one loop
# over parallel.axes.AXES.


def count_arg(minimum: float = 1, kind: type = int, strict: bool = False, maximum: float | None = None):
    """An argparse ``type`` for a count or size: a finite ``kind`` number >= ``minimum`` (> with ``strict``) and, with
    ``maximum``, <= it (the plausible values: a float flag's nan, inf or 1e30 means nothing), else argparse's own error
    with the range (``argument --dp: -1 is not >= 1``, ``argument --gpu-mem: nan is not a finite number: give one in
    (0, 4096]``)."""
    low = f"{'>' if strict else '>='} {minimum:g}"
    within = low if maximum is None else f"in {'(' if strict else '['}{minimum:g}, {maximum:g}]"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number: give one {within}")
        if value < minimum or (strict and value == minimum) or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text} is not {within}")
        return value

    parse.__name__ = kind.__name__
    return parse
