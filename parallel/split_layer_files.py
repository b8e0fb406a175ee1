"""Stages whose ranks hold pieces of some parameters (tensor parallelism's ``tp_split``, expert parallelism's
``ep_split``): saved whole, so a layer file is the same whatever the layout, and loaded as each rank's pieces."""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.files.pipeline_dir import CheckpointError, fill_module_, load_layer_file


def save_whole(stage, save_dir: str, checkpoint_engine, group, split_attr: str) -> None:
    """Write every layer file of ``stage`` whole: each parameter carrying ``split_attr`` = (dim, rank, world) gathered
    over ``group`` (its pieces joined along ``dim``) and the file written by the group's first rank. Collective over
    ``group``."""
    checkpoint_engine.makedirs(save_dir, exist_ok=True)
    writer = dist.get_rank(group) == 0  # the only rank that holds a whole layer, to write it
    for idx, layer in enumerate(stage.forward_funcs):
        if not hasattr(layer, "state_dict"):
            continue
        state, params = {}, dict(layer.named_parameters())
        for key, t in layer.state_dict().items():
            split = getattr(params.get(key), split_attr, None)
            if split:
                dim, _, world = split
                pieces = [torch.empty_like(t) for _ in range(world)] if writer else None
                dist.gather(t.contiguous(), pieces, dst=dist.get_global_rank(group, 0), group=group)
                t = torch.cat(pieces, dim) if writer else t  # whole, as Hugging Face names and shapes it
            state[key] = t.clone()
        if writer:
            checkpoint_engine.save(state_dict=state, path=stage.ckpt_layer_path(save_dir, idx))


def load_pieces(stage, load_dir: str) -> None:
    """Fill every layer of ``stage`` from its whole layer file, each rank copying only its pieces
    (``models.files.pipeline_dir.fill_module_``); all problems raised together."""
    for idx, layer in enumerate(stage.forward_funcs):
        if not hasattr(layer, "load_state_dict"):
            continue
        path = stage.ckpt_layer_path(load_dir, idx)
        problems = fill_module_(layer, load_layer_file(path), path)
        if problems:
            raise CheckpointError("cannot load the stage's pieces:\n  " + "\n  ".join(problems))
