"""Pipeline checkpoint directories: DeepSpeed's layout, read one stage at a time.

A directory made by ``convert2ckpt.py`` or saved by ``train.py`` looks like::

    CKPT_DIR/latest                                  the tag, e.g. ``global_step0``
    CKPT_DIR/<tag>/layer_XX-model_states.pt          one per spec with weights (see layer_file_name)
    CKPT_DIR/<tag>/mp_rank_00_model_states.pt        DeepSpeed's per-stage engine state (a stub after conversion)
    CKPT_DIR/config.json, tokenizer files            so the directory is self-contained

Layer files hold tensors only and are read with ``torch.load(weights_only=True)``: a file that holds
anything else (a pickle that would run code when loaded) is refused. DeepSpeed's own files
(``mp_rank_*``, optimizer states) are pickles that DeepSpeed loads with ``weights_only=False`` when a
run resumes: a checkpoint directory to resume from must be trusted like code.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import re
import shutil
import struct
import zipfile
from dataclasses import dataclass

import torch
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from safetensors import SafetensorError, safe_open
from torch import nn

from models.family_gpt_oss import is_mxfp4
from models.host_memory import peak_rss_mb, release_mapped_pages
from models.specs import SpecInfo, expected_state_shapes, layer_file_name, spec_layout

LATEST_FILE = "latest"  # DeepSpeed's name for the file holding the newest tag
# Every tokenizer file transformers may write (copied with checkpoints, hashed into data cache keys).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Files copied alongside the weights so a directory is self-contained: generation defaults and tokenizer.
SIDE_FILES = ("generation_config.json", *TOKENIZER_FILES)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
TAG_PATTERN = re.compile(r"^global_step(\d+)$")  # DeepSpeed's default tag naming, used by train.py
# Bytes copied out of a memory-mapped layer file before its pages are released (see copy_from_mapped):
# bounds what a load holds beyond the stage's own parameters, and is large enough that the one
# madvise call per chunk costs nothing measurable.
LOAD_CHUNK = 16 * 2**20
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since PyTorch 1.6 is a zip archive
HF_WEIGHT_NAMES = (
    "model.safetensors, model-*.safetensors or pytorch_model*.bin"  # what hf_weight_files finds, for messages
)


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be used, with what is wrong and where."""


def latest_tag(ckpt_dir: str) -> str | None:
    """The tag named in ``ckpt_dir/latest`` (DeepSpeed writes it without a newline), None without one."""
    latest = os.path.join(ckpt_dir, LATEST_FILE)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


def read_tag(ckpt_dir: str, tag: str | None = None) -> str:
    """``tag`` if given, else the tag named in ``ckpt_dir/latest``; checks the tag directory exists."""
    if tag is None:
        tag = latest_tag(ckpt_dir)
    if tag is None:
        hint = ""
        if os.path.isfile(os.path.join(ckpt_dir, "config.json")):
            hint = (
                f" It looks like a Hugging Face model directory: convert it first with "
                f"`python convert2ckpt.py --input {ckpt_dir} --output <CKPT_DIR>`."
            )
        raise CheckpointError(
            f"{os.path.join(ckpt_dir, LATEST_FILE)} not found: {ckpt_dir} is not a pipeline checkpoint.{hint}"
        )
    tag_dir = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(tag_dir):
        available = sorted(d for d in os.listdir(ckpt_dir) if os.path.isdir(os.path.join(ckpt_dir, d)))
        raise CheckpointError(f"checkpoint tag {tag!r} not found in {ckpt_dir} (tags there: {available})")
    return tag


def load_layer_file(path: str) -> dict[str, torch.Tensor]:
    """One layer file, tensors only (``weights_only``), memory-mapped so nothing is read twice.

    A file holding anything but tensors is refused before any of it is unpickled into objects.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"missing layer file {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds objects other than tensors (a pickle that could run code when "
            f"loaded): refused ({unpickling_refusal(e)})"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:  # truncated (a cut zip can fail a seek: EINVAL), or not torch.save's
        raise CheckpointError(unreadable_torch_file(path, e)) from None


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type where the message is empty."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def torch_file_damage(path: str) -> str | None:
    """What makes the ``torch.save`` file ``path`` unreadable, seen from its size and zip structure
    alone (no tensor is read, so cheap enough to check before loading); None when it looks whole.

    A zip archive is indexed by its central directory at the very end: a file cut short loses it.
    """
    size = os.path.getsize(path)
    if size == 0:
        return f"{path} is empty (0 bytes)"
    with open(path, "rb") as f:
        zipped = f.read(len(ZIP_MAGIC)) == ZIP_MAGIC
    if zipped and not zipfile.is_zipfile(path):
        return f"{path} is truncated ({size} bytes): the end of its zip archive (the central directory) is missing"
    return None


def unreadable_torch_file(path: str, error: BaseException) -> str:
    """A message for a ``torch.load`` of ``path`` that failed with ``error`` (torch's own names no file,
    or only a zip reader's internals)."""
    damage = torch_file_damage(path)
    if damage:
        return damage
    detail = first_line(error)
    if "mmap can only be used" in detail:  # torch's refusal of anything that is not a zip archive
        with open(path, "rb") as f:
            return f"{path} is not a torch.save zip archive (it starts with {f.read(8)!r})"
    if isinstance(error, EOFError) or "unexpected EOF" in detail:  # the legacy (pre-zip) format, cut short
        return f"{path} is truncated ({os.path.getsize(path)} bytes): {detail}"
    return f"{path} is not a readable torch.save file: {detail}"


def safetensors_damage(path: str, error: BaseException) -> str:
    """What is wrong with a safetensors file that safetensors refused with ``error``, from its header:
    safetensors' own message names neither the file nor the sizes ("incomplete metadata, file not
    fully covered"). The layout: an 8-byte little-endian header length, the JSON header, the tensors."""
    size = os.path.getsize(path)
    if size < 8:
        return f"{path} is truncated ({size} bytes): too short for a safetensors header"
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            return (
                f"{path} is truncated or not a safetensors file: its first 8 bytes announce a "
                f"{header_len}-byte header, the file has {size} bytes"
            )
        try:
            header = json.loads(f.read(header_len))
            data_len = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"{path} is damaged: its header is not valid safetensors JSON ({first_line(error)})"
    expected = 8 + header_len + data_len
    if size < expected:
        return (
            f"{path} is truncated: {size} of the {expected} bytes its header describes ({100 * size / expected:.0f}%)"
        )
    if size > expected:
        return f"{path} is damaged: {size - expected} bytes beyond the {expected} its header describes"
    return f"{path} is not a readable safetensors file: {first_line(error)}"


def open_safetensors(path: str):
    """``safe_open(path)``; a file safetensors refuses raises CheckpointError naming it and what is wrong."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise CheckpointError(safetensors_damage(path, e)) from None


def hf_weight_files(model_dir: str) -> list[str]:
    """The weight files of a Hugging Face model directory: its safetensors files (one, or shards) if it
    has any, else its ``pytorch_model*.bin`` files; [] when it has neither."""
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))) or sorted(
        glob.glob(os.path.join(model_dir, "pytorch_model*.bin"))
    )


def hf_weight_index(model_dir: str) -> tuple[str, dict[str, str]] | None:
    """(the index file, its weight_map {tensor: shard file name}) of a sharded Hugging Face directory, for the kind of
    weights ``hf_weight_files`` reads (safetensors if the directory has any or indexes any, else ``.bin``); None
    without an index. An index that is not JSON with a weight_map raises CheckpointError naming it."""
    names = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
    if glob.glob(os.path.join(model_dir, "*.safetensors")):
        names = names[:1]
    path = next((os.path.join(model_dir, n) for n in names if os.path.isfile(os.path.join(model_dir, n))), None)
    if path is None:
        return None
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is damaged: not an index of the shards ({type(e).__name__}: {e})") from None
    return path, weight_map


def missing_shards(model_dir: str) -> str | None:
    """The shard files the directory's index (``hf_weight_index``) names that are not there, as one line naming them
    and the tensors they hold; None when every shard is present. Without this, a deleted shard shows as its tensors
    missing."""
    index = hf_weight_index(model_dir)
    if index is None:
        return None
    path, weight_map = index
    gone: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        if not os.path.isfile(os.path.join(model_dir, name)):
            gone.setdefault(name, []).append(key)
    if not gone:
        return None
    shards = ", ".join(f"{name} ({len(keys)} tensors, e.g. {keys[0]!r})" for name, keys in sorted(gone.items()))
    total = len(set(weight_map.values()))
    return (
        f"{model_dir} lacks {len(gone)} of the {total} shard files its index {os.path.basename(path)} names: "
        f"{shards}. The download or copy is incomplete: copy the missing shard files from where the model came from"
    )


def is_pipeline_checkpoint(path: str) -> bool:
    """Whether ``path`` is in DeepSpeed's pipeline layout (convert2ckpt.py's output or train.py's output_dir)."""
    return latest_tag(path) is not None or bool(checkpoint_tags(path))


@torch.no_grad()
def copy_from_mapped(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for ``src`` in a mapped layer file, ``LOAD_CHUNK`` bytes at a time, releasing
    each chunk's pages once copied: the load then holds the stage plus one chunk, not plus one file. A
    strided ``src`` (a tensor-parallel rank's columns of a weight) goes by blocks of rows."""
    if dst.shape != src.shape or src.dim() == 0:
        dst.copy_(src)
        release_mapped_pages(src)
        return
    if dst.is_contiguous() and src.is_contiguous():
        dst, src = dst.view(-1), src.view(-1)  # (numel,) views, no copy
    step = max(1, LOAD_CHUNK // (src[0].numel() * src.element_size()))  # rows per chunk
    for start in range(0, src.shape[0], step):
        chunk = src[start : start + step]
        dst[start : start + step].copy_(chunk)
        release_mapped_pages(chunk)


def full_shape(t: torch.Tensor) -> torch.Size:
    """The shape of a parameter or buffer as the model defines it, also for a ZeRO-3 partitioned
    parameter (``deepspeed.zero.Init``), whose own data is an empty placeholder."""
    return getattr(t, "ds_shape", t.shape)


def full_numel(t: torch.Tensor) -> int:
    """The element count of :func:`full_shape`."""
    return getattr(t, "ds_numel", t.numel())


def split_of(t: torch.Tensor | None) -> tuple[int, int, int] | None:
    """(dim, rank, world) of a parameter a rank holds a piece of: a tensor-parallel piece (``tp_split``,
    parallel/tensor_parallel.py) or this rank's experts of a MoE layer (``ep_split``, parallel/expert_parallel.py)."""
    return getattr(t, "tp_split", None) or getattr(t, "ep_split", None)


def whole_shape(t: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor in a layer file that parameter ``t`` holds (a piece of, for a
    tensor-parallel or expert-parallel rank: :func:`split_of`)."""
    shape = list(full_shape(t))
    split = split_of(t)
    if split is not None:
        dim, _, world = split
        shape[dim] *= world
    return torch.Size(shape)


def tp_piece(whole: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """The piece of ``whole`` a tensor- or expert-parallel rank holds of parameter ``p`` (:func:`split_of`), or
    ``whole`` for a parameter that is not split."""
    split = split_of(p)
    if split is None:
        return whole
    dim, rank, world = split
    return whole.chunk(world, dim)[rank]


def is_partitioned(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ZeRO-3 parameter (made by ``deepspeed.zero.Init``): each rank holds one slice."""
    return hasattr(t, "ds_id")


@torch.no_grad()
def assign_partitioned(param: nn.Parameter, full: torch.Tensor, copy=torch.Tensor.copy_) -> None:
    """Give the ZeRO-3 parameter ``param`` the value ``full`` (its whole tensor, any dtype): this rank
    keeps only its own partition, cast to the parameter's dtype.

    Every rank calls this with the same ``full`` and keeps its own slice: no collective runs, and no
    rank holds more than this one tensor whole (none at all when ``full`` is already in the parameter's
    dtype: it becomes the parameter's data as it is, e.g. a view of a mapped layer file, and only this
    rank's slice of it is read). That is less than ``deepspeed.zero.GatheredParameters(...,
    modifier_rank=0)`` with rank 0 reading: every rank would all-gather the whole layer, then receive
    rank 0's copy (a layer whole on every rank, the layer sent twice, rank 0 reading the whole model
    alone). The slicing is DeepSpeed's own: ``param.partition(has_been_updated=True)`` is the call
    GatheredParameters makes on exit once the new values are in place (hpZeRO's secondary partition
    included). ``copy(dst, src)`` fills a cast copy (``copy_from_mapped`` for a mapped file).
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if param.ds_status != ZeroParamStatus.NOT_AVAILABLE or param.ds_tensor is None:
        raise RuntimeError(f"ZeRO-3 parameter {param.ds_id} is {param.ds_status.name}, not partitioned: cannot assign")
    if getattr(param.ds_tensor, "final_location", None) is not None:  # swapped to NVMe
        raise RuntimeError(f"ZeRO-3 parameter {param.ds_id} lives on {param.ds_tensor.final_location}: not supported")
    if tuple(full.shape) != tuple(param.ds_shape):
        raise ValueError(f"shape {tuple(full.shape)} for a ZeRO-3 parameter of shape {tuple(param.ds_shape)}")
    device = param.device  # where DeepSpeed keeps the parameter whole (the accelerator), not its partition
    if full.dtype == param.dtype and full.device == device and full.is_contiguous():
        data = full
    else:
        data = torch.empty(param.ds_shape, dtype=param.dtype, device=device)
        copy(data, full)
    param.data = data
    param.ds_status = ZeroParamStatus.AVAILABLE
    param.partition(has_been_updated=True)  # copies this rank's slice, then frees the data again


def unpickling_refusal(error: Exception) -> str:
    """The line of a ``weights_only=True`` refusal that says what the file tried to load."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = [line for line in lines if not line.startswith(("Weights only load failed", "Check the documentation"))]
    return detail[0] if detail else lines[0] if lines else type(error).__name__


def deepspeed_state_globals() -> list[type]:
    """What DeepSpeed pickles into its checkpoint files besides tensors and plain containers (the ZeRO
    optimizer states' loss scaler, ZeRO stage and fragment addresses): allowed by name when loading,
    every other class or function refused."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_deepspeed_file(path: str, map_location=None, mmap: bool = False):
    """A DeepSpeed checkpoint file (engine state, optimizer states, a layer file) with
    ``weights_only=True``: tensors, containers and :func:`deepspeed_state_globals` only, so a tampered
    file is refused instead of running what it names."""
    with torch.serialization.safe_globals(deepspeed_state_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"{path} holds objects a DeepSpeed checkpoint does not (a pickle that could run code when "
                f"loaded): refused, nothing loaded ({unpickling_refusal(e)})"
            ) from None
        except FileNotFoundError:
            raise
        except (RuntimeError, EOFError, OSError) as e:  # truncated or damaged: torch's message names no file
            raise CheckpointError(unreadable_torch_file(path, e)) from None


def checkpoint_tags(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, tag) of every ``global_step<N>`` directory in ``ckpt_dir``, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(
        (int(m.group(1)), name)
        for name in os.listdir(ckpt_dir)
        if (m := TAG_PATTERN.match(name)) and os.path.isdir(os.path.join(ckpt_dir, name))
    )


def tags_newer_than_latest(ckpt_dir: str) -> list[str]:
    """Checkpoint directories that ``latest`` does not cover: newer than the tag it names, or any at
    all when there is no ``latest``. train.py writes ``latest`` only once every rank has finished a
    save, so these were left by an interrupted save (or by moving ``latest`` back): never resumed from."""
    latest, latest_step = latest_tag(ckpt_dir), -1
    if latest is not None:
        m = TAG_PATTERN.match(latest)
        if m is None:
            return []  # a tag train.py did not name: nothing to compare with
        latest_step = int(m.group(1))
    return [tag for step, tag in checkpoint_tags(ckpt_dir) if step > latest_step]


def check_state_dict(where: str, loaded: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> list[str]:
    """Problems between a loaded state dict and the expected keys and shapes, one line each."""
    problems = [
        f"{where}: missing tensor {k!r} (expected shape {tuple(s)})" for k, s in expected.items() if k not in loaded
    ]
    problems += [
        f"{where}: unexpected tensor {k!r} (shape {tuple(v.shape)})" for k, v in loaded.items() if k not in expected
    ]
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


def stage_pieces(model: PipelineModule) -> list[tuple[int, int, list]]:
    """(first spec, end, forward functions) of each piece of the model this rank holds: its stage, or the two
    pieces of a DualPipeV rank (DeepSpeed's ``phase_bounds`` and ``phase_funcs``)."""
    if hasattr(model, "phase_bounds"):
        return [(start, stop, funcs) for (start, stop), funcs in zip(model.phase_bounds, model.phase_funcs)]
    return [(model._local_start, model._local_stop, model.forward_funcs)]


def local_modules(model: PipelineModule) -> list[tuple[int, nn.Module]]:
    """(spec index, module holding its weights) for this rank's pieces; a tied module appears once."""
    out, seen_tied = [], set()
    for start, stop, funcs in stage_pieces(model):
        for index in range(start, stop):
            spec = model._layer_specs[index]
            if isinstance(spec, TiedLayerSpec):
                if spec.key in seen_tied:
                    continue
                seen_tied.add(spec.key)
                out.append((index, model.tied_modules[spec.key]))
            else:
                out.append((index, funcs[index - start]))
    return out


def load_stage_weights(model: PipelineModule, config, ckpt_dir: str, tag: str | None = None) -> StageLoadReport:
    """Load this rank's stage from ``ckpt_dir``: only the layer files of the specs it owns.

    A tied LM head on the last stage reads the embedding's file (the only copy on disk). All
    mismatches are collected and raised together, each naming the file, the tensor and both shapes.
    A model built under ``deepspeed.zero.Init`` (ZeRO-3, models/files/zero3_load.py) is filled the same way, one
    tensor at a time, each rank keeping only its partition (``assign_partitioned``): no collective
    runs, so a rank that fails here cannot leave the others waiting.
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
        found = fill_module_(module, state, path)
        problems += found
        if not found:
            files.append(path)
            num_tensors += len(state)
            targets = module.state_dict(keep_vars=True)
            nbytes += sum(tp_piece(t, targets[k]).numel() * t.element_size() for k, t in state.items())  # read
        del state
    if problems:
        raise CheckpointError("cannot load stage weights:\n  " + "\n  ".join(problems))
    return StageLoadReport(files, num_tensors, nbytes, peak_rss_mb())


@torch.no_grad()
def fill_module_(module: nn.Module, state: dict[str, torch.Tensor], path: str) -> list[str]:
    """Copy a layer file's tensors (``state``, mapped from ``path``) into ``module``'s parameters and
    buffers, or return the problems (file, tensor, both shapes) and copy nothing. A tensor-parallel
    rank copies only its piece of each split tensor, so only the piece's pages are read from disk; a
    ZeRO-3 partitioned parameter keeps only its partition (``assign_partitioned``)."""
    targets = module.state_dict(keep_vars=True)  # the live parameters and buffers, by name
    problems = check_state_dict(path, state, {k: whole_shape(v) for k, v in targets.items()})
    if problems:
        return problems
    for key, t in state.items():
        if is_partitioned(targets[key]):
            assign_partitioned(targets[key], t, copy=copy_from_mapped)
            release_mapped_pages(t)
        else:
            copy_from_mapped(targets[key], tp_piece(t, targets[key]))
    return []


def stage_file_problems(model: PipelineModule, config, ckpt_dir: str, tag: str) -> list[str]:
    """Problems of this stage's layer files in ``ckpt_dir/tag`` against the model ``config``: a missing
    file, a missing or unexpected tensor, a wrong shape (file, tensor and both shapes). Expected
    shapes come from the specs on the meta device, so this works whatever DeepSpeed did to the
    module's parameters (ZeRO-3 partitions them)."""
    layout: list[SpecInfo] = spec_layout(config)
    problems = []
    for index, _ in local_modules(model):
        file_index = layout[index].file_index
        path = os.path.join(ckpt_dir, tag, layer_file_name(file_index))
        try:
            state = load_layer_file(path)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        problems += check_state_dict(path, state, expected_state_shapes(model._layer_specs[file_index]))
        del state
    return problems


def write_config(config: dict, dst: str, dtype: torch.dtype | None = None) -> None:
    """``config.json`` in ``dst``, with its dtype updated when the weights were cast, and without an MXFP4
    ``quantization_config`` (gpt-oss's experts are read dequantized: the weights written are never MXFP4)."""
    if is_mxfp4(config):
        config = {k: v for k, v in config.items() if k != "quantization_config"}
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
