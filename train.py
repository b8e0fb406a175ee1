"""Train Llama with DeepSpeed pipeline parallelism (pipe x data), configured by Hydra.

    deepspeed --num_gpus 4 train.py model_name_or_path=CKPT_DIR num_stages=2 data.train_file=train.jsonl
    deepspeed --num_gpus 4 train.py model=tiny model.tokenizer=TOK_DIR num_stages=2 ...   # from scratch
    python train.py --cfg job            # print the resolved config and exit

``main`` reads like the table of contents: config -> topology -> pipeline model -> weights -> data ->
engine -> resume -> loop (eval, checkpoints). Each step is a short function below it.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from datetime import timedelta

# The DeepSpeed launcher appends --local_rank=N to the arguments, which Hydra rejects as an override.
# The same value is in the LOCAL_RANK environment variable, so the argument is dropped before Hydra parses.
sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]

from training.logs import argv_log_level, quiet_dependencies, set_log_level  # noqa: E402
from training.startup import StartupWatchdog, use_venv_extensions_dir  # noqa: E402

# Before deepspeed is imported: its ops build into this virtualenv's own cache (training/startup.py), and
# the known-harmless lines of its import are filtered (training/logs.py).
EXTENSIONS_DIR = use_venv_extensions_dir()
quiet_dependencies(argv_log_level(sys.argv))

import deepspeed  # noqa: E402
import hydra  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from data.checks import default_packing  # noqa: E402
from data.guard import OrderMismatchError  # noqa: E402
from models.families import family_of  # noqa: E402
from models.host_memory import current_rss_mb, peak_rss_mb  # noqa: E402
from models.layer_files import full_numel, is_partitioned, load_stage_weights, local_modules, stage_pieces  # noqa: E402
from models.llama_pipe import ATTENTION_IMPLEMENTATIONS, LlamaStack, flops_per_token, init_weights_, spec_layout  # noqa: E402
from models.lora import apply_lora, base_numel, base_record, load_adapter_, load_checkpoint_adapters_  # noqa: E402
from models.loss import CausalLMLoss, PreferenceLoss, label_tokens  # noqa: E402
from models.zero3 import build_partitioned_stack, builds_partitioned, init_partitioned_, partition_bytes  # noqa: E402
from parallel.dualpipev import mend_engine  # noqa: E402
from parallel.partition import build_pipeline_model  # noqa: E402
from parallel.tensor_parallel import replica_differences  # noqa: E402
from training import run_checkpoints  # noqa: E402
from training.config import (  # noqa: E402
    ConfigError,
    Resolved,
    TrainConfig,
    given_keys,
    override_key_problems,
    register_configs,
    resolve,
    unknown_key_problems,
)
from training.data_setup import EvalSet, RankData, prepare_rank_data  # noqa: E402
from training.distributed import (  # noqa: E402
    StartupError,
    TrainingStopped,
    exit_finished_run,
    free_port,
    on_all_ranks,
    release_cpu_comm_buffer,
)
from training.hang import HangWatch  # noqa: E402
from training.memory_census import CensusAtStep, StepPeak  # noqa: E402
from training.metrics import StepLogger, device_peak_tflops  # noqa: E402
from training.optim import (  # noqa: E402
    apply_optim_settings,
    build_lr_scheduler,
    fill_ds_config,
    param_groups,
    reduce_grad_norm_once_across_stages,
)
from training.preemption import (  # noqa: E402
    PREEMPTED_EXIT_CODE,
    STOP_SIGNALS,
    Preempted,
    StopAndSave,
    clear_stale_marker,
    exit_if_exiting,
    stop_at_once_on_signals,
)
from training.preference import prepare_reference, step_metrics  # noqa: E402
from training.run_lock import RunLock  # noqa: E402
from training.straggler import ComputeClock  # noqa: E402

register_configs()

PADDING_HINT = 0.10  # padding share of unpacked rows above which the start-up line suggests packing


def log0(msg: str) -> None:
    """Print from global rank 0 only."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[train] {msg}", flush=True)


def resolve_config(dict_cfg: DictConfig) -> Resolved:
    """Typed config, validated before any process group exists (all problems reported together)."""
    unknown = unknown_key_problems(OmegaConf.to_container(dict_cfg))  # to_object would drop them silently
    cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
    given = given_keys(HydraConfig.get().overrides.task)
    resolved = resolve(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")), problems=unknown, given=given)
    for line in resolved.adapted:
        log0(f"adapted: {line}")
    for warning in resolved.warnings:
        log0(f"warning: {warning}")
    return resolved


def init_topology(resolved: Resolved) -> PipeDataParallelTopology:
    """Start the process group and lay ranks out as pipe x data, or pipe x data x tensor (pipe is the outer axis).

    ``python train.py`` without the launcher runs as a 1-rank job. Until the process group exists no
    collective timeout applies, so a watchdog bounds the wait (``startup_timeout_s``) and says where it was.
    """
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    release_cpu_comm_buffer()  # a killed job's segment of this name would be attached to (no peer has started yet)
    with StartupWatchdog(resolved.cfg.startup_timeout_s, int(os.environ["RANK"]), EXTENSIONS_DIR) as watchdog:
        watchdog.phase(
            f"joining the process group (rendezvous at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
            f"with {resolved.world_size} ranks, DeepSpeed loading its communication op)"
        )
        # Every collective fails after dist_timeout_s instead of waiting forever for a hung or vanished rank.
        deepspeed.init_distributed(timeout=timedelta(seconds=resolved.cfg.dist_timeout_s))
    # DeepSpeed's data axis holds the sequence groups (parallel/sequence_parallel.py) and the data-parallel ranks
    data_axis = resolved.layout.data_axis
    if resolved.layout.tp > 1:  # the model axis varies fastest: a tensor-parallel group is consecutive ranks (a node)
        return PipeModelDataParallelTopology(
            num_pp=resolved.cfg.num_stages, num_mp=resolved.layout.tp, num_dp=data_axis
        )
    return PipeDataParallelTopology(num_pp=resolved.cfg.num_stages, num_dp=data_axis)


def lock_output_dir(resolved: Resolved) -> RunLock | None:
    """Rank 0 holds output_dir for the run's lifetime (training/run_lock.py): a second run on it stops
    here on every rank, before it writes anything there. Returns rank 0's lock."""
    lock = RunLock(resolved.cfg.output_dir) if dist.get_rank() == 0 else None

    def acquire() -> None:
        warning = lock.acquire() if lock else None
        if warning:
            log0(warning)

    on_all_ranks("locking output_dir", acquire)
    return lock


def build_loss(resolved: Resolved) -> CausalLMLoss | PreferenceLoss:
    """The last stage's loss: the next-token loss (train_step sets its normalisation each step), or DPO's."""
    cfg = resolved.cfg
    if cfg.train_objective == "dpo":
        return PreferenceLoss(cfg.loss_chunk_tokens, cfg.dpo.beta, cfg.dpo.loss_type, cfg.dpo.label_smoothing)
    return CausalLMLoss(cfg.loss_chunk_tokens)


def build_model(resolved: Resolved, topology: PipeDataParallelTopology, loss_fn: CausalLMLoss | PreferenceLoss):
    """The pipeline module (this rank builds only its own stage's layers), or, for num_stages=1 with
    ZeRO 2/3, every spec in one module for DeepSpeed's data-parallel engine: under ZeRO-3 built
    partitioned (``deepspeed.zero.Init``, models/zero3.py), no rank ever holding the whole model."""
    cfg = resolved.cfg
    if not resolved.uses_pipeline:
        stack_args = dict(
            activation_checkpointing=cfg.activation_checkpoint_interval > 0,
            loss_chunk_tokens=cfg.loss_chunk_tokens,
            attention=ATTENTION_IMPLEMENTATIONS[cfg.attention],
        )
        ds_config = fill_ds_config(resolved)
        if builds_partitioned(ds_config):
            return build_partitioned_stack(resolved.model_config, ds_config, **stack_args)
        return LlamaStack(resolved.model_config, **stack_args)
    return build_pipeline_model(
        resolved.model_config,
        topology,
        cfg.partition_method,
        cfg.activation_checkpoint_interval,
        loss_fn,
        layout=resolved.layout,
        loss_chunk_tokens=cfg.loss_chunk_tokens,
        dynamic_shape=cfg.data.pad_to_multiple_of > 0,
        attention=ATTENTION_IMPLEMENTATIONS[cfg.attention],
        sequence_parallel=resolved.layout.sp,
        schedule=resolved.layout.schedule,
    )


def init_weights(model, resolved: Resolved, rss_before_model_mib: float) -> list[dict]:
    """This stage's starting weights: its layer files from model_name_or_path, a seeded from-scratch
    initialisation, or nothing yet when resuming (the checkpoint's weights replace them). A ZeRO-3
    stack built partitioned is filled one tensor at a time, each rank keeping its own partition.
    Returns every rank's report, for the announcement."""
    cfg, config = resolved.cfg, resolved.model_config

    params = [p for _, m in local_modules(model) for p in m.parameters()]
    partitioned = any(map(is_partitioned, params))

    def init() -> dict:
        start, loaded_mib = time.time(), 0.0
        if resolved.resume_tag and not resolved.reshard and not resolved.lora:
            source = f"resuming {resolved.resume_tag}"  # DeepSpeed's load_checkpoint fills the stage
        elif resolved.from_scratch and not resolved.resume_tag:
            layout = spec_layout(config)
            for index, module in local_modules(model):
                seed = cfg.seed + layout[index].file_index
                if partitioned:
                    init_partitioned_(module, model._layer_specs[index], config, seed)
                else:
                    init_weights_(module, config, seed=seed)
            source = f"initialised from scratch (model={cfg.model.name}, seed {cfg.seed})"
        else:  # model_name_or_path's layer files (a LoRA run's base), or, resuming on another layout, the checkpoint's
            ckpt_dir, tag = (
                (cfg.output_dir, resolved.resume_tag)
                if resolved.resume_tag and not resolved.lora
                else (cfg.model_name_or_path, None)
            )
            report = load_stage_weights(model, config, ckpt_dir, tag)
            loaded_mib = report.bytes_read / 2**20
            source = f"loaded {loaded_mib:.1f} MiB from {len(report.files)} layer files" + (f" of {tag}" if tag else "")
            if resolved.lora:
                model.lora_base = base_record(ckpt_dir, report.files)  # saved with each checkpoint, checked on resume
        if partitioned:
            source += f", ZeRO-3 partitioned at build: this rank holds {partition_bytes(params) / 2**20:.1f} MiB"
        return {
            "stage": model.stage_id,
            "specs": [i for start, stop, _ in stage_pieces(model) for i in range(start, stop)],
            "params": sum(full_numel(p) for p in params),
            "param_mib": sum(full_numel(p) * p.element_size() for p in params) / 2**20,
            "source": source,
            "seconds": time.time() - start,
            "rss_before_model_mib": rss_before_model_mib,
            "peak_rss_mib": peak_rss_mb(),
        }

    return on_all_ranks("initialising stage weights", init)


def adapt(model, resolved: Resolved) -> list[str]:
    """LoRA (peft.method=lora): this stage's base frozen, PEFT's LoRA layers injected into its decoder
    layers (models/lora.py), started from peft.init_from's adapter when given. Returns every rank's line."""
    cfg = resolved.cfg

    def inject() -> str:
        local = local_modules(model)
        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision, torch.float32)
        apply_lora(local, resolved.model_config, cfg.peft, cfg.seed, compute, get_accelerator().current_device_name())
        if resolved.reshard:  # DeepSpeed's load does not apply: the adapters from the checkpoint's layer files
            load_checkpoint_adapters_(local, resolved.model_config, os.path.join(cfg.output_dir, resolved.resume_tag))
        elif cfg.peft.init_from and not resolved.resume_tag:  # its settings were checked with the config
            load_adapter_(local, resolved.model_config, cfg.peft.init_from)
        trained = sum(full_numel(p) for _, m in local for p in m.parameters() if p.requires_grad)
        frozen = sum(base_numel(p) for _, m in local for p in m.parameters() if not p.requires_grad)
        if resolved.resume_tag:
            start = f"from {resolved.resume_tag}, loaded with the optimizer states"
        else:
            start = f"from {cfg.peft.init_from}" if cfg.peft.init_from else "PEFT's initialisation"
        return f"{trained / 1e6:.3f} M trained ({start}), {frozen / 1e6:.2f} M frozen"

    if not resolved.lora:
        return []
    return on_all_ranks("adding LoRA adapters", inject)


def build_data(resolved: Resolved, topology: PipeDataParallelTopology) -> tuple[RankData, list[dict]]:
    """This rank's data (who tokenizes, who reads, placeholders: training/data_setup.py) and every
    rank's data report, for the announcement."""
    coord = topology.get_coord(dist.get_rank())
    # the ranks of a sequence group read the same samples: their data coordinate is the group's
    coord = coord._replace(data=coord.data // resolved.layout.sp)
    data = prepare_rank_data(resolved.cfg, resolved.model_config, coord, resolved.dp)
    reports = on_all_ranks("reporting data", lambda: {"role": data.role, "peak_rss_mib": peak_rss_mb()})
    return data, reports


def plan_steps(resolved: Resolved, data: RankData) -> tuple[int, float]:
    """(optimizer steps to train, steps per epoch): max_steps, or num_epochs passes, whichever is first."""
    cfg = resolved.cfg
    micro_per_epoch = len(data.train) // resolved.dp // cfg.micro_batch_size  # per data-parallel rank
    steps_per_epoch = micro_per_epoch / cfg.gradient_accumulation_steps
    total = cfg.max_steps
    if cfg.num_epochs:
        epoch_steps = math.ceil(cfg.num_epochs * steps_per_epoch)
        total = min(total, epoch_steps) if total else epoch_steps
    return total, steps_per_epoch


def build_engine(resolved: Resolved, model, total_steps: int):
    """DeepSpeed's pipeline engine with AdamW and the LR schedule from the Hydra config."""
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, resolved.cfg.optim.weight_decay),
        config=fill_ds_config(resolved),
        lr_scheduler=build_lr_scheduler(resolved.cfg, total_steps),
    )
    reduce_grad_norm_once_across_stages(engine.optimizer)
    mend_engine(engine)
    run_checkpoints.load_without_pickles(engine)
    return engine


def resume_or_start(resolved: Resolved, engine, data: RankData, total_steps: int) -> int:
    """The step to continue after: 0 for a new run, the checkpoint's step with resume=auto. Settings
    changed since the checkpoint (validation refused those not allowed) are stated, and the optimizer's
    are applied over the restored ones."""
    if not resolved.resume_tag:
        return 0
    local: dict = {}
    if resolved.reshard:
        log0(
            f"resume: {resolved.resume_tag} was saved on another layout ({resolved.reshard}): its optimizer states "
            "are read per parameter (training/reshard.py)"
        )
        start = time.time()
        on_all_ranks(
            "reading optimizer states per parameter",
            lambda: local.update(state=run_checkpoints.restore_resharded(resolved, engine, data.iterator, total_steps)),
        )
        step = local["state"]["step"]
        log0(f"resume: optimizer states of every parameter set in {time.time() - start:.1f} s")
    else:
        on_all_ranks(
            "reading trainer state", lambda: local.update(state=run_checkpoints.read_trainer_state(resolved, engine))
        )
        step = run_checkpoints.restore(resolved, engine, data.iterator, local["state"])
    saved_batch = local["state"].get("global_batch", resolved.layout.global_batch)
    if saved_batch != resolved.layout.global_batch:
        log0(
            f"resume: the global batch changes from {saved_batch} to {resolved.layout.global_batch} samples: the run "
            f"continues at the next unseen sample, the LR schedule at step {step + 1}"
        )
    changes = resolved.resume_changes
    if changes.changed.get("optim"):
        apply_optim_settings(engine, resolved.cfg, total_steps)
    for cls, effect in (
        ("free", "as given"),
        ("layout", "as given"),
        ("optim", f"applied from step {step + 1}, the schedule recomputed"),
        ("data", "the new sample stream continues at the saved position"),
        ("model", "the checkpoint's weights are used"),
    ):
        if changes.changed.get(cls):
            log0(f"resume: changed since {resolved.resume_tag}: {', '.join(changes.lines(cls))} ({effect})")
    return step


def announce(
    resolved: Resolved,
    engine,
    init_reports: list[dict],
    lora_reports: list[str],
    data_reports: list[dict],
    data: RankData,
    start_step: int,
    total_steps: int,
    steps_per_epoch: float,
) -> None:
    """Print, from rank 0, what was built: engine, per rank its stage, specs, parameters, weights and data."""
    cfg = resolved.cfg
    offload = resolved.ds_json.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    stage = engine.zero_optimization_stage()
    # DeepSpeed's ZeRO-1/2 gradient path (training/optim.py sets both off on CPU): say which one runs.
    grads = (
        f", reduce-scatter {engine.zero_reduce_scatter()}, contiguous gradients {engine.zero_contiguous_gradients()}"
        if stage in (1, 2)
        else ""
    )
    log0(
        f"engine: {type(engine).__name__}, ZeRO stage {stage}{grads}, optimizer "
        f"{type(engine.basic_optimizer).__name__} (offload: {offload}), precision {cfg.precision}"
    )
    if resolved.layout.schedule == "dualpipev":
        deferring = on_all_ranks("counting deferrable layers", lambda: engine.weight_grads.layers)
        log0(
            f"schedule: DualPipeV, {resolved.layout.pieces} pieces, two per pipeline rank; zero bubble: the weight "
            f"gradients of {', '.join(map(str, deferring))} linear layers (per rank) deferred where DualPipe does"
        )
    model, every = resolved.model_config, cfg.activation_checkpoint_interval
    log0(
        f"model: {family_of(model).causal_lm.__name__}'s layers (model_type {model.model_type}), "
        f"{model.num_hidden_layers} decoder layers | partition_method={cfg.partition_method}"
        + (f" | activation checkpointing every {every} decoder layer(s)" if every else "")
    )
    if resolved.lora:
        p = cfg.peft
        log0(
            f"peft: {'QLoRA' if p.quantize == 'nf4' else 'LoRA'} r={p.r} alpha={p.alpha:g}"
            f"{' (rsLoRA)' if p.use_rslora else ''}{' DoRA' if p.use_dora else ''} "
            f"dropout={p.dropout:g} on {', '.join(p.target_modules)}"
            + (f"; trained fully: {', '.join(p.modules_to_save)}" if p.modules_to_save else "")
            + " | base frozen: no gradients, no optimizer state, not saved in checkpoints"
            + ("; its decoder linear layers quantised to NF4 (bitsandbytes)" if p.quantize == "nf4" else "")
        )
    layout = resolved.layout
    rows = "at most" if cfg.data.pad_to_multiple_of else "padding included, rows of"
    if cfg.train_objective == "dpo":
        dpo = cfg.dpo
        loss = (
            f"DPO loss ({dpo.loss_type}, beta {dpo.beta:g}"
            + (f", label smoothing {dpo.label_smoothing:g}" if dpo.label_smoothing else "")
            + ") averaged over the global batch's pairs; a sample is a pair, fed as its chosen and rejected rows"
        )
    else:
        per = "label token of the global batch" if cfg.loss_normalization == "tokens" else "micro-batch"
        loss = f"loss normalised per {per} (loss_normalization={cfg.loss_normalization})"
    log0(f"world {layout.world_size} = {layout.axes()} | {layout.batch_line()} ({rows} {layout.seq_len}) | {loss}")
    if dist.get_rank() == 0:  # the rank that prints; a first stage, so it reads the data
        padding = 1 - data.train.total_tokens() / (len(data.train) * layout.rows_per_sample * cfg.data.max_seq_length)
        many = not default_packing(cfg.data) and padding >= PADDING_HINT
        if cfg.data.pad_to_multiple_of:
            fed = f"each micro-batch cut to its longest row, up to a multiple of {cfg.data.pad_to_multiple_of}"
            hint = " (data.group_by_length=true pads less)" if many and not cfg.data.group_by_length else ""
        else:
            # only what this run could take: DPO refuses packing, DualPipeV a pad multiple
            cures = [c for c, ok in (("data.packing=true", cfg.train_objective != "dpo"),
                                     ("data.pad_to_multiple_of=8", layout.schedule != "dualpipev")) if ok]
            fed, hint = "every row fed whole", f" (consider {' or '.join(cures)})" * (many and bool(cures))
        log0(f"data: rows of {cfg.data.max_seq_length} tokens, {100 * padding:.1f}% padding; {fed}{hint}")
    if not resolved.resume_tag and total_steps == 0:
        plan = "no step to train (max_steps=0): the weights are loaded and checked only"
    elif start_step >= total_steps:
        plan = (
            f"{resolved.resume_tag} is at step {start_step} >= {total_steps} steps to train: nothing to train "
            "(raise max_steps)"
        )
    else:
        plan = f"steps {start_step + 1}..{total_steps}" + (
            f" (resumed from {resolved.resume_tag})" if start_step else ""
        )
    evals = ", ".join(f"{e.samples}{f' ({e.name})' if e.name else ''}" for e in data.evals) or "0"
    log0(f"data: {len(data.train)} training samples ({steps_per_epoch:.1f} steps/epoch), {evals} eval samples | {plan}")
    if data.sources and dist.get_rank() == 0:  # a first stage: it holds the mixture
        mix = data.train
        log0(
            "data: a mixture of "
            + ", ".join(
                f"{name} (weight {w:g}: {n} of each epoch's {len(mix)} samples, {size} rows)"
                for name, w, n, size in zip(mix.names, mix.weights, mix.counts, mix.sizes)
            )
        )
    for rank, (info, d) in enumerate(zip(init_reports, data_reports)):
        log0(
            f"rank {rank}: stage {info['stage']} specs {spec_ranges(info['specs'])} "
            f"({len(info['specs'])} specs, {info['params'] / 1e6:.2f} M params) | {info['source']} in "
            f"{info['seconds']:.2f} s "
            f"| peak RSS at load {info['peak_rss_mib']:.0f} MiB (before building the stage "
            f"{info['rss_before_model_mib']:.0f} MiB, stage parameters {info['param_mib']:.0f} MiB)"
        )
        if lora_reports:
            log0(f"rank {rank}: LoRA {lora_reports[rank]}")
        log0(f"rank {rank}: data {d['role']} | peak RSS after data {d['peak_rss_mib']:.0f} MiB")


def spec_ranges(specs: list[int]) -> str:
    """``0..3``, or ``0..1, 6..7`` for the two pieces of a DualPipeV rank (``2`` for a piece of one spec)."""
    runs = [[specs[0], specs[0]]]
    for i in specs[1:]:
        if i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}..{b}" if b > a else str(a) for a, b in runs)


def check_tensor_parallel_replicas(model, resolved: Resolved) -> None:
    """At the end of a run with tensor_parallel > 1: every replicated parameter is the same on the TP peers."""
    if resolved.layout.tp == 1:
        return
    differ = replica_differences(model, model._grid.get_slice_parallel_group())
    reports = on_all_ranks("checking the tensor-parallel replicas", lambda: differ)
    bad = sorted({d for r in reports for d in r})
    if bad:
        raise TrainingStopped("replicated parameters differ between tensor-parallel peers: " + ", ".join(bad[:5]))
    log0("tensor-parallel peers hold identical replicated parameters (norms, row-parallel biases)")


def counts_tokens(resolved: Resolved, engine) -> bool:
    """Whether this rank counts its micro-batches' tokens: the stage holding the labels (the last; the first
    pipeline rank with DualPipeV), of its tensor-parallel and sequence-parallel peers (which hold the same
    micro-batch) the first; or every rank of the data-parallel engine. Their sum over all ranks covers the
    global batch once."""
    if not resolved.uses_pipeline:
        return True
    first_of_sequence_group = engine.grid.get_data_parallel_rank() % resolved.layout.sp == 0
    # DualPipeV: the first pipeline rank holds the loss (its engine's is_last_stage depends on the phase)
    holds_labels = engine.stage_id == 0 if resolved.layout.schedule == "dualpipev" else engine.is_last_stage()
    return holds_labels and engine.grid.get_slice_parallel_rank() == 0 and first_of_sequence_group


def global_sum(*values: int) -> list[int]:
    """Every rank's values summed over all ranks (a collective: every rank calls it)."""
    total = torch.tensor(values, dtype=torch.int64, device=get_accelerator().current_device_name())  # NCCL: on the GPU
    dist.all_reduce(total)
    return total.tolist()


def normalise_loss(resolved: Resolved, loss_fn: CausalLMLoss, micro_batches: int, label_count: int) -> None:
    """Set the loss scale for the next step or eval pass: ``micro_batches`` per data-parallel rank
    whose ``label_count`` label tokens (all ranks) make the denominator. DeepSpeed divides each
    micro-batch's loss by ``micro_batches`` and averages over its data axis (dp x sequence_parallel: each
    rank of a sequence group sums its slice's token losses), so scaling by their product over the count gives
    the token mean of the whole global batch."""
    if resolved.cfg.train_objective == "dpo":
        return  # DPO's loss is a mean over each micro-batch's pairs: DeepSpeed's own divisions make the global mean
    if resolved.cfg.loss_normalization == "micro_batch":
        loss_fn.scale = None
    elif label_count == 0:  # the data cache drops rows without a label token: a bug if ever seen
        raise TrainingStopped("a global batch without a label token reached the loss: nothing to normalise by")
    else:
        loss_fn.scale = micro_batches * resolved.layout.data_axis / label_count


def train_step(resolved: Resolved, engine, data: RankData, loss_fn: CausalLMLoss) -> tuple[float, list[int]]:
    """One optimizer step: the loss and the global batch's counts, identical on every rank: real tokens, label
    tokens, tokens computed on (the micro-batches' rows with their padding), then real tokens per source of a
    mixture (data.sources).

    The ranks that count tokens take the step's micro-batches from their iterator first, so the global
    label count is known before the first micro-batch's loss is computed; the engine then reads them
    from that list (the first stage of a longer pipeline reads its own iterator as before).
    """
    gas = resolved.cfg.gradient_accumulation_steps
    batches, counts = None, [0] * (3 + len(data.sources))
    if counts_tokens(resolved, engine):
        before, by_source = data.iterator.tokens_read, dict(data.iterator.tokens_by_source)
        batches = [next(data.iterator) for _ in range(gas)]
        counts[:3] = (
            data.iterator.tokens_read - before,
            sum(label_tokens(labels) for _, labels in batches),
            sum(input_ids.numel() for (input_ids, _), _ in batches),
        )
        for i in range(len(data.sources)):
            counts[3 + i] = data.iterator.tokens_by_source.get(i, 0) - by_source.get(i, 0)
    counts = global_sum(*counts)
    normalise_loss(resolved, loss_fn, gas, counts[1])
    if resolved.uses_pipeline:
        loss = engine.train_batch(data_iter=iter(batches) if batches is not None else data.iterator).item()
        return loss, counts
    losses = []
    for (input_ids, position_ids), labels in batches:
        loss = loss_fn(engine(input_ids, position_ids), labels)
        engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
        engine.step()  # applies the optimizer at the accumulation boundary only
        losses.append(loss.detach())
    return mean_over_ranks(torch.stack(losses).mean()), counts


def eval_label_count(resolved: Resolved, engine, data: RankData, evaluation: EvalSet) -> int:
    """Label tokens of the whole eval set (every rank's shard): the eval loss's denominator."""
    local = 0
    if counts_tokens(resolved, engine):
        batches = itertools.islice(data.eval_iterator(evaluation), evaluation.batches)
        local = sum(label_tokens(labels) for _, labels in batches)
    return global_sum(local)[0]


def evaluate(
    resolved: Resolved,
    engine,
    data: RankData,
    evaluation: EvalSet,
    step: int,
    logger: StepLogger,
    loss_fn: CausalLMLoss,
    label_count: int,
) -> None:
    """One pass over an eval set (every rank's shard), without gradients; with loss_normalization=tokens
    the loss is the mean over every label token of the set."""
    start, n = time.time(), evaluation.batches
    normalise_loss(resolved, loss_fn, n, label_count)
    if resolved.uses_pipeline:
        loss = engine.eval_batch(data_iter=data.eval_iterator(evaluation), num_micro_batches=n).item()
    else:
        engine.eval()
        with torch.no_grad():
            batches = itertools.islice(data.eval_iterator(evaluation), n)
            losses = [loss_fn(engine(ids, pos), labels) for (ids, pos), labels in batches]
        engine.train()
        loss = mean_over_ranks(torch.stack(losses).mean())
    extra = None
    if resolved.cfg.train_objective == "dpo":
        extra = step_metrics(loss_fn, counts_tokens(resolved, engine), prefix="eval_")
    logger.log_eval(step, loss, time.time() - start, evaluation.name, extra)


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over all ranks (data-parallel engine: every rank is a replica)."""
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train(resolved: Resolved, engine, data: RankData, loss_fn: CausalLMLoss, start_step: int, total_steps: int) -> None:
    """Steps ``start_step + 1 .. total_steps``: train, check the data order, log, evaluate, save."""
    cfg = resolved.cfg
    peak = device_peak_tflops(cfg.precision, cfg.mfu_peak_tflops)
    six_n, attention = flops_per_token(resolved.model_config, resolved.layout.seq_len)
    l = resolved.layout
    layout = {"pipe": l.stages, "tensor": l.tp, "sequence": l.sp, "data": l.dp}
    logger = StepLogger(
        cfg.output_dir,
        total_steps,
        cfg.log_steps,
        dist.get_rank() == 0,
        start_step,
        flops_per_token=six_n + attention,
        peak_flops=peak * 1e12 * resolved.world_size if peak else None,
        layout=layout,
        sources=data.sources,
        sinks=[tracking_run(resolved, layout)] if cfg.monitor.wandb and dist.get_rank() == 0 else None,
    )
    eval_labels = [eval_label_count(resolved, engine, data, e) for e in data.evals]
    last_saved = start_step if resolved.resume_tag else None
    stopper = StopAndSave(
        cfg.save_every_minutes, cfg.preempt_grace_s, dist.get_rank(), get_accelerator().current_device_name()
    )
    clock = ComputeClock() if resolved.uses_pipeline else None  # the straggler view (training/straggler.py)
    watch = HangWatch(cfg.output_dir, dist.get_rank(), dist.get_world_size(), cfg.hang_timeout_s, cfg.hang_action)
    census = CensusAtStep(engine)  # model-state bytes per rank, measured before the second optimizer step
    step_peak = StepPeak(start_step + 2, cfg.count_step_memory)  # what the second step allocates beyond the states
    skipped: list[int] = []  # steps whose update the optimizer skipped (non-finite), with nonfinite_loss=skip
    try:
        for step in range(start_step + 1, total_steps + 1):
            lr = engine.get_lr()[0]  # the rate this step uses; the scheduler advances inside the step
            skipped_before = engine.skipped_steps
            step_peak.before(step)
            watch.step_started(step)
            loss, counts = train_step(resolved, engine, data, loss_fn)
            watch.step_ended()
            # every rank: signals, rank 0's save clock, each rank's compute seconds (one all-reduce)
            signalled, clock_due, compute = stopper.after_step(clock.take() if clock else 0.0)
            step_peak.after(step)
            data.guard.after_step(step)
            if data.guard.enabled and step == min(total_steps, data.guard.check_steps):
                log0(
                    f"data order check passed: first and last stage of every pipeline"
                    f"{' (and their tensor-parallel peers)' if resolved.layout.tp > 1 else ''} loaded the same "
                    f"{data.guard.compared} micro-batches in steps {start_step + 1}..{step}"
                )
            grad_norm = engine.get_global_grad_norm()  # a tensor, a float, or None when the optimizer keeps none
            norm = None if grad_norm is None else float(grad_norm)
            extra = step_metrics(loss_fn, counts_tokens(resolved, engine)) if cfg.train_objective == "dpo" else None
            logger.log(step, loss, lr, norm, *counts[:3], counts[3:], compute=compute if clock else None, extra=extra)
            check_finite(resolved, step, loss, engine.skipped_steps > skipped_before, last_saved, skipped)
            # the checkpoint first: an eval that fails (or a signal during it) never costs the steps trained
            with watch.saving():  # a hang exit (training/hang.py) waits for the save
                stop = save_if_due(resolved, engine, data, step, total_steps, stopper, signalled, clock_due)
            if stop is not None:
                last_saved = step
            if data.evals and ((cfg.eval_steps and step % cfg.eval_steps == 0) or step == total_steps):
                for evaluation, labels in zip(data.evals, eval_labels):
                    evaluate(resolved, engine, data, evaluation, step, logger, loss_fn, labels)
            if stop:  # after a stop signal, the step's eval done: a resume starts at the next step
                raise Preempted(stop)
    finally:  # a stop signal (Preempted) or a failure: the W&B run and metrics.jsonl are closed too
        logger.close()
    if last_saved is None:
        log0("no step to train (max_steps=0): nothing trained, no checkpoint written")
    peaks = on_all_ranks("reporting memory", peak_memory_mib)
    log0("peak memory per rank (MiB): " + ", ".join(f"rank {r} {p}" for r, p in enumerate(peaks)))
    states = on_all_ranks("measuring model states", lambda: census.result)
    if all(states):
        log0(
            "model states per rank (MiB, tensors held: weights + grads + optimizer = total): "
            + ", ".join(
                f"rank {r} {s['weights'] / 2**20:.2f} + {s['grads'] / 2**20:.2f} + {s['optimizer'] / 2**20:.2f} = "
                f"{s['total'] / 2**20:.2f}"
                for r, s in enumerate(states)
            )
        )
    step_peaks = on_all_ranks("measuring the step's peak", lambda: step_peak.result_mib)
    if all(p is not None for p in step_peaks):
        where = "GPU allocator" if torch.cuda.is_available() else "tensors counted on CPU"
        log0(
            f"step {step_peak.at} peak of allocated tensors above its start per rank (MiB, {where}; gradients, "
            "activations, loss buffer, temporaries): "
            + ", ".join(f"rank {r} {p:.1f}" for r, p in enumerate(step_peaks))
        )


def save_if_due(
    resolved: Resolved,
    engine,
    data: RankData,
    step: int,
    total_steps: int,
    stopper: StopAndSave,
    signalled: list[int],
    clock_due: bool,
) -> str | None:
    """Save after ``step`` when save_steps, the end, save_every_minutes or a stop signal says so (the ranks agreed
    on the last two after the step, training/preemption.py). Returns None when nothing was saved; else, after a
    signal before the last step, the line the job stops with (the caller raises it), or ""."""
    cfg = resolved.cfg
    if not ((cfg.save_steps and step % cfg.save_steps == 0) or step == total_steps or clock_due or signalled):
        return None
    start = time.time()
    tag = run_checkpoints.save(resolved, engine, step, data.iterator)
    stopper.saved()
    rss = on_all_ranks("reporting memory", current_rss_mb)
    why = f", {cfg.save_every_minutes:g} minutes since the last" if clock_due else ""
    log0(
        f"saved checkpoint {tag} in {cfg.output_dir}{why} (RSS per rank now: {', '.join(f'{r:.0f}' for r in rss)} "
        f"MiB; peak RSS {peak_rss_mb():.0f} MiB)"
    )
    if signalled and step < total_steps:  # in the last step: the run is complete, exit 0
        return (
            f"stop signal ({'/'.join(STOP_SIGNALS)}) on rank(s) {signalled}: checkpoint {tag} saved after step {step} "
            f"of {total_steps} in {time.time() - start:.1f} s; exiting with code {PREEMPTED_EXIT_CODE}. The same "
            "command (resume=auto) continues from it exactly."
        )
    return ""


def tracking_run(resolved: Resolved, layout: dict):
    """Rank 0's W&B run (monitor.wandb): the resolved config and the layout as its config."""
    from training.tracking import WandbRun

    config = OmegaConf.to_container(OmegaConf.structured(resolved.cfg))
    return WandbRun(resolved.cfg.monitor, resolved.cfg.output_dir, {**config, "layout": layout})


def check_finite(
    resolved: Resolved, step: int, loss: float, update_skipped: bool, last_saved: int | None, skipped: list[int]
) -> None:
    """A non-finite loss (or gradient: the optimizer skipped the update) never passes silently.

    ``nonfinite_loss=stop`` raises on every rank (the loss and the optimizer's skip are the same on
    all ranks), naming the step and the last good checkpoint; ``skip`` logs the step and goes on,
    but only where the optimizer did skip the update: where it applied a non-finite one (ZeRO 0 in
    fp32 checks nothing), the weights are lost, and training stops either way. fp16's loss-scale
    overflows (finite loss, skipped update) are routine and pass.
    """
    cfg = resolved.cfg
    bad_loss = not math.isfinite(loss)
    if not bad_loss and (not update_skipped or cfg.precision == "fp16"):
        return
    what = (
        f"loss is {loss}"
        if bad_loss
        else f"loss {loss:.4f} but non-finite gradients (the optimizer skipped the update)"
    )
    if cfg.nonfinite_loss == "skip" and update_skipped:
        skipped.append(step)
        log0(
            f"warning: step {step}: {what}: update skipped (nonfinite_loss=skip; {len(skipped)} skipped: steps "
            f"{skipped})"
        )
        return
    if last_saved is not None:
        last = f"{os.path.join(cfg.output_dir, run_checkpoints.tag_for(last_saved))} (resume=auto continues from it)"
    else:
        last = f"none in {cfg.output_dir} (start again from {cfg.model_name_or_path or 'scratch'})"
    if update_skipped:
        advice = (
            "The optimizer skipped this update; nothing after the last good checkpoint is saved. Lower optim.lr, "
            "raise optim.warmup_steps, check this step's data, or set nonfinite_loss=skip to skip such steps."
        )
    else:
        advice = (
            f"The optimizer applied this update (ZeRO stage {resolved.zero_stage} with {cfg.precision} checks no "
            f"overflow): the weights are no longer finite and are not saved. Lower optim.lr or raise "
            f"optim.warmup_steps (nonfinite_loss=skip needs an optimizer that skips such updates, e.g. ds=zero1)."
        )
    raise TrainingStopped(
        f"step {step}: {what}: training stopped (nonfinite_loss={cfg.nonfinite_loss}). "
        f"Last good checkpoint: {last}. {advice}"
    )


def peak_memory_mib() -> str:
    """This rank's peak host RSS, and its peak accelerator memory where there is one."""
    host = f"host {peak_rss_mb():.0f}"
    if torch.cuda.is_available():
        return f"{host} / GPU {torch.cuda.max_memory_allocated() / 2**20:.0f}"
    return host


# An absolute path: Hydra resolves a relative one against the calling module, which breaks imports of train.
@hydra.main(
    version_base="1.3",
    config_path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf"),
    config_name="config",
)
def main(dict_cfg: DictConfig) -> None:
    try:
        resolved = resolve_config(dict_cfg)
    except ConfigError as e:
        fail(str(e))
    set_log_level(resolved.cfg.log_level)
    try:
        topology = init_topology(resolved)
    except RuntimeError as e:  # torch's DistNetworkError is one
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
            raise
        fail(
            f"the master port {os.environ['MASTER_PORT']} is in use (another job on this machine?): launch with "
            "another "
            f"port, `deepspeed --master_port PORT ...` (or MASTER_PORT=PORT for torchrun/SLURM)"
        )
    lock, code = None, 0
    try:
        lock = lock_output_dir(resolved)
        on_all_ranks("creating output_dir", lambda: make_output_dir(resolved.cfg.output_dir))
        # from here a signal during start-up ends the job at once, said once (training/preemption.py)
        stop_at_once_on_signals(resolved.cfg.output_dir, dist.get_rank(), lock.release if lock else None)
        rss_before_model = peak_rss_mb()
        loss_fn = build_loss(resolved)
        model = build_model(resolved, topology, loss_fn)
        init_reports = init_weights(model, resolved, rss_before_model)
        lora_reports = adapt(model, resolved)
        data, data_reports = build_data(resolved, topology)
        total_steps, steps_per_epoch = plan_steps(resolved, data)
        engine = build_engine(resolved, model, total_steps)
        start_step = resume_or_start(resolved, engine, data, total_steps)
        announce(
            resolved, engine, init_reports, lora_reports, data_reports, data, start_step, total_steps, steps_per_epoch
        )
        if resolved.cfg.train_objective == "dpo":
            prepare_reference(resolved, engine, data, loss_fn, log0)
        train(resolved, engine, data, loss_fn, start_step, total_steps)
        check_tensor_parallel_replicas(model, resolved)
        dist.barrier()
    except (StartupError, OrderMismatchError, TrainingStopped) as e:  # raised on every rank alike
        fail(str(e))
    except Preempted as e:  # on every rank alike, the checkpoint complete
        log0(str(e))
        code = PREEMPTED_EXIT_CODE
    except Exception:  # a collective failing because a hung job's peers exited first (training/hang.py): quiet
        exit_if_exiting()
        raise
    finally:
        if lock is not None:
            lock.release()
        # Every rank leaves the process group before exiting (DeepSpeed on CPU can abort at exit otherwise).
        if dist.is_initialized():
            dist.destroy_process_group()
        release_cpu_comm_buffer()
    if HydraConfig.get().mode != RunMode.MULTIRUN or code:  # a sweep's next job runs in this process
        exit_finished_run(code)  # reached only when the run finished or stopped saved: failures raised above


def make_output_dir(output_dir: str) -> None:
    """Every rank; rank 0 also removes an earlier job's ``.stopping`` before any rank can exit at once."""
    os.makedirs(output_dir, exist_ok=True)
    if dist.get_rank() == 0:
        clear_stale_marker(output_dir)


def fail(message: str) -> None:
    """Report an error once per job (every rank saw the same one: it was raised on all ranks alike, or
    found by the same validation) and exit non-zero."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
    typos = override_key_problems(sys.argv[1:])
    if typos:
        fail("invalid configuration:\n  " + "\n  ".join(typos))
    main()
