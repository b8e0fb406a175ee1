"""A rank's stage read straight from a Hugging Face directory: ``model_name_or_path=HF_DIR`` without converting.

Each rank reads only the tensors of the specs it owns (its tensor-parallel piece of each, its experts under expert
parallelism) from the memory-mapped safetensors files, one file or shards; the other shards are opened for their
headers only (which tensor is where, and its shape). Everything that names or checks a tensor is the converter's:
``HFTensorSource`` (the files, read one tensor at a time) and ``hf_input_problems`` (its refusals,
models/files/hf_convert.py), the names of ``spec_layout`` (each spec's Hugging Face prefix + its module's keys,
models/specs.py) and ``disk_pieces`` (experts stored one tensor per expert, models/files/hf_experts.py). The copy into
the stage is the layer-file loader's (models/files/pipeline_dir.py: ``copy_from_mapped``, ``tp_piece``,
``assign_partitioned``), so the load holds the stage plus one chunk, as from layer files.

``.bin`` weights (pickles) are not read here: train.py refuses them before it starts, with the command that
converts them (``hf_start_problems``). The run's checkpoints are layer files, as from a converted directory.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from models.files.hf_convert import TOOL, ConversionError, HFTensorSource, hf_input_problems
from models.files.hf_experts import assemble, disk_pieces
from models.files.pipeline_dir import (
    CheckpointError,
    StageLoadReport,
    assign_partitioned,
    copy_from_mapped,
    hf_weight_files,
    is_partitioned,
    is_pipeline_checkpoint,
    local_modules,
    split_of,
    tp_piece,
    whole_shape,
)
from models.host_memory import peak_rss_mb, release_mapped_pages
from models.specs import spec_layout

Piece = tuple[str, tuple, object]  # (disk key, disk shape, its view in the stage tensor): disk_pieces' entries


def is_hf_dir(path: str) -> bool:
    """Whether ``path`` is a Hugging Face model directory to start from (config.json, not a pipeline checkpoint)."""
    return os.path.isfile(os.path.join(path, "config.json")) and not is_pipeline_checkpoint(path)


def hf_start_problems(path: str, config) -> list[str]:
    """Why train.py cannot start from the Hugging Face directory ``path`` (model ``config``): ``.bin`` weights, and
    what the converter refuses (no weights, a damaged file, a missing, unexpected or misshapen tensor), each with
    the converter's message and what to run. Reads the safetensors headers only."""
    files = hf_weight_files(path)
    if files and files[0].endswith(".bin"):
        names = ", ".join(os.path.basename(f) for f in files[:3])
        names += f" and {len(files) - 3} more" if len(files) > 3 else ""
        ckpt = path.rstrip(os.sep) + "-ckpt"
        return [
            f"model_name_or_path {path} holds pickled weights ({names}): train.py reads a Hugging Face directory's "
            f"safetensors only. Convert it first (tensors only, never unpickled code): python {TOOL} --input {path} "
            f"--output {ckpt}, then model_name_or_path={ckpt}"
        ]
    try:
        source = HFTensorSource(path)
    except (ConversionError, CheckpointError) as e:
        return [f"model_name_or_path {path}: {e}"]
    problems = hf_input_problems(config, source)
    if not problems:
        return []
    return [
        f"model_name_or_path {path} does not match its config.json (python {TOOL} --input {path} refuses it "
        "alike):\n    " + "\n    ".join(problems)
    ]


def expert_rows(piece: Piece, shape: tuple) -> tuple[int, int]:
    """(first, last) index along dim 0 of the stage tensor of ``shape`` that the disk tensor ``piece`` fills: its
    view, taken on the meta device (no memory), says where it lies."""
    view = piece[2](torch.empty(shape, device="meta"))
    row = math.prod(shape[1:])
    last = view.storage_offset() + sum((n - 1) * s for n, s in zip(view.shape, view.stride()))
    return view.storage_offset() // row, last // row


def pieces_to_read(config, hf_key: str, target: torch.Tensor) -> list[Piece]:
    """The disk tensors this rank reads for stage tensor ``hf_key`` held in ``target``: the tensor itself, or,
    for experts stored one tensor per expert, those of the experts ``target`` holds (``split_of``: its rank's
    rows along dim 0 under expert parallelism, all of them otherwise)."""
    shape = tuple(whole_shape(target))
    pieces = disk_pieces(config, hf_key, shape)
    split = split_of(target)
    if len(pieces) == 1 or split is None or split[0] != 0:
        return pieces
    lo, hi = rows_held(split, shape[0])
    return [p for p in pieces if lo <= expert_rows(p, shape)[0] and expert_rows(p, shape)[1] < hi]


def rows_held(split: tuple[int, int, int], rows: int) -> tuple[int, int]:
    """[first, end) of the ``rows`` along dim 0 that a rank holds, for ``split`` = (0, rank, world): ``tp_piece``'s
    ``chunk``."""
    _, rank, world = split
    size = -(-rows // world)
    return min(rank * size, rows), min((rank + 1) * size, rows)


def stage_reads(model, config) -> list[tuple[int, nn.Module, str, dict[str, list[Piece]]]]:
    """What this rank reads: per module it fills (spec index, module, Hugging Face prefix, {module key: the disk
    tensors read for it}). The names are ``expected_hf_shapes``' (the spec's prefix + the module's keys), taken from
    this rank's modules rather than by building every spec. A tied LM head on the last stage reads the embedding's
    tensor (the only copy on disk)."""
    layout = spec_layout(config)
    out = []
    for index, module in local_modules(model):
        prefix = layout[layout[index].file_index].hf_prefix
        targets = module.state_dict(keep_vars=True)
        out.append((index, module, prefix, {k: pieces_to_read(config, prefix + k, t) for k, t in targets.items()}))
    return out


def stage_files(model, config, source: HFTensorSource) -> dict[str, list[str]]:
    """{file: the disk tensors this rank reads from it}, in reading order: the shards its stage touches."""
    files: dict[str, list[str]] = {}
    for _, _, _, reads in stage_reads(model, config):
        for pieces in reads.values():
            for key, _, _ in pieces:
                files.setdefault(source.key_to_file[key], []).append(key)
    return files


def read_problems(reads: dict[str, list[Piece]], source: HFTensorSource) -> list[str]:
    """The converter's checks on what a module reads (checked for the whole directory before the start; again
    here, as the layer-file loader checks its files, since the directory may have changed since)."""
    problems = []
    for pieces in reads.values():
        for key, shape, _ in pieces:
            if key not in source.key_to_file:
                problems.append(f"{source.model_dir}: {source.missing(key, shape)}")
            elif source.shape(key) != tuple(shape):
                problems.append(
                    f"{source.key_to_file[key]}: tensor {key!r} has shape {source.shape(key)}, config.json implies "
                    f"{tuple(shape)}"
                )
    return problems


@torch.no_grad()
def fill_tensor_(target: torch.Tensor, pieces: list[Piece], source: HFTensorSource) -> int:
    """Copy ``target``'s value (its piece, for a split or partitioned parameter) out of the mapped files; returns
    the bytes read."""
    shape = tuple(whole_shape(target))
    if len(pieces) == 1 and tuple(pieces[0][1]) == shape:  # stored as it is: the layer-file loader's copy
        src = source.get(pieces[0][0])
        if is_partitioned(target):
            assign_partitioned(target, src, copy=copy_from_mapped)
            release_mapped_pages(src)
            return src.numel() * src.element_size()
        piece = tp_piece(src, target)
        copy_from_mapped(target, piece)
        return piece.numel() * src.element_size()
    split = split_of(target)
    if is_partitioned(target) or (split is not None and split[0] != 0) or not target.is_contiguous():
        # Assembled whole first (every expert read): no layout trains experts this way today.
        whole = assemble(pieces, shape, source.get)
        if is_partitioned(target):
            assign_partitioned(target, whole)
        else:
            target.copy_(tp_piece(whole, target))
        return whole.numel() * whole.element_size()
    # Each expert's disk tensor straight into its place in this rank's rows of the stage tensor.
    lo = 0 if split is None else rows_held(split, shape[0])[0]
    row, nbytes = math.prod(shape[1:]), 0
    for key, _, select in pieces:
        view = select(torch.empty(shape, device="meta"))
        src = source.get(key)
        offset = target.storage_offset() + view.storage_offset() - lo * row
        copy_from_mapped(target.data.as_strided(view.shape, view.stride(), offset), src)
        nbytes += src.numel() * src.element_size()
    return nbytes


def load_stage_from_hf(model, config, hf_dir: str) -> StageLoadReport:
    """Load this rank's stage from the Hugging Face directory ``hf_dir``: only its own tensors (``stage_reads``).
    Every problem is collected and raised together, before anything is copied. Files are unmapped after each
    module (``HFTensorSource.release``)."""
    source = HFTensorSource(hf_dir)
    plan = stage_reads(model, config)
    problems = [p for _, _, _, reads in plan for p in read_problems(reads, source)]
    if problems:
        raise CheckpointError("cannot load stage weights:\n  " + "\n  ".join(problems))
    files, num_tensors, nbytes = set(), 0, 0
    for _, module, _, reads in plan:
        targets = module.state_dict(keep_vars=True)
        for key, pieces in reads.items():
            nbytes += fill_tensor_(targets[key], pieces, source)
            files.update(source.key_to_file[k] for k, _, _ in pieces)
            num_tensors += len(pieces)
        source.release()  # this module's pages leave the process
    return StageLoadReport(sorted(files), num_tensors, nbytes, peak_rss_mb())
