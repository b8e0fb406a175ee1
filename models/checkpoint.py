"""Pipeline checkpoint directories: DeepSpeed's layout, read one stage at a time.

A directory made by ``convert2ckpt.py`` or saved by ``train.py`` looks like::

    CKPT_DIR/latest                                  the tag, e.g. ``global_step0``
    CKPT_DIR/<tag>/layer_XX-model_states.pt          one per spec with weights (see layer_file_name)
    CKPT_DIR/<tag>/mp_rank_00_model_states.pt        DeepSpeed's per-stage engine state (a stub after conversion)
    CKPT_DIR/config.json, tokenizer files            so the directory is self-contained
"""

from __future__ import annotations

import json
import os
import resource
import shutil
from dataclasses import dataclass

import torch
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from torch import nn

from models.llama_pipe import SpecInfo, layer_file_name, spec_layout

LATEST_FILE = "latest"  # DeepSpeed's name for the file holding the newest tag
# Every tokenizer file transformers may write (copied with checkpoints, hashed into data cache keys).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
# Files copied alongside the weights so a directory is self-contained: generation defaults and tokenizer.
SIDE_FILES = ("generation_config.json", *TOKENIZER_FILES)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be used, with what is wrong and where."""


def read_tag(ckpt_dir: str, tag: str | None = None) -> str:
    """``tag`` if given, else the tag named in ``ckpt_dir/latest``; checks the tag directory exists."""
    if tag is None:
        latest = os.path.join(ckpt_dir, LATEST_FILE)
        if not os.path.isfile(latest):
            hint = ""
            if os.path.isfile(os.path.join(ckpt_dir, "config.json")):
                hint = (
                    f" It looks like a Hugging Face model directory: convert it first with "
                    f"`python convert2ckpt.py --input {ckpt_dir} --output <CKPT_DIR>`."
                )
            raise CheckpointError(f"{latest} not found: {ckpt_dir} is not a pipeline checkpoint.{hint}")
        with open(latest) as f:
            tag = f.read().strip()
    tag_dir = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(tag_dir):
        available = sorted(d for d in os.listdir(ckpt_dir) if os.path.isdir(os.path.join(ckpt_dir, d)))
        raise CheckpointError(f"checkpoint tag {tag!r} not found in {ckpt_dir} (tags there: {available})")
    return tag


def load_layer_file(path: str) -> dict[str, torch.Tensor]:
    """One layer file, tensors only (``weights_only``), memory-mapped so nothing is read twice."""
    if not os.path.isfile(path):
        raise CheckpointError(f"missing layer file {path}")
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def check_state_dict(
    where: str, loaded: dict[str, torch.Tensor], expected: dict[str, torch.Size]
) -> list[str]:
    """Problems between a loaded state dict and the expected keys and shapes, one line each."""
    problems = [f"{where}: missing tensor {k!r} (expected shape {tuple(s)})" for k, s in expected.items() if k not in loaded]
    problems += [f"{where}: unexpected tensor {k!r} (shape {tuple(v.shape)})" for k, v in loaded.items() if k not in expected]
    problems += [
        f"{where}: tensor {k!r} has shape {tuple(loaded[k].shape)}, the model config expects {tuple(s)}"
        for k, s in expected.items()
        if k in loaded and tuple(loaded[k].shape) != tuple(s)
    ]
    return problems


@dataclass
class StageLoadReport:
    """What one rank loaded: for the start-up announcement and the load-memory measurement."""

    files: list[str]
    num_tensors: int
    bytes_read: int
    peak_rss_mb: float


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def local_modules(model: PipelineModule) -> list[tuple[int, nn.Module]]:
    """(spec index, module holding its weights) for this stage; a tied module appears once."""
    out, seen_tied = [], set()
    for index in range(model._local_start, model._local_stop):
        spec = model._layer_specs[index]
        if isinstance(spec, TiedLayerSpec):
            if spec.key in seen_tied:
                continue
            seen_tied.add(spec.key)
            out.append((index, model.tied_modules[spec.key]))
        else:
            out.append((index, model.forward_funcs[index - model._local_start]))
    return out


def load_stage_weights(model: PipelineModule, config, ckpt_dir: str, tag: str | None = None) -> StageLoadReport:
    """Load this rank's stage from ``ckpt_dir``: only the layer files of the specs it owns.

    A tied LM head on the last stage reads the embedding's file (the only copy on disk). All
    mismatches are collected and raised together, each naming the file, the tensor and both shapes.
    """
    tag = read_tag(ckpt_dir, tag)
    layout: list[SpecInfo] = spec_layout(config)
    files, problems, num_tensors, nbytes = [], [], 0, 0
    for index, module in local_modules(model):
        path = os.path.join(ckpt_dir, tag, layer_file_name(layout[index].file_index))
        try:
            state = load_layer_file(path)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        expected = {k: v.shape for k, v in module.state_dict().items()}
        found = check_state_dict(path, state, expected)
        problems += found
        if not found:
            module.load_state_dict(state, strict=True)
            files.append(path)
            num_tensors += len(state)
            nbytes += sum(t.numel() * t.element_size() for t in state.values())
        del state
    if problems:
        raise CheckpointError("cannot load stage weights:\n  " + "\n  ".join(problems))
    return StageLoadReport(files, num_tensors, nbytes, peak_rss_mb())


def write_config(config: dict, dst: str, dtype: torch.dtype | None = None) -> None:
    """``config.json`` in ``dst``, with its dtype updated when the weights were cast."""
    if dtype is not None:
        config = {k: v for k, v in config.items() if k != "torch_dtype"}
        config["dtype"] = DTYPE_NAMES[dtype]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def copy_tokenizer_files(src: str, dst: str) -> None:
    """Generation config and every tokenizer file present in ``src``."""
    for name in SIDE_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


def copy_side_files(src: str, dst: str, dtype: torch.dtype | None) -> None:
    """config.json (dtype updated when converting), generation config and tokenizer files."""
    with open(os.path.join(src, "config.json")) as f:
        write_config(json.load(f), dst, dtype)
    copy_tokenizer_files(src, dst)
