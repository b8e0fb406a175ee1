"""train.py's start-up phases, in the order ``main`` calls them: the process group and topology, output_dir,
the loss, this rank's stage, its weights, LoRA, its data, the engine, and the resume onto it.

Each phase that may fail on some ranks only runs under ``on_all_ranks`` (training/resilience/all_ranks.py), so every
rank fails alike; those that report (weights, LoRA, data) return every rank's report for the announcement
(training/observation/announce.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.topology import ProcessTopology

from models.files.hf_stage import is_hf_dir, load_stage_from_hf
from models.files.peft_adapter import base_record, load_adapter_, load_checkpoint_adapters_
from models.files.pipeline_dir import full_numel, is_partitioned, load_stage_weights, local_modules, stage_pieces
from models.files.zero3_load import init_partitioned_, partition_bytes
from models.fp8 import convert_stage_to_float8_
from models.grpo import GRPOLoss
from models.host_memory import peak_rss_mb
from models.kernels import apply_kernels
from models.llama_pipe import ATTENTION_IMPLEMENTATIONS, init_weights_
from models.lora import apply_lora, base_numel
from models.loss import CausalLMLoss, PreferenceLoss, logit_softcap
from models.specs import spec_layout
from parallel.stage import axis_plans, build_pipeline_model, pipeline_topology
from training.checkpoints import save_restore
from training.compile import compile_engine
from training.configuration.schema import Resolved
from training.data_setup import RankData, prepare_rank_data
from training.grpo import grpo_rank_data
from training.observation.logs import log0
from training.optim import (
    apply_optim_settings,
    build_lr_scheduler,
    grad_norm_in_one_kernel,
    no_reduction_over_one_rank,
    overflow_check_in_one_kernel,
    param_groups,
    readable_arch_list,
    reduce_grad_norm_once_across_stages,
)
from training.resilience.all_ranks import StartupError, on_all_ranks, release_cpu_comm_buffer
from training.resilience.op_build_watch import StartupWatchdog
from training.resilience.ports import free_port
from training.resilience.preemption import clear_stale_marker
from training.resilience.run_lock import RunLock


def init_topology(resolved: Resolved, extensions_dir: str) -> ProcessTopology:
    """Start the process group and lay ranks out as the layout says (parallel.stage.pipeline_topology).

    ``python train.py`` without the launcher runs as a 1-rank job. Until the process group exists no
    collective timeout applies, so a watchdog bounds the wait (``startup_timeout_s``) and says where it was
    (``extensions_dir``: the DeepSpeed ops cache it names when a stale build lock holds the rank).
    """
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    release_cpu_comm_buffer()  # a killed job's segment of this name would be attached to (no peer has started yet)
    with StartupWatchdog(resolved.cfg.startup_timeout_s, int(os.environ["RANK"]), extensions_dir) as watchdog:
        watchdog.phase(
            f"joining the process group (rendezvous at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
            f"with {resolved.world_size} ranks, DeepSpeed loading its communication op)"
        )
        # Every collective fails after dist_timeout_s instead of waiting forever for a hung or vanished rank.
        deepspeed.init_distributed(timeout=timedelta(seconds=resolved.cfg.dist_timeout_s))
    return pipeline_topology(resolved.layout)


def lock_output_dir(resolved: Resolved) -> RunLock | None:
    """Rank 0 holds output_dir for the run's lifetime (training/resilience/run_lock.py): a second run on it stops
    here on every rank, before it writes anything there. Returns rank 0's lock."""
    lock = RunLock(resolved.cfg.output_dir) if dist.get_rank() == 0 else None

    def acquire() -> None:
        warning = lock.acquire() if lock else None
        if warning:
            log0(warning)

    on_all_ranks("locking output_dir", acquire)
    return lock


def make_output_dir(output_dir: str) -> None:
    """Every rank; rank 0 also removes an earlier job's ``.stopping`` before any rank can exit at once, and the
    directories of saves an earlier job did not finish."""
    os.makedirs(output_dir, exist_ok=True)
    if dist.get_rank() == 0:
        clear_stale_marker(output_dir)
        save_restore.remove_interrupted_saves(output_dir)


def build_loss(resolved: Resolved) -> CausalLMLoss | PreferenceLoss | GRPOLoss:
    """The last stage's loss: the next-token loss (train_step sets its normalisation each step), DPO's or GRPO's;
    each of the logits capped as the model caps them (Gemma's final_logit_softcapping)."""
    cfg = resolved.cfg
    softcap = logit_softcap(resolved.model_config)
    if cfg.train_objective == "dpo":
        return PreferenceLoss(
            cfg.loss_chunk_tokens, cfg.dpo.beta, cfg.dpo.loss_type, cfg.dpo.label_smoothing, softcap=softcap
        )
    if cfg.train_objective == "grpo":
        g = cfg.grpo
        return GRPOLoss(
            cfg.loss_chunk_tokens,
            temperature=g.temperature,
            epsilon=g.epsilon,
            epsilon_high=g.epsilon_high,
            beta=g.beta,
            loss_type=str(g.loss_type),
            max_completion_length=g.max_completion_length,
            impl=str(cfg.loss_impl),
            softcap=softcap,
        )
    return CausalLMLoss(cfg.loss_chunk_tokens, softcap=softcap)


def build_model(resolved: Resolved, topology: ProcessTopology, loss_fn: CausalLMLoss | PreferenceLoss, ds_config: dict):
    """This rank's model, as the run's engine builds it (parallel/engines.py): the pipeline module (this rank builds
    only its own stage's layers), or, for num_stages=1 with ZeRO 2/3, every spec in one module for DeepSpeed's
    data-parallel engine, under ZeRO-3 (``ds_config``, the run's filled DeepSpeed config) built partitioned."""
    cfg = resolved.cfg
    attention = ATTENTION_IMPLEMENTATIONS[cfg.attention]
    stage = functools.partial(
        build_pipeline_model,
        resolved.model_config,
        topology,
        resolved.layout,
        loss_fn,
        partition_method=cfg.partition_method,
        activation_checkpoint_interval=cfg.activation_checkpoint_interval,
        dynamic_shape=cfg.data.pad_to_multiple_of > 0,
        attention=attention,
        sequence_balance_coef=cfg.moe.sequence_balance_coef,
    )
    model = resolved.layout.engine.build_model(
        stage,
        resolved.model_config,
        ds_config,
        activation_checkpointing=cfg.activation_checkpoint_interval > 0,
        loss_chunk_tokens=cfg.loss_chunk_tokens,
        attention=attention,
    )
    apply_kernels([model], cfg.kernels)  # kernels=liger: Liger's forwards on this rank's decoder layers
    if cfg.fp8:  # before the engine (its optimizer takes the same weight parameters, which keep their names)
        convert_fp8(model, cfg.fp8)
    return model


def convert_fp8(model, recipe: str) -> None:
    """fp8: this rank's decoder-layer projections made torchao Float8Linears (models/fp8.py); one line for the job:
    how many each rank converted, and the projections torchao cannot take."""
    reports = on_all_ranks("converting to fp8", lambda: convert_stage_to_float8_(model, recipe))
    skipped = sorted({name for _, names in reports for name in names})
    log0(
        f"fp8={recipe}: {sum(len(c) for c, _ in reports)} linear layers in torchao's Float8Linear "
        f"({', '.join(str(len(c)) for c, _ in reports)} per rank)"
        + (f"; left in high precision: {', '.join(skipped)}" if skipped else "")
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
        # grpo.beta > 0: the starting weights are the reference (training/grpo.py), a resume loads them too
        starting = not resolved.resume_tag or (cfg.train_objective == "grpo" and cfg.grpo.beta > 0)
        if resolved.resume_tag and not resolved.reshard and not resolved.lora and not starting:
            source = f"resuming {resolved.resume_tag}"  # DeepSpeed's load_checkpoint fills the stage
        elif resolved.from_scratch and starting:
            spec_info = spec_layout(config)  # per spec: the layer file holding its weights, whose index seeds it
            for index, module in local_modules(model):
                seed = cfg.seed + spec_info[index].file_index
                if partitioned:
                    init_partitioned_(module, model._layer_specs[index], config, seed)
                else:
                    init_weights_(module, config, seed=seed)
            source = f"initialised from scratch (model={cfg.model.name}, seed {cfg.seed})"
        else:  # model_name_or_path's layer files (a LoRA run's base) or Hugging Face directory, or, resuming on
            # another layout, the checkpoint's
            ckpt_dir, tag = (
                (cfg.output_dir, resolved.resume_tag)
                if resolved.resume_tag and not resolved.lora and not starting
                else (cfg.model_name_or_path, None)
            )
            # read as it is, this stage's tensors only (models/files/hf_stage.py)
            if tag is None and is_hf_dir(ckpt_dir):
                report = load_stage_from_hf(model, config, ckpt_dir)
                read = f"{len(report.files)} safetensors files of {ckpt_dir}"
            else:
                report = load_stage_weights(model, config, ckpt_dir, tag)
                read = f"{len(report.files)} layer files" + (f" of {tag}" if tag else "")
            loaded_mib = report.bytes_read / 2**20
            source = f"loaded {loaded_mib:.1f} MiB from {read}"
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


def add_lora(model, resolved: Resolved) -> list[str]:
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


def build_data(resolved: Resolved, topology: ProcessTopology) -> tuple[RankData, list[dict]]:
    """This rank's data (who tokenizes, who reads, placeholders: training/data_setup.py) and every
    rank's data report, for the announcement."""
    coord = resolved.layout.data_coord(topology.get_coord(dist.get_rank()))
    if resolved.cfg.train_objective == "grpo":
        data = grpo_rank_data(resolved, coord)
    else:
        data = prepare_rank_data(resolved.cfg, resolved.model_config, resolved.layout, coord)
    reports = on_all_ranks("reporting data", lambda: {"role": data.role, "peak_rss_mib": peak_rss_mb()})
    return data, reports


def build_engine(resolved: Resolved, model, ds_config: dict, total_steps: int):
    """DeepSpeed's pipeline engine with AdamW and the LR schedule from the Hydra config; ``ds_config``: the
    run's filled DeepSpeed config (training/optim.py's ``fill_ds_config``)."""
    plans = axis_plans(resolved.layout)
    with contextlib.ExitStack() as building:
        for plan in plans:
            building.enter_context(plan.building_engine())  # expert parallelism: DeepSpeed's MoE paths on
        building.enter_context(readable_arch_list(resolved.cfg.adamw_impl))  # adamw_impl=deepspeed's JIT build
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model, resolved.cfg.optim.weight_decay),
            config=ds_config,
            lr_scheduler=build_lr_scheduler(resolved.cfg, total_steps),
        )
    grad_norm_in_one_kernel(engine.optimizer)
    no_reduction_over_one_rank(engine.optimizer)
    overflow_check_in_one_kernel(engine.optimizer)
    reduce_grad_norm_once_across_stages(engine.optimizer)
    for plan in plans:
        plan.adopt_engine(engine)  # DualPipeV: DeepSpeed's engine made LlamaDualPipeVEngine (parallel/dualpipev.py)
    compile_engine(engine, resolved.cfg.compile)  # compile=true: each layer of the stage torch.compile'd
    save_restore.load_without_pickles(engine)
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
            "are read per parameter (training/checkpoints/reshard.py)"
        )
        start = time.time()
        on_all_ranks(
            "reading optimizer states per parameter",
            lambda: local.update(state=save_restore.restore_resharded(resolved, engine, data.iterator, total_steps)),
        )
        step = local["state"]["step"]
        log0(f"resume: optimizer states of every parameter set in {time.time() - start:.1f} s")
    else:
        # every rank's problems with the checkpoint's files, said once for the job (a file may be checked by two)
        shares = on_all_ranks("checking the checkpoint", lambda: save_restore.checkpoint_problems(resolved, engine))
        problems = [problem for share in shares for problem in share]
        if problems:
            raise StartupError(save_restore.cannot_resume(resolved.cfg.output_dir, resolved.resume_tag, problems))
        on_all_ranks(
            "reading trainer state", lambda: local.update(state=save_restore.read_trainer_state(resolved, engine))
        )
        step = save_restore.restore(resolved, engine, data.iterator, local["state"])
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
