"""Hugging Face checkpoints <-> per-layer pipeline files, streamed: what convert2ckpt.py runs.

``hf_to_stages`` reads a Hugging Face directory (safetensors, sharded or not, or ``pytorch_model*.bin``
read tensors-only) one layer at a time (``HFTensorSource``) and writes DeepSpeed's pipeline layout;
``stages_to_hf`` writes a pipeline checkpoint back as sharded safetensors, one tensor at a time
(``write_safetensors``), so the whole model is never in memory. Output is written to
``<output>.tmp-<pid>`` and renamed at the end (``atomic_output``): a failed conversion leaves no output.
An output that is, contains or lies inside the input is refused; ``overwrite`` replaces only a
directory this tool wrote (it holds the ``.llama-pipe-output`` marker, ``OUTPUT_MARKER``).
The key mapping is the prefix of each spec in ``models.llama_pipe.spec_layout``.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import shutil
import struct
import time

import torch
from torch.utils.serialization import config as serialization_config
from transformers import PretrainedConfig

from models.families import UnsupportedModelError, family_of
from models.families import load_config as load_family_config
from models.family_deepseek_v3 import mtp_keys
from models.family_gpt_oss import dequantize_mxfp4, mxfp4_tensors
from models.files.hf_experts import EXPERTS_ON_DISK, assemble, disk_pieces
from models.files.pipeline_dir import (
    HF_WEIGHT_NAMES,
    LATEST_FILE,
    check_state_dict,
    copy_side_files,
    hf_weight_files,
    hf_weight_index,
    is_pipeline_checkpoint,
    load_layer_file,
    missing_shards,
    open_safetensors,
    read_tag,
    torch_file_damage,
    unpickling_refusal,
    unreadable_torch_file,
)
from models.host_memory import mapped_file_span
from models.llama_pipe import build_specs, expected_state_shapes, layer_file_name, spec_layout

# Tag of a freshly converted checkpoint: the weights before any training step (DeepSpeed's naming).
CONVERTED_TAG = "global_step0"
# DeepSpeed's engine.load_checkpoint needs one per-stage engine file next to the layer files.
# dp_world_size is read unconditionally; 'module': None makes it load only the layer files.
ENGINE_STUB_FILE = "mp_rank_00_model_states.pt"
# Keys old checkpoints carry that are not parameters: rotary inverse frequencies (recomputed from config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DEFAULT_MAX_SHARD = "2GB"  # shard size of exported safetensors (written one tensor at a time)
WRITE_CHUNK = 2**18  # bytes per write() call (see ChunkedWriter)
READ_CHUNK = 2**20  # bytes per pread() when copying a tensor's bytes out of its layer file (write_tensor)
# Written into every directory this tool creates: --overwrite replaces only a directory holding it, so
# it never deletes a model download, a training run or anything else it did not write itself.
OUTPUT_MARKER = ".llama-pipe-output"
TOOL = "convert2ckpt.py"  # the command line that runs this module: named in the marker and in messages
SHOWN_NAMES = 5  # names of added files listed when --overwrite is refused
PER_EXPERT_KEY = re.compile(r"\.experts\.\d+\.")  # one expert's tensor on disk (models/files/hf_experts.py)


class ConversionError(RuntimeError):
    """Input that cannot be converted, with every problem listed."""


def log(msg: str) -> None:
    print(f"[convert] {msg}", flush=True)


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1024' -> bytes (decimal units, like Hugging Face's max_shard_size)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    text = text.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def load_bin(path: str) -> dict[str, torch.Tensor]:
    """A ``pytorch_model*.bin`` state dict, tensors only.

    A ``.bin`` file is a Python pickle: unpickling it with ``weights_only=False`` can run any code it
    names. ``weights_only=True`` admits only tensors and plain containers, so a file holding anything
    else is refused before an object of it is built.
    """
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) torch.save format cannot be memory-mapped
            if torch_file_damage(path):  # empty or cut short: no format would read it
                raise
            log(f"{path}: legacy format, reading the whole file into memory")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ConversionError(
            f"{path} holds objects other than tensors (a pickle that could run code when loaded): refused "
            f"({unpickling_refusal(e)}). Convert from safetensors, or re-save the weights as safetensors "
            f"where the file's origin is trusted"
        ) from None
    except (RuntimeError, EOFError, OSError, KeyError, ValueError) as e:  # what torch.load raises on a damaged file
        raise ConversionError(unreadable_torch_file(path, e)) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConversionError(f"{path} is not a state dict of tensors")
    return state


class HFTensorSource:
    """The tensors of a Hugging Face checkpoint, read one at a time.

    Accepts ``model.safetensors``, sharded safetensors with ``model.safetensors.index.json``, or
    ``pytorch_model*.bin`` (read with ``weights_only=True`` and memory-mapped: never unpickled code).

    Files are memory-mapped (tensors are read straight from the page cache, no copy) only while
    ``get`` is being called for one layer: ``release()`` unmaps them. Pages of a mapping count in the
    process's RSS until it is unmapped, so holding every shard open made the peak RSS the size of
    the whole model (measured: 1786 MiB converting a 1426 MiB model); released per layer, it is one
    layer's size whatever the model or shard size.
    """

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._handles: dict[str, object] = {}  # open files: safe_open handle, or a mmap'd state dict for .bin
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.key_to_file: dict[str, str] = {}
        self._packed_file: dict[str, str] = {}  # an MXFP4 tensor's blocks and scales: their file
        shards = missing_shards(model_dir)  # else a deleted shard would show as its tensors missing
        if shards:
            raise ConversionError(shards)
        self.index = hf_weight_index(model_dir)  # (index file, {tensor: shard}) of a sharded directory, or None
        files = hf_weight_files(model_dir)
        if not files:
            hint = (
                " It is a pipeline checkpoint: to export it to Hugging Face, add --to-hf."
                if is_pipeline_checkpoint(model_dir)
                else ""
            )
            raise ConversionError(f"no weights in {model_dir}: expected {HF_WEIGHT_NAMES}.{hint}")
        self._bin = files[0].endswith(".bin")
        for path in files:
            if self._bin:
                state = load_bin(path)
                for key, t in state.items():
                    self.key_to_file[key] = path
                    self._shapes[key] = tuple(t.shape)
                del state
            else:
                with open_safetensors(path) as handle:
                    for key in handle.keys():
                        self.key_to_file[key] = path
                        self._shapes[key] = tuple(handle.get_slice(key).get_shape())
        # gpt-oss's MXFP4 experts: each blocks/scales pair shown as the tensor it stands for, read dequantized
        self.mxfp4 = mxfp4_tensors(self._shapes)
        for key, (blocks, scales, shape) in self.mxfp4.items():
            self.key_to_file[key], self._shapes[key] = self.key_to_file[blocks], shape
            for part in (blocks, scales):
                self._packed_file[part] = self.key_to_file.pop(part)
                del self._shapes[part]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def missing(self, key: str, shape: tuple) -> str:
        """The line for tensor ``key`` (expected of ``shape``) that no file holds, naming where it should be: the shard
        the index puts it in, or the one weight file."""
        line = f"missing tensor {key!r} (expected shape {tuple(shape)})"
        if self.index is not None and key in self.index[1]:
            index, weight_map = self.index
            return f"{line}: {os.path.basename(index)} puts it in {weight_map[key]}, which does not hold it"
        files = sorted(set(self.key_to_file.values()))
        if len(files) == 1:
            return f"{line} in {files[0]}"
        return line + (f" (not in {os.path.basename(self.index[0])} either)" if self.index is not None else "")

    def get(self, key: str) -> torch.Tensor:
        if key in self.mxfp4:
            blocks, scales, _ = self.mxfp4[key]
            return dequantize_mxfp4(self.get(blocks), self.get(scales))
        path = self.key_to_file.get(key) or self._packed_file[key]
        if path not in self._handles:
            self._handles[path] = load_bin(path) if self._bin else open_safetensors(path)
        handle = self._handles[path]
        if isinstance(handle, dict):
            # A .bin tensor may be a view of a larger shared storage: clone so torch.save writes only it.
            return handle[key].clone()
        return handle.get_tensor(key)  # a view of the mapped file: valid while the tensor lives

    def first_rows(self, key: str, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of tensor ``key``, read without the rest of it."""
        if self._bin or key in self.mxfp4:
            return self.get(key)[:rows]
        with open_safetensors(self.key_to_file[key]) as handle:
            return handle.get_slice(key)[:rows]

    def release(self) -> None:
        """Unmap every open file (once the tensors taken from it are no longer referenced)."""
        self._handles.clear()


class ChunkedWriter(io.RawIOBase):
    """A binary file that passes every write to the OS in pieces of at most ``WRITE_CHUNK`` bytes.

    Measured on the 2-core CPU machine (page cache, no fsync): one ``write()`` of a 12 MB tensor ran
    at 373 MB/s, the same bytes in 1 MiB writes at 3.7 GB/s; ``torch.save(obj, path)`` writes each
    tensor in one piece (344 MB/s), ``torch.save(obj, ChunkedWriter(f))`` ran at 2.6 GB/s. Writing
    from a memory-mapped layer file (the export), smaller pieces were faster still: 495 MB in
    0.20-0.24 s with 256 KiB writes, 0.25-0.30 s with 1 MiB, 0.34-0.50 s with 4 MiB (5 runs each).
    """

    def __init__(self, f):
        self.f = f

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITE_CHUNK):
            self.f.write(view[start : start + WRITE_CHUNK])
        return len(view)


def save_layer_file(state: dict[str, torch.Tensor], path: str) -> None:
    """``torch.save(state, path)``, written in chunks (see ChunkedWriter), without zip CRC-32s.

    torch.save's CRC-32 is one more pass over every byte: 0.61 s -> 0.43 s converting a 1426 MiB
    model (median of 4). Nothing reads it: torch.load (so DeepSpeed and the stage loader) never
    verifies it; a layer file with a flipped data byte loads silently either way. Only generic zip
    tools (``python -m zipfile -t``) would report these files' CRC fields as mismatches.
    """
    with open(path, "wb", buffering=0) as f, serialization_config.patch({"save.compute_crc32": False}):
        torch.save(state, ChunkedWriter(f))


def load_config(model_dir: str) -> PretrainedConfig:
    if not os.path.isdir(model_dir):
        raise ConversionError(
            f"--input {model_dir} {'is not a directory' if os.path.exists(model_dir) else 'does not exist'}"
        )
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{path} not found: --input must be a model directory with config.json")
    try:
        return load_family_config(model_dir)
    except UnsupportedModelError as e:
        raise ConversionError(str(e)) from None


_HF_SHAPES: dict[str, dict[int, dict[str, torch.Size]]] = {}  # expected_hf_shapes by config.json (its path aside)


def expected_hf_shapes(config: PretrainedConfig) -> dict[int, dict[str, torch.Size]]:
    """Per spec that owns a layer file: {hf_key: shape}, derived from the stage modules themselves
    (tests/test_families.py checks them against each family's own ``<Family>ForCausalLM``). Built once per
    architecture (``_HF_SHAPES``): a conversion and train.py's check of a Hugging Face directory ask more than once,
    and each build constructs every layer on the meta device (tens of ms for a tiny model)."""
    key = json.dumps({**config.to_dict(), "_name_or_path": None}, sort_keys=True, default=str)
    if key not in _HF_SHAPES:
        if len(_HF_SHAPES) >= 64:
            _HF_SHAPES.clear()
        specs = build_specs(config)
        _HF_SHAPES[key] = {
            info.index: {info.hf_prefix + k: s for k, s in expected_state_shapes(specs[info.index]).items()}
            for info in spec_layout(config)
            if info.owns_file
        }
    return {index: dict(shapes) for index, shapes in _HF_SHAPES[key].items()}  # a copy: callers may change theirs


def written_dtype(config: PretrainedConfig, hf_key: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a conversion asked for ``dtype`` writes tensor ``hf_key`` in: fp32 for the modules the family's
    model keeps in fp32 whatever it loads in (``_keep_in_fp32_modules_strict``: DeepSeek-V3's router bias, whose
    differences between experts a bf16 copy would round away), else ``dtype``."""
    kept = family_of(config).causal_lm._keep_in_fp32_modules_strict or ()
    return torch.float32 if any(name in hf_key.split(".") for name in kept) else dtype


def hf_differences(hf_dir: str, ckpt_dir: str, tag: str, config: PretrainedConfig, limit: int = 3) -> list[str]:
    """How a Hugging Face directory's weights differ from a pipeline checkpoint's (up to ``limit``): each
    tensor cast to its layer file's dtype, as the conversion casts it, and compared exactly. One layer
    at a time, both memory-mapped."""
    source = HFTensorSource(hf_dir)
    layout, problems = spec_layout(config), []
    for index, shapes in expected_hf_shapes(config).items():
        prefix = layout[index].hf_prefix
        state = load_layer_file(os.path.join(ckpt_dir, tag, layer_file_name(index)))
        for hf_key, shape in shapes.items():
            ours = state.get(hf_key[len(prefix) :])
            for disk_key, disk_shape, select in disk_pieces(config, hf_key, shape):
                if disk_key not in source.key_to_file or ours is None:
                    where = hf_dir if ours is not None else layer_file_name(index)
                    problems.append(f"{disk_key} is missing ({where})")
                elif source.shape(disk_key) != disk_shape or not torch.equal(
                    source.get(disk_key).to(ours.dtype), select(ours)
                ):
                    problems.append(f"{disk_key} differs from {os.path.join(ckpt_dir, tag, layer_file_name(index))}")
        del state
        source.release()
        if len(problems) >= limit:
            break
    return problems[:limit]


def converted_from(ckpt_dir: str) -> str | None:
    """The Hugging Face directory a checkpoint was converted from (its marker), while it still exists."""
    try:
        with open(os.path.join(ckpt_dir, OUTPUT_MARKER)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    source = record.get("input") if record.get("direction") == "hf-to-stages" else None
    return source if source and os.path.isfile(os.path.join(source, "config.json")) else None


def shown(path: str) -> str:
    """``path`` as the user wrote it, with where it really is when symbolic links lead elsewhere."""
    real = os.path.realpath(path)
    return path if real == os.path.abspath(path) else f"{path} (-> {real})"


def check_output(input_dir: str, output: str, overwrite: bool) -> None:
    """Refuse an ``output`` whose writing would destroy or change ``input_dir``, whatever ``overwrite``
    says, and an existing ``output`` that --overwrite may not replace (see ``not_replaceable``)."""
    src, dst = os.path.realpath(input_dir), os.path.realpath(output)  # symbolic links cannot hide the input
    common = os.path.commonpath([src, dst])
    if dst == src:
        raise ConversionError(
            f"--output {shown(output)} is the --input directory {shown(input_dir)}: the conversion "
            f"would replace what it reads. Choose another --output (refused even with --overwrite)"
        )
    if common == dst:
        raise ConversionError(
            f"--output {shown(output)} contains the --input {shown(input_dir)}: replacing it would "
            f"delete the input. Choose an --output outside it (refused even with --overwrite)"
        )
    if common == src:
        raise ConversionError(
            f"--output {shown(output)} is inside the --input {shown(input_dir)}: writing there would "
            f"change the input. Choose an --output outside it (refused even with --overwrite)"
        )
    if not os.path.lexists(output):
        return
    if not overwrite:
        raise ConversionError(f"{output} already exists: choose another --output or pass --overwrite")
    reason = not_replaceable(output)
    if reason:
        raise ConversionError(
            f"refusing to replace {output}: {reason}; --overwrite replaces only a directory that "
            f"{TOOL} wrote, as it wrote it. Remove {output} yourself or choose another --output"
        )


def not_replaceable(output: str) -> str | None:
    """Why --overwrite may not replace the existing ``output``; None for an empty directory, or one this
    tool wrote that holds nothing else since (a training run in it would be lost otherwise)."""
    if os.path.islink(output):
        return f"it is a symbolic link (to {os.path.realpath(output)})"
    if not os.path.isdir(output):
        return "it is a file, not a directory"
    names = set(os.listdir(output))
    if not names:
        return None
    if OUTPUT_MARKER not in names:
        return f"it was not written by {TOOL} (it has no {OUTPUT_MARKER} marker)"
    try:
        with open(os.path.join(output, OUTPUT_MARKER)) as f:
            marker = json.load(f)
        tool, written = marker["tool"], set(marker["files"])
    except (OSError, ValueError, TypeError, KeyError) as e:
        return f"its {OUTPUT_MARKER} marker is unreadable ({type(e).__name__}: {e})"
    if tool != TOOL:
        return f"it was not written by {TOOL} (its {OUTPUT_MARKER} marker names {tool!r})"
    added = sorted(names - written - {OUTPUT_MARKER})
    if added:
        more = f" and {len(added) - SHOWN_NAMES} more" if len(added) > SHOWN_NAMES else ""
        return f"files were added to it since {TOOL} wrote it: {', '.join(added[:SHOWN_NAMES])}{more}"
    return None


def write_marker(directory: str, input_dir: str, direction: str) -> None:
    """The marker of a directory this tool wrote: what it holds, so that later additions are not replaced."""
    record = {
        "tool": TOOL,
        "direction": direction,
        "input": os.path.realpath(input_dir),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": sorted(os.listdir(directory)),
    }
    with open(os.path.join(directory, OUTPUT_MARKER), "w") as f:
        json.dump(record, f, indent=2)


def atomic_output(input_dir: str, output: str, overwrite: bool, direction: str):
    """Context: yields a temporary directory that becomes ``output`` (with its marker) only if the body succeeds."""

    class _Atomic:
        def __enter__(self):
            check_output(input_dir, output, overwrite)  # again: ``output`` may have appeared since the start
            parent = os.path.dirname(os.path.abspath(output))
            os.makedirs(parent, exist_ok=True)
            self.tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(output))}.tmp-{os.getpid()}")
            shutil.rmtree(self.tmp, ignore_errors=True)
            os.makedirs(self.tmp)
            return self.tmp

        def __exit__(self, exc_type, exc, tb):
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return False
            write_marker(self.tmp, input_dir, direction)
            if os.path.exists(output):
                old = self.tmp + ".old"
                os.rename(output, old)
                os.rename(self.tmp, output)
                shutil.rmtree(old)
            else:
                os.rename(self.tmp, output)
            return False

    return _Atomic()


def hf_input_problems(config: PretrainedConfig, source: HFTensorSource) -> list[str]:
    """What the converter refuses in a Hugging Face directory's tensors (``source``, read from the headers only)
    against its config.json, one line each: a missing tensor, a wrong shape, an unexpected tensor. Also what
    train.py checks before it starts from such a directory (models/files/hf_stage.py)."""
    expected = expected_hf_shapes(config)
    want = {
        key: shape
        for shapes in expected.values()
        for k, s in shapes.items()
        for key, shape, _ in disk_pieces(config, k, s)
    }  # the tensors on disk
    problems = [source.missing(k, s) for k, s in want.items() if k not in source.key_to_file]
    problems += [
        f"tensor {k!r} has shape {source.shape(k)}, config.json implies {tuple(s)}"
        for k, s in want.items()
        if k in source.key_to_file and source.shape(k) != tuple(s)
    ]
    tied_head_key = "lm_head.weight" if config.tie_word_embeddings else None
    left_out = set(mtp_keys(config, source.key_to_file))  # DeepSeek-V3's prediction layers, not the model's
    problems += [
        f"unexpected tensor {k!r} (shape {source.shape(k)})"
        for k in source.key_to_file
        if k not in want and k != tied_head_key and not k.endswith(IGNORED_SUFFIXES) and k not in left_out
    ]
    problems += tied_head_problems(config, source, want)
    # The hint only where the file holds experts in another layout (fused, stacked): a deleted expert is just missing.
    other = [k for k in source.key_to_file if k not in want and ".experts." in k and not PER_EXPERT_KEY.search(k)]
    if other and config.model_type in EXPERTS_ON_DISK:
        more = f" and {len(other) - 1} more" if len(other) > 1 else ""
        problems.append(
            f"a {config.model_type} checkpoint stores one tensor per expert, as released and as save_pretrained "
            f"writes it (models/files/hf_experts.py); {other[0]!r}{more} in {source.key_to_file[other[0]]} hold the "
            "experts in another layout, which this converter does not read"
        )
    return problems


TIED_HEAD_ROWS = 64  # rows of a tied checkpoint's own LM head compared with the embedding's (a sample: both are large)


def tied_head_problems(config: PretrainedConfig, source: HFTensorSource, want: dict) -> list[str]:
    """A config.json with tie_word_embeddings true beside a file holding its own ``lm_head.weight`` that differs from
    the embedding: the head would be the embedding and the file's head dropped without a word (transformers loads it
    so too); save_pretrained writes no head for a tied model, so the file and its config disagree."""
    embed = next((k for k in want if k.endswith("embed_tokens.weight")), None)
    head = "lm_head.weight"
    if not config.tie_word_embeddings or embed is None or head not in source.key_to_file:
        return []
    if source.shape(head) == source.shape(embed) and torch.equal(
        source.first_rows(head, TIED_HEAD_ROWS), source.first_rows(embed, TIED_HEAD_ROWS)
    ):
        return []
    return [
        f"config.json sets tie_word_embeddings true, but {source.key_to_file[head]} holds its own {head!r}, which "
        f"differs from {embed!r}: the embedding would be the LM head and the file's head dropped; set "
        "tie_word_embeddings false there to train the file's head, or remove lm_head.weight from the file"
    ]


def hf_to_stages(input_dir: str, output: str, dtype: torch.dtype | None = None, overwrite: bool = False) -> None:
    """Hugging Face directory -> DeepSpeed pipeline layout (layer files, engine stub, ``latest``)."""
    check_output(input_dir, output, overwrite)  # before reading anything: a refusal costs no time
    config = load_config(input_dir)
    expected = expected_hf_shapes(config)
    source = HFTensorSource(input_dir)
    pieces = {k: disk_pieces(config, k, s) for shapes in expected.values() for k, s in shapes.items()}
    problems = hf_input_problems(config, source)
    if problems:
        raise ConversionError(f"{input_dir} does not match its config.json:\n  " + "\n  ".join(problems))
    if left_out := mtp_keys(config, source.key_to_file):
        log(
            f"left out: {len(left_out)} tensors of the multi-token-prediction layers (model.layers."
            f"{config.num_hidden_layers}.* on), which {family_of(config).causal_lm.__name__} does not load; an export "
            "will not hold them"
        )

    with atomic_output(input_dir, output, overwrite, "hf-to-stages") as tmp:
        tag_dir = os.path.join(tmp, CONVERTED_TAG)
        os.makedirs(tag_dir)
        layout = spec_layout(config)
        start, total_bytes = time.time(), 0
        for n, (index, shapes) in enumerate(expected.items(), 1):
            prefix = layout[index].hf_prefix
            state = {}
            for hf_key, shape in shapes.items():
                t = assemble(pieces[hf_key], shape, source.get)  # the tensor itself, or an expert stack
                state[hf_key[len(prefix) :]] = t if dtype is None else t.to(written_dtype(config, hf_key, dtype))
                del t
            save_layer_file(state, os.path.join(tag_dir, layer_file_name(index)))
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            total_bytes += nbytes
            log(
                f"{n}/{len(expected)} {layer_file_name(index)} <- {prefix}* "
                f"({len(state)} tensors, {nbytes / 2**20:.1f} MiB, {time.time() - start:.1f}s)"
            )
            del state
            source.release()  # this layer's pages leave the process (see HFTensorSource)
        torch.save({"module": None, "dp_world_size": 1}, os.path.join(tag_dir, ENGINE_STUB_FILE))
        with open(os.path.join(tmp, LATEST_FILE), "w") as f:
            f.write(CONVERTED_TAG)  # DeepSpeed writes the tag without a newline
        copy_side_files(input_dir, tmp, dtype)
    log(f"wrote {output} ({total_bytes / 2**20:.1f} MiB in {time.time() - start:.1f}s, tag {CONVERTED_TAG})")


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(path: str, entries: list[tuple], metadata: dict[str, str]) -> None:
    """A safetensors file written one tensor at a time.

    ``entries``: (key, dtype, shape, nbytes, get) in file order; ``get()`` returns the tensor, which
    is written and dropped before the next is fetched. The header (offsets from the shapes) comes
    first, so only one tensor is ever in memory, instead of the whole shard ``save_file`` needs
    (measured: 1769 MiB peak RSS exporting a 1426 MiB model as one 2 GB shard). The layout is
    safetensors' own: an 8-byte little-endian header length, the JSON header padded with spaces to
    a multiple of 8, then the tensors' bytes back to back in header order.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for key, dtype, shape, nbytes, _ in entries:
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb", buffering=0) as f:
        out = ChunkedWriter(f)
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for key, dtype, shape, nbytes, get in entries:
            t = get().contiguous()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.numel() * t.element_size() != nbytes:
                raise ConversionError(f"{key}: got {t.dtype} {tuple(t.shape)}, planned {dtype} {tuple(shape)}")
            if nbytes:
                write_tensor(out, t)
            del t


def write_tensor(out: ChunkedWriter, t: torch.Tensor) -> None:
    """The bytes of contiguous ``t`` to ``out``: read from its file with ``pread`` when ``t`` is a view of a
    memory-mapped file (as fast as a raw copy, see ``mapped_file_span``), else from memory."""
    data = t.reshape(-1).view(torch.uint8)  # (nbytes,) view of t's bytes
    nbytes = data.numel()
    span = mapped_file_span(t)
    if span is None:
        out.write(data.numpy())
        return
    path, offset = span
    buf = memoryview(bytearray(min(READ_CHUNK, nbytes)))
    with open(path, "rb", buffering=0) as f:
        for start in range(0, nbytes, READ_CHUNK):
            piece = buf[: min(READ_CHUNK, nbytes - start)]
            got = 0
            while got < len(piece):
                n = os.preadv(f.fileno(), [piece[got:]], offset + start + got)
                if n == 0:
                    raise ConversionError(f"{path}: ended at byte {offset + start + got}, inside a tensor")
                got += n
            # The mapping and the file must agree; checked on the first bytes before anything is written.
            if start == 0 and bytes(piece[:64]) != data[:64].numpy().tobytes():
                out.write(data.numpy())
                return
            out.write(piece)


def stages_to_hf(
    input_dir: str,
    output: str,
    tag: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD,
    overwrite: bool = False,
) -> None:
    """Pipeline checkpoint (converted, or saved by train.py) -> sharded safetensors + index."""
    check_output(input_dir, output, overwrite)
    config = load_config(input_dir)
    tag = read_tag(input_dir, tag)
    tag_dir = os.path.join(input_dir, tag)
    expected = expected_hf_shapes(config)
    layout = spec_layout(config)

    # Plan shards from the layer files' shapes; layer files are memory-mapped, not read.
    problems, plan = [], []  # plan: (spec index, hf_key, nbytes, dtype, shape) in model order
    for index, shapes in expected.items():
        path = os.path.join(tag_dir, layer_file_name(index))
        if not os.path.isfile(path):
            problems.append(f"missing layer file {path}")
            continue
        prefix = layout[index].hf_prefix
        state = load_layer_file(path)
        local_expected = {k[len(prefix) :]: s for k, s in shapes.items()}
        found = check_state_dict(path, state, local_expected)
        problems += found
        if not found:
            for local_key, t in state.items():
                out_dtype = t.dtype if dtype is None else written_dtype(config, prefix + local_key, dtype)
                itemsize = torch.empty((), dtype=out_dtype).element_size()
                for disk_key, shape, select in disk_pieces(config, prefix + local_key, tuple(t.shape)):
                    nbytes = math.prod(shape) * itemsize
                    plan.append((index, prefix + local_key, nbytes, out_dtype, shape, disk_key, select))
        del state
    if problems:
        raise ConversionError(f"{input_dir} (tag {tag}) does not match its config.json:\n  " + "\n  ".join(problems))

    limit = parse_size(max_shard_size)
    shards: list[list[tuple]] = [[]]
    shard_bytes = 0
    for item in plan:
        if shards[-1] and shard_bytes + item[2] > limit:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(item)
        shard_bytes += item[2]

    start, weight_map, total = time.time(), {}, 0
    with atomic_output(input_dir, output, overwrite, "stages-to-hf") as tmp:
        cache: dict[int, dict[str, torch.Tensor]] = {}  # the one layer file (memory-mapped) being read

        def tensor(index: int, hf_key: str, select) -> torch.Tensor:
            nonlocal cache
            if index not in cache:
                cache = {}  # unmaps the previous layer file before mapping the next
                cache = {index: load_layer_file(os.path.join(tag_dir, layer_file_name(index)))}
            t = select(cache[index][hf_key[len(layout[index].hf_prefix) :]])  # one expert's rows of a stack
            return t if dtype is None else t.to(written_dtype(config, hf_key, dtype))

        for n, shard in enumerate(shards, 1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            entries = [
                (disk_key, out_dtype, shape, nbytes, lambda i=index, k=hf_key, f=select: tensor(i, k, f))
                for index, hf_key, nbytes, out_dtype, shape, disk_key, select in shard
            ]
            write_safetensors(os.path.join(tmp, name), entries, metadata={"format": "pt"})
            for *_, nbytes, _, _, disk_key, _ in shard:
                weight_map[disk_key] = name
                total += nbytes
            log(f"{n}/{len(shards)} {name} ({len(shard)} tensors, {time.time() - start:.1f}s)")
        cache = {}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        copy_side_files(input_dir, tmp, dtype)
    log(f"wrote {output} ({total / 2**20:.1f} MiB in {len(shards)} shard(s), {time.time() - start:.1f}s, tag {tag})")
