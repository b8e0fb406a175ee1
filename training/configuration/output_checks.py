"""output_dir before start: a directory this process can write, with room for the checkpoints the run keeps."""

from __future__ import annotations

import os
import shutil
import tempfile

from models.llama_pipe import model_parameters
from training.configuration.schema import TrainConfig

# Checkpoint bytes per parameter besides the weights: AdamW's two moments and the fp32 master copy
# (ZeRO keeps one even in fp32), 4 bytes each, in DeepSpeed's optimizer-state files. Measured: a
# tiny fp32 ZeRO-1 pipe 2 x data 2 checkpoint is 16.8 bytes per parameter (4 weights + 12 + JSON).
OPTIMIZER_BYTES_PER_PARAM = 12
CHECKPOINT_OVERHEAD_BYTES_PER_RANK = 64 << 10  # trainer state JSON (RNG states, ~34 KB), engine file, YAML


def nearest_existing_dir(path: str) -> str:
    """``path`` itself if it exists, else its closest existing ancestor (what creating it would write into)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def output_dir_problems(cfg: TrainConfig) -> list[str]:
    """output_dir must be (or be creatable as) a directory this process can write: probed by creating
    and removing a temporary entry, so permissions, read-only mounts and full quotas all show."""
    out = cfg.output_dir
    where = nearest_existing_dir(out)
    if not os.path.isdir(where):
        return [f"output_dir {out}: {where} exists and is not a directory: choose another output_dir"]
    try:
        if where == os.path.abspath(out):
            fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=where)
            os.close(fd)
            os.remove(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=where))
    except OSError as e:
        return [
            f"output_dir {out} is not writable ({e.strerror} in {where}): choose another output_dir or make it writable"
        ]
    return []


def checkpoint_size_bytes(model_config, precision: str, weight_copies: int, world_size: int) -> tuple[int, str]:
    """(estimated bytes of one checkpoint, how it was estimated).

    Layer files hold the weights in the training dtype; DeepSpeed's optimizer-state files hold
    AdamW's two moments and an fp32 master copy (OPTIMIZER_BYTES_PER_PARAM). ``weight_copies``: the
    engine's (parallel/engines.py): 1, or 2 where the engine file holds the module's weights besides the layer files.
    """
    params = model_parameters(model_config)
    weight_bytes = 4 if precision == "fp32" else 2
    per_param = weight_bytes * weight_copies + OPTIMIZER_BYTES_PER_PARAM
    how = (
        f"{params / 1e6:.1f} M parameters x {per_param} bytes: {precision} weights"
        f"{'' if weight_copies == 1 else ' twice (layer files + engine file)'} + AdamW moments and fp32 master weights"
    )
    return params * per_param + world_size * CHECKPOINT_OVERHEAD_BYTES_PER_RANK, how


def disk_problems(cfg: TrainConfig, model_config, weight_copies: int, world_size: int) -> tuple[list[str], list[str]]:
    """(problems, warnings): free space under output_dir against one checkpoint (``min_free_disk_gb``;
    ``weight_copies``: :func:`checkpoint_size_bytes`'s)."""
    if cfg.min_free_disk_gb == 0 or model_config is None:
        return [], []
    where = nearest_existing_dir(cfg.output_dir)
    if not os.path.isdir(where):
        return [], []  # output_dir_problems reports it
    free = shutil.disk_usage(where).free
    one, how = checkpoint_size_bytes(model_config, cfg.precision, weight_copies, world_size)
    need = one if cfg.min_free_disk_gb < 0 else cfg.min_free_disk_gb * 1e9
    if free < need:
        why = (
            f"one checkpoint needs about {need / 1e9:.3g} GB ({how})"
            if cfg.min_free_disk_gb < 0
            else f"min_free_disk_gb={cfg.min_free_disk_gb:g} asks for {need / 1e9:.3g} GB"
        )
        return [
            f"output_dir {cfg.output_dir}: {free / 1e9:.3g} GB free on its file system ({where}), but {why}: "
            f"free space or choose another output_dir (min_free_disk_gb=0 skips this check)"
        ], []
    kept = (
        cfg.save_total_limit + 1
        if cfg.save_total_limit
        else (cfg.max_steps // cfg.save_steps + 1 if cfg.save_steps and cfg.max_steps and not cfg.num_epochs else 1)
    )
    if kept > 1 and free < kept * one:
        return [], [
            f"output_dir {cfg.output_dir}: {free / 1e9:.3g} GB free, but {kept} checkpoints of about {one / 1e9:.3g} "
            "GB "
            f"each will be on disk at once (save_total_limit={cfg.save_total_limit}, the new one is written before "
            f"the oldest is deleted): a later save will fail; lower save_total_limit or free space"
        ]
    return [], []
