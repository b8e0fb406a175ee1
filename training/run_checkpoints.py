"""Checkpoints that a run can resume from exactly, and that ``latest`` names only once complete.

A checkpoint is DeepSpeed's own (``engine.save_checkpoint``: layer files, engine and optimizer
states, LR scheduler) plus one ``trainer_state_rank<R>.json`` per rank (step, sampler position, RNG
states), plus the model config, tokenizer and resolved training config in ``output_dir``. The order
of writing is what makes it safe:

0. rank 0 removes ``<output_dir>/<tag>/`` if an interrupted save left one; all ranks meet;
1. every rank writes its DeepSpeed files and its trainer state into ``<output_dir>/<tag>/``;
2. all ranks meet at a barrier;
3. rank 0 writes ``latest`` (to a temporary file, then renamed), then deletes checkpoints beyond
   ``save_total_limit`` and any directory newer than the one just saved.

A crash before step 3 (a rank killed mid-save) leaves ``latest`` naming the previous complete
checkpoint, and a directory newer than it that is never resumed from
(``models.layer_files.tags_newer_than_latest``); the next save of that tag replaces it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from omegaconf import OmegaConf

from data.settings import tokenizer_dir
from models.layer_files import (
    LATEST_FILE,
    CheckpointError,
    checkpoint_tags,
    copy_side_files,
    copy_tokenizer_files,
    deepspeed_state_globals,
    first_line,
    latest_tag,
    load_deepspeed_file,
    local_modules,
    stage_file_problems,
    write_config,
)
from models.llama_pipe import layer_file_name
from models.lora_files import adapter_file_problems, base_mismatch, saved_base_record
from training.config import Resolved
from training.optim import apply_optim_settings, param_groups
from training.reshard import SavedOptimizerState, load_into_engine, load_problems

# train.py's line after each save, as scripts/stress.py and the tests read it back: (step, RSS per rank in MiB
# as "a, b, ...", rank 0's peak RSS in MiB).
SAVED_LINE = re.compile(
    r"saved checkpoint global_step(\d+) in .* \(RSS per rank now: ([\d, ]+) MiB; peak RSS (\d+) MiB\)"
)


def tag_for(step: int) -> str:
    return f"global_step{step}"


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


def save(resolved: Resolved, engine, step: int, iterator) -> str:
    """Collective: write checkpoint ``global_step<step>``; returns its tag."""
    cfg, rank = resolved.cfg, dist.get_rank()
    tag = tag_for(step)
    if rank == 0:
        remove_interrupted(cfg.output_dir, tag)
    dist.barrier()  # no rank writes into the directory before a stale one is gone
    # A LoRA run's layer files hold only what it trains; the frozen base stays in model_name_or_path.
    engine.save_checkpoint(cfg.output_dir, tag=tag, save_latest=False, exclude_frozen_parameters=resolved.lora)
    if not resolved.uses_pipeline:
        write_layer_files(engine.module, resolved.model_config, os.path.join(cfg.output_dir, tag))
    state = {
        "step": step,
        "world_size": dist.get_world_size(),
        "stage": rank // (resolved.layout.data_axis * resolved.layout.tp),  # pipe is the outer axis of the topology
        "dp_rank": rank // resolved.layout.tp % resolved.layout.data_axis,  # tensor-parallel peers are consecutive
        "tensor_parallel": resolved.layout.tp,
        "expert_parallel": resolved.layout.ep,  # > 1: expert moments in files of their own (training/reshard.py)
        "global_batch": resolved.layout.global_batch,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "optimizer_param_names": optimizer_param_names(engine.module, resolved.cfg.optim.weight_decay),
        # Tensor parallelism: the dimension each split parameter is cut along (training/reshard.py joins them)
        "tp_split_dims": {n: p.tp_split[0] for n, p in engine.module.named_parameters() if hasattr(p, "tp_split")},
        "peft_base": getattr(engine.module, "lora_base", None),
        "rng": rng_state(),
        "iterator": iterator.state_dict() if iterator is not None else None,
    }
    with open(trainer_state_file(cfg.output_dir, tag, rank), "w") as f:
        json.dump(state, f)
    if rank == 0:
        write_side_files(resolved)
        OmegaConf.save(OmegaConf.structured(cfg), os.path.join(cfg.output_dir, tag, "train_config.yaml"))
    dist.barrier()  # every rank's files are complete
    if rank == 0:
        tmp = os.path.join(cfg.output_dir, f".{LATEST_FILE}.tmp")
        with open(tmp, "w") as f:
            f.write(tag)
        os.replace(tmp, os.path.join(cfg.output_dir, LATEST_FILE))
        prune(cfg.output_dir, cfg.save_total_limit, keep=tag)
    dist.barrier()
    return tag


def optimizer_param_names(module, weight_decay: float) -> list[list[str]]:
    """The names of the parameters in each AdamW group train.py built, in order: how torch's optimizer
    state (ZeRO-0, fp32) is indexed, so another layout can read it per parameter (training/reshard.py)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in param_groups(module, weight_decay)]


def write_layer_files(module, config, tag_dir: str) -> None:
    """Collective, data-parallel engine: the pipeline's per-spec layer files, written by rank 0.

    Under ZeRO-3 each module's parameters are gathered first (a no-op for ZeRO 0-2), so the
    checkpoint exports with ``convert2ckpt.py --to-hf`` and loads as ``model_name_or_path`` exactly
    like one saved by the pipeline engine.
    """
    import deepspeed

    for index, m in local_modules(module):
        with deepspeed.zero.GatheredParameters(list(m.parameters()), modifier_rank=None):
            if dist.get_rank() == 0:
                state = {k: v.detach().clone() for k, v in m.state_dict().items()}
                torch.save(state, os.path.join(tag_dir, layer_file_name(index)))


def write_side_files(resolved: Resolved) -> None:
    """config.json, tokenizer files and the resolved config, so output_dir is self-contained."""
    cfg = resolved.cfg
    if resolved.from_scratch:
        write_config(resolved.model_config.to_dict(), cfg.output_dir)
        copy_tokenizer_files(tokenizer_dir(cfg), cfg.output_dir)
    elif os.path.abspath(cfg.model_name_or_path) != os.path.abspath(cfg.output_dir):
        copy_side_files(cfg.model_name_or_path, cfg.output_dir, dtype=None)
    OmegaConf.save(OmegaConf.structured(cfg), os.path.join(cfg.output_dir, "train_config.yaml"))


def remove_interrupted(output_dir: str, tag: str) -> None:
    """Remove ``output_dir/tag`` before saving into it: left by an interrupted save, it may hold files
    of the older attempt that this save would not overwrite. Never the checkpoint ``latest`` names."""
    path = os.path.join(output_dir, tag)
    if not os.path.isdir(path) or latest_tag(output_dir) == tag:
        return
    print(f"[train] removing {path}: an incomplete checkpoint left by an interrupted save", flush=True)
    shutil.rmtree(path)


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


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's own checkpoint engine, which loads with ``weights_only=False`` (any pickle runs),
    loading with :func:`load_deepspeed_file` instead. Saving is unchanged."""

    def load(self, path: str, map_location=None):
        return load_deepspeed_file(path, map_location)


def load_without_pickles(engine) -> None:
    """Every file ``engine.load_checkpoint`` reads goes through :class:`WeightsOnlyCheckpointEngine`
    (engine states, ZeRO optimizer states, and the pipeline's layer files)."""
    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise CheckpointError(
            f"checkpoint engine {type(engine.checkpoint_engine).__name__}: only DeepSpeed's torch engine is "
            "supported (its loads are made pickle-free here); remove the JSON's checkpoint engine settings"
        )
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)  # its serialization settings


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
            problems.append(f"{path}: unreadable ({first_line(e)})")
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


def read_trainer_state(resolved: Resolved, engine) -> dict:
    """This rank's trainer state of the checkpoint being resumed (run through on_all_ranks), once this
    stage's layer files are checked against the model, the DeepSpeed files it will read are there, and
    no file of its share names anything a checkpoint does not hold (before DeepSpeed loads anything)."""
    cfg, tag = resolved.cfg, resolved.resume_tag
    if resolved.lora:
        problems = adapter_file_problems(
            local_modules(engine.module), resolved.model_config, os.path.join(cfg.output_dir, tag)
        )
    else:
        problems = stage_file_problems(engine.module, resolved.model_config, cfg.output_dir, tag)
    problems += missing_deepspeed_files(engine, cfg.output_dir, tag)
    problems += unsafe_checkpoint_files(os.path.join(cfg.output_dir, tag), dist.get_rank(), dist.get_world_size())
    if problems:
        raise CheckpointError(f"cannot resume from {cfg.output_dir}/{tag}:\n  " + "\n  ".join(problems))
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
    optimizer state is read from the saved files per parameter (training/reshard.py), then the step
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
        raise CheckpointError(f"cannot resume {output_dir}/{tag} on this layout:\n  " + "\n  ".join(problems))
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
