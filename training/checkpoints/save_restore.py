"""Checkpoints that a run can resume from exactly, and that ``latest`` names only once complete.

A checkpoint is DeepSpeed's own (``engine.save_checkpoint``: layer files, engine and optimizer
states, LR scheduler) plus one ``trainer_state_rank<R>.json`` per rank (step, sampler position, RNG
states), plus the model config, tokenizer and resolved training config in ``output_dir``. The order
of writing is what makes it safe:

0. rank 0 removes ``<output_dir>/.<tag>.partial/`` if an interrupted save left one; all ranks meet;
1. every rank writes its DeepSpeed files and its trainer state into ``<output_dir>/.<tag>.partial/``
   (``save_async``: copies them to host memory, and a thread writes them while training goes on);
2. all ranks agree that every rank's files are written: a barrier, or with ``save_async`` the per-step
   agreement (training/resilience/preemption.py) once no rank's writer is busy;
3. rank 0 renames the directory to ``<output_dir>/<tag>/``, writes ``latest`` (to a temporary file,
   then renamed), then deletes checkpoints beyond ``save_total_limit`` and any directory newer than
   the one just saved.

A crash before step 3 (a rank killed mid-save, or mid background write) leaves ``latest`` naming the
previous complete checkpoint, and only a ``.<tag>.partial`` directory, which nothing reads
(``models.files.pipeline_dir.TAG_PATTERN`` does not match it) and the next start removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from omegaconf import OmegaConf

from data.tokenize_settings import tokenizer_dir
from models.files.peft_adapter import adapter_file_problems, base_mismatch, saved_base_record
from models.files.pipeline_dir import (
    LATEST_FILE,
    TAG_PATTERN,
    CheckpointError,
    checkpoint_tags,
    copy_side_files,
    copy_tokenizer_files,
    deepspeed_state_globals,
    local_modules,
    stage_file_problems,
    unreadable_torch_file,
    write_config,
)
from models.host_memory import current_rss_mb, peak_rss_mb
from training.checkpoints.async_save import BackgroundWriter, CheckpointEngine
from training.checkpoints.reshard import SavedOptimizerState, load_into_engine, load_problems
from training.configuration.schema import Resolved
from training.observation.logs import log0
from training.optim import apply_optim_settings, param_groups
from training.resilience.all_ranks import TrainingStopped, on_all_ranks, writing

# train.py's line after each save, as tools/stress.py and the tests read it back: (step, RSS per rank in MiB
# as "a, b, ...", rank 0's peak RSS in MiB).
SAVED_LINE = re.compile(
    r"saved checkpoint global_step(\d+) in .* \(RSS per rank now: ([\d, ]+) MiB; peak RSS (\d+) MiB\)"
)


def tag_for(step: int) -> str:
    return f"global_step{step}"


def step_of(tag: str) -> int:
    return int(TAG_PATTERN.fullmatch(tag).group(1))


def trainer_state_file(output_dir: str, tag: str, rank: int) -> str:
    return os.path.join(output_dir, tag, f"trainer_state_rank{rank:05d}.json")


def rng_state() -> dict:
    """Python, NumPy and torch generator states, as JSON-serialisable lists."""
    np_state = np.random.get_state()
    return {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def staging_dir(output_dir: str, tag: str) -> str:
    """Where checkpoint ``tag`` is written until every rank's files are: renamed to ``output_dir/tag`` then."""
    return os.path.join(output_dir, f".{tag}.partial")


def save(resolved: Resolved, engine, step: int, iterator, writer: BackgroundWriter, background: bool = False) -> str:
    """Collective: write checkpoint ``global_step<step>``; returns its tag. ``background``: copy this rank's files to
    host memory and leave them to ``writer``; :func:`publish` makes the checkpoint ``latest`` once every rank's are
    written. A checkpoint still being written from an earlier save is waited for, and published, first."""
    cfg, rank = resolved.cfg, dist.get_rank()
    tag = tag_for(step)
    if writer.tag is not None:
        publish(resolved, writer, f"saving {tag}")
    staging = staging_dir(cfg.output_dir, tag)
    if rank == 0:
        remove_partial(staging)
    dist.barrier()  # no rank writes into the directory before a stale one is gone
    start = time.time()
    capture = engine.checkpoint_engine.capturing() if background else contextlib.nullcontext()
    # a failed write names its file (training/checkpoints/async_save.py's CheckpointEngine), else the checkpoint's
    # directory
    with capture as captured, writing(staging):
        # A LoRA run's layer files hold only what it trains; the frozen base stays in model_name_or_path.
        engine.save_checkpoint(
            cfg.output_dir, tag=os.path.basename(staging), save_latest=False, exclude_frozen_parameters=resolved.lora
        )
        resolved.layout.engine.write_layer_files(engine, resolved.model_config, staging)
    state_path = os.path.join(staging, os.path.basename(trainer_state_file(cfg.output_dir, tag, rank)))
    state = trainer_state(resolved, engine, step, iterator)
    with writing(state_path), open(state_path, "w") as f:
        json.dump(state, f)
    if rank == 0:
        write_side_files(resolved)
        write_train_config(cfg, staging)
    if background:
        writer.start(tag, captured, engine.checkpoint_engine, time.time() - start)
        return tag
    dist.barrier()  # every rank's files are complete
    if rank == 0:
        make_latest(cfg, tag)
    dist.barrier()
    return tag


def trainer_state(resolved: Resolved, engine, step: int, iterator) -> dict:
    """This rank's ``trainer_state_rank<R>.json``: what DeepSpeed's files do not hold (see the module)."""
    rank = dist.get_rank()
    return {
        "step": step,
        "world_size": dist.get_world_size(),
        "stage": rank // (resolved.layout.data_axis * resolved.layout.tp),  # pipe is the outer axis of the topology
        "dp_rank": rank // resolved.layout.tp % resolved.layout.data_axis,  # tensor-parallel peers are consecutive
        "tensor_parallel": resolved.layout.tp,
        # > 1: expert moments in files of their own (training/checkpoints/reshard.py)
        "expert_parallel": resolved.layout.ep,
        "global_batch": resolved.layout.global_batch,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "optimizer_param_names": optimizer_param_names(engine.module, resolved.cfg.optim.weight_decay),
        # Tensor parallelism: the dimension each split parameter is cut along (training/checkpoints/reshard.py joins
        # them)
        "tp_split_dims": {n: p.tp_split[0] for n, p in engine.module.named_parameters() if hasattr(p, "tp_split")},
        "peft_base": getattr(engine.module, "lora_base", None),
        "rng": rng_state(),
        "iterator": iterator.state_dict() if iterator is not None else None,
    }


def make_latest(cfg, tag: str) -> None:
    """Rank 0, once every rank's files of ``tag`` are written: its directory renamed into place, ``latest``
    replaced atomically, older checkpoints beyond ``save_total_limit`` deleted."""
    final = os.path.join(cfg.output_dir, tag)
    if os.path.isdir(final):  # an interrupted save's of an earlier version, or a run ``latest`` was moved back from
        shutil.rmtree(final)
    os.rename(staging_dir(cfg.output_dir, tag), final)
    tmp = os.path.join(cfg.output_dir, f".{LATEST_FILE}.tmp")
    with writing(os.path.join(cfg.output_dir, LATEST_FILE)):
        with open(tmp, "w") as f:
            f.write(tag)
        os.replace(tmp, os.path.join(cfg.output_dir, LATEST_FILE))
    prune(cfg.output_dir, cfg.save_total_limit, keep=tag)


def publish(resolved: Resolved, writer: BackgroundWriter, before: str | None = None) -> str:
    """Collective: the checkpoint ``writer`` holds becomes ``latest`` once every rank's files are written (waiting
    for them, saying so when ``before`` something else, if one is still busy), and the saved line is logged.
    A rank's failed write stops training on every rank, ``latest`` left on the previous checkpoint."""
    tag = writer.tag
    if before is not None and on_all_ranks("checking the checkpoint writer", lambda: writer.busy).count(True):
        log0(f"checkpoint {tag} is still being written in the background: waiting for it before {before}")
    waited = writer.wait()
    # every rank's outcome: (error or None, seconds writing, seconds of the host copy)
    reports = on_all_ranks(
        "writing a checkpoint in the background", lambda: (writer.error, writer.written_s or 0.0, writer.captured_s)
    )
    writer.done()
    failed = [f"rank {r}: {error}" for r, (error, _, _) in enumerate(reports) if error]
    if failed:
        latest = os.path.join(resolved.cfg.output_dir, LATEST_FILE)
        previous = "no checkpoint is complete"
        if os.path.isfile(latest):
            with open(latest) as f:
                previous = f"latest names {os.path.join(resolved.cfg.output_dir, f.read().strip())}"
            previous += " (resume=auto continues from it)"
        raise TrainingStopped(
            f"checkpoint {tag} could not be written ({'; '.join(failed)}): training stopped; "
            f"{staging_dir(resolved.cfg.output_dir, tag)} is left incomplete and {previous}"
        )
    on_all_ranks("publishing a checkpoint", lambda: make_latest(resolved.cfg, tag) if dist.get_rank() == 0 else None)
    written, captured = max(r[1] for r in reports), max(r[2] for r in reports)
    log_saved(
        resolved,
        tag,
        f" (written in the background in {written:.2f} s; training stopped {captured + waited:.2f} s for it)",
    )
    return tag


def log_saved(resolved: Resolved, tag: str, how: str = "") -> None:
    """The line each save ends with (``SAVED_LINE``), with every rank's RSS: collective."""
    rss = on_all_ranks("reporting memory", current_rss_mb)
    log0(
        f"saved checkpoint {tag} in {resolved.cfg.output_dir}{how} (RSS per rank now: "
        f"{', '.join(f'{r:.0f}' for r in rss)} MiB; peak RSS {peak_rss_mb():.0f} MiB)"
    )


def optimizer_param_names(module, weight_decay: float) -> list[list[str]]:
    """The names of the parameters in each AdamW group train.py built, in order: how torch's optimizer
    state (ZeRO-0, fp32) is indexed, so another layout can read it per parameter (training/checkpoints/reshard.py)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in param_groups(module, weight_decay)]


def write_side_files(resolved: Resolved) -> None:
    """config.json, tokenizer files and the resolved config, so output_dir is self-contained."""
    cfg = resolved.cfg
    with writing(cfg.output_dir):  # an error names its file
        if resolved.from_scratch:
            write_config(resolved.model_config.to_dict(), cfg.output_dir)
            copy_tokenizer_files(tokenizer_dir(cfg), cfg.output_dir)
        elif os.path.abspath(cfg.model_name_or_path) != os.path.abspath(cfg.output_dir):
            copy_side_files(cfg.model_name_or_path, cfg.output_dir, dtype=None)
    write_train_config(cfg, cfg.output_dir)


def write_train_config(cfg, directory: str) -> None:
    """The resolved training config, ``directory/train_config.yaml``."""
    path = os.path.join(directory, "train_config.yaml")
    with writing(path):
        OmegaConf.save(OmegaConf.structured(cfg), path)


def remove_partial(path: str) -> None:
    """Remove a checkpoint directory an interrupted save left (``.<tag>.partial``): nothing resumes from it."""
    if os.path.isdir(path):
        print(f"[train] removing {path}: an incomplete checkpoint left by an interrupted save", flush=True)
        shutil.rmtree(path)


def remove_interrupted_saves(output_dir: str) -> None:
    """Rank 0 at start-up: every ``.<tag>.partial`` directory in ``output_dir``."""
    if os.path.isdir(output_dir):
        for name in sorted(os.listdir(output_dir)):
            if name.startswith(".global_step") and name.endswith(".partial"):
                remove_partial(os.path.join(output_dir, name))


def prune(output_dir: str, limit: int, keep: str) -> list[str]:
    """After saving ``keep``: delete the oldest ``global_step*`` checkpoints beyond ``limit`` (0 = keep
    all), and every directory newer than ``keep`` (an interrupted save's, or a run that ``latest`` was
    moved back from), so that ``latest`` always names the newest checkpoint in ``output_dir``."""
    tags = checkpoint_tags(output_dir)
    keep_step = next((step for step, name in tags if name == keep), float("inf"))
    done = [name for step, name in tags if step <= keep_step]
    doomed = [name for step, name in tags if step > keep_step]
    if limit > 0:
        doomed += [name for name in done[:-limit] if name != keep]
    for name in doomed:
        shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    return doomed


def load_without_pickles(engine) -> None:
    """Every file ``engine.load_checkpoint`` reads goes through :class:`CheckpointEngine` (engine states, ZeRO
    optimizer states, and the pipeline's layer files), which loads weights only and can save in the background."""
    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise CheckpointError(
            f"checkpoint engine {type(engine.checkpoint_engine).__name__}: only DeepSpeed's torch engine is "
            "supported (its loads are made pickle-free here); remove the JSON's checkpoint engine settings"
        )
    engine.checkpoint_engine = CheckpointEngine(engine._config)  # its serialization settings


def unsafe_checkpoint_files(tag_dir: str, rank: int, world_size: int) -> list[str]:
    """This rank's share of the checkpoint's DeepSpeed files (every world_size-th, from ``rank``) whose
    pickle names anything beyond tensors, containers and :func:`deepspeed_state_globals`: read, never
    run (``torch.serialization.get_unsafe_globals_in_checkpoint``), so a tampered file is named before
    any rank loads anything."""
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in deepspeed_state_globals()}
    files = sorted(f for f in os.listdir(tag_dir) if f.endswith(".pt"))[rank::world_size]
    problems = []
    for name in files:
        path = os.path.join(tag_dir, name)
        try:
            unsafe = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - allowed)
        except Exception as e:  # noqa: BLE001 (a damaged file: reported here, whatever torch raises)
            problems.append(unreadable_torch_file(path, e))
            continue
        if unsafe:
            problems.append(
                f"{path} names {', '.join(unsafe)}, which a DeepSpeed checkpoint never holds (a pickle that "
                "could run code when loaded): refused, nothing loaded"
            )
    return problems


def missing_deepspeed_files(engine, output_dir: str, tag: str) -> list[str]:
    """The DeepSpeed files this rank's ``load_checkpoint`` will read that are not in ``output_dir/tag``:
    its engine state, and every data-parallel rank's optimizer states of its stage (ZeRO, and bf16 at
    ZeRO-0), by DeepSpeed's own naming."""
    expected = [engine._get_ckpt_name(output_dir, tag)]
    if engine.zero_optimization() or isinstance(engine.optimizer, BF16_Optimizer):
        expected += engine._get_mp_rank_zero_checkpoint_names(
            output_dir, tag, engine.checkpoint_mp_rank, engine.seq_dp_world_size, engine.bfloat16_enabled()
        )
    return [f"{path} is missing: the checkpoint is incomplete" for path in expected if not os.path.isfile(path)]


def checkpoint_problems(resolved: Resolved, engine) -> list[str]:
    """This rank's share of the checks of the checkpoint being resumed, before DeepSpeed loads anything: its
    stage's layer files against the model, the DeepSpeed files it will read there, and no file of its share (every
    world_size-th) naming anything a checkpoint does not hold. A file may be checked by two ranks (its stage's, and
    the share's): :func:`cannot_resume` says each problem once, for the job."""
    cfg, tag = resolved.cfg, resolved.resume_tag
    if resolved.lora:
        problems = adapter_file_problems(
            local_modules(engine.module), resolved.model_config, os.path.join(cfg.output_dir, tag)
        )
    else:
        problems = stage_file_problems(engine.module, resolved.model_config, cfg.output_dir, tag)
    problems += missing_deepspeed_files(engine, cfg.output_dir, tag)
    problems += unsafe_checkpoint_files(os.path.join(cfg.output_dir, tag), dist.get_rank(), dist.get_world_size())
    return problems


def cannot_resume(output_dir: str, tag: str, problems: list[str]) -> str:
    """The job's one message for the problems every rank found in checkpoint ``tag`` (each said once), and what to
    do: resume from the checkpoint before it where output_dir has one, else restore the files."""
    earlier = [name for step, name in checkpoint_tags(output_dir) if step < step_of(tag)]
    if earlier:
        what = (
            f"resume from the previous checkpoint, {os.path.join(output_dir, earlier[-1])}: write its name into "
            f"{os.path.join(output_dir, LATEST_FILE)} (`echo {earlier[-1]} > {os.path.join(output_dir, LATEST_FILE)}`; "
            f"the next save deletes {tag}: copy it first to keep it), or restore the files named from a copy"
        )
    else:
        what = (
            f"restore the files named from a copy of {os.path.join(output_dir, tag)} (it is the only checkpoint in "
            f"{output_dir}), or start afresh in another output_dir"
        )
    return f"cannot resume from {output_dir}/{tag}:\n  " + "\n  ".join(dict.fromkeys(problems)) + f"\n{what}"


def read_trainer_state(resolved: Resolved, engine) -> dict:
    """This rank's trainer state of the checkpoint being resumed (run through on_all_ranks, after
    :func:`checkpoint_problems` found none on any rank)."""
    cfg, tag = resolved.cfg, resolved.resume_tag
    path = trainer_state_file(cfg.output_dir, tag, dist.get_rank())
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} not found: {cfg.output_dir}/{tag} was not written by train.py with {dist.get_world_size()} ranks"
        )
    with open(path) as f:
        state = json.load(f)
    if state["world_size"] != dist.get_world_size():  # rank 0's file said this world size (config.reshard_reason)
        raise ValueError(
            f"{path} was written by {state['world_size']} ranks, {trainer_state_file(cfg.output_dir, tag, 0)} by "
            f"{dist.get_world_size()}: the checkpoint mixes files of two runs"
        )
    if resolved.lora:
        problems = base_mismatch(state.get("peft_base"), engine.module.lora_base)
        if problems:
            raise CheckpointError(f"cannot resume {cfg.output_dir}/{tag}: " + "; ".join(problems))
    return state


def restore(resolved: Resolved, engine, iterator, state: dict) -> int:
    """Collective: model, optimizer and LR schedule from DeepSpeed's files, then RNG and sampler
    position from ``state``; returns the step the checkpoint was taken at."""
    # bf16 at ZeRO-0 (BF16_Optimizer): DeepSpeed 0.19.8 hands the optimizer the engine file's single
    # state dict where it indexes one per data-parallel rank (KeyError: 0), so its states are read from
    # the per-rank files it saved, as ZeRO's are.
    bf16_optimizer = isinstance(engine.optimizer, BF16_Optimizer)
    output_dir, tag = resolved.cfg.output_dir, resolved.resume_tag
    # A LoRA checkpoint's layer files hold only the trained tensors (read_trainer_state checked that they
    # are all there): the frozen base, loaded from model_name_or_path, is left as it is.
    load_path, _ = engine.load_checkpoint(
        output_dir, tag=tag, load_optimizer_states=not bf16_optimizer, load_module_strict=not resolved.lora
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load {output_dir}/{tag}")
    if bf16_optimizer and not engine._load_zero_checkpoint(output_dir, tag, load_optimizer_states=True):
        raise CheckpointError(f"{output_dir}/{tag}: the bf16 optimizer states of some rank are missing")
    set_rng_state(state["rng"])
    if iterator is not None:
        iterator.load_state_dict(state["iterator"])
    return state["step"]


def restore_resharded(resolved: Resolved, engine, iterator, total_steps: int) -> dict:
    """Resume on a layout other than the checkpoint's (``resolved.reshard`` says why): the weights are in
    the model already (this stage's layer files, read by ``init_weights``); here every parameter's
    optimizer state is read from the saved files per parameter (training/checkpoints/reshard.py), then the step
    count, LR schedule position, data position and RNG of the checkpoint's rank 0. Local to each rank
    (run through on_all_ranks); returns that trainer state."""
    output_dir, tag = resolved.cfg.output_dir, resolved.resume_tag
    saved = SavedOptimizerState(os.path.join(output_dir, tag))
    problems = saved.problems + load_problems(saved, engine.module)
    with open(trainer_state_file(output_dir, tag, 0)) as f:
        state = json.load(f)
    if resolved.lora:
        problems += base_mismatch(saved_base_record(os.path.join(output_dir, tag)), engine.module.lora_base)
    if "consumed" not in (state["iterator"] or {}):
        problems.append(
            "its data position counts one rank's micro-batches (saved by an earlier version): resume it on its "
            "own layout"
        )
    if problems:
        raise CheckpointError(f"cannot resume {output_dir}/{tag}:\n  " + "\n  ".join(problems))
    load_into_engine(engine, saved)
    step = state["step"]
    engine.global_steps, engine.skipped_steps = step, state["skipped_steps"]
    engine.global_samples = state["global_samples"]
    engine.lr_scheduler.last_epoch, engine.lr_scheduler._step_count = step, step + 1
    apply_optim_settings(engine, resolved.cfg, total_steps)  # the learning rate of step + 1
    set_rng_state(state["rng"])
    if iterator is not None:
        iterator.load_state_dict(state["iterator"])
    return state
