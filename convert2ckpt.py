"""Convert a Hugging Face Llama checkpoint to per-layer pipeline files, and back.

    python convert2ckpt.py --input HF_DIR --output CKPT_DIR [--dtype bf16|fp16|fp32]
    python convert2ckpt.py --to-hf --input CKPT_DIR [--tag TAG] --output HF_DIR [--dtype ...]

Tensors are read and written one layer at a time, so the whole model is never in memory. Output is
written to ``<output>.tmp-<pid>`` and renamed at the end: a failed conversion leaves no output.
The key mapping is the prefix of each spec in ``models.llama_pipe.spec_layout``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time
from contextlib import ExitStack

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig

from models.checkpoint import (
    LATEST_FILE,
    CheckpointError,
    check_state_dict,
    copy_side_files,
    load_layer_file,
    read_tag,
)
from models.llama_pipe import build_specs, expected_state_shapes, layer_file_name, spec_layout

# Tag of a freshly converted checkpoint: the weights before any training step (DeepSpeed's naming).
CONVERTED_TAG = "global_step0"
# DeepSpeed's engine.load_checkpoint needs one per-stage engine file next to the layer files.
# dp_world_size is read unconditionally; 'module': None makes it load only the layer files.
ENGINE_STUB_FILE = "mp_rank_00_model_states.pt"
# Keys old checkpoints carry that are not parameters: rotary inverse frequencies (recomputed from config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MAX_SHARD = "2GB"  # shard size of exported safetensors; a shard is held in memory while written


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


class HFTensorSource:
    """The tensors of a Hugging Face checkpoint, read one at a time.

    Accepts ``model.safetensors``, sharded safetensors with ``model.safetensors.index.json``, or
    ``pytorch_model*.bin`` (read with ``weights_only=True`` and memory-mapped: never unpickled code).
    """

    def __init__(self, model_dir: str, stack: ExitStack):
        self.model_dir = model_dir
        self._handles: dict[str, object] = {}  # file -> safe_open handle, or a mmap'd state dict for .bin
        self.key_to_file: dict[str, str] = {}
        st_files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        bin_files = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
        if st_files:
            for path in st_files:
                handle = stack.enter_context(safe_open(path, framework="pt"))
                self._handles[path] = handle
                for key in handle.keys():
                    self.key_to_file[key] = path
        elif bin_files:
            for path in bin_files:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # legacy (non-zip) torch.save format cannot be memory-mapped
                    log(f"{path}: legacy format, reading the whole file into memory")
                    state = torch.load(path, map_location="cpu", weights_only=True)
                self._handles[path] = state
                for key in state:
                    self.key_to_file[key] = path
        else:
            raise ConversionError(
                f"no weights in {model_dir}: expected model.safetensors, model-*.safetensors or pytorch_model*.bin"
            )

    def shape(self, key: str) -> tuple[int, ...]:
        handle = self._handles[self.key_to_file[key]]
        if isinstance(handle, dict):
            return tuple(handle[key].shape)
        return tuple(handle.get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        handle = self._handles[self.key_to_file[key]]
        if isinstance(handle, dict):
            # A .bin tensor may be a view of a larger shared storage: clone so torch.save writes only it.
            return handle[key].clone()
        return handle.get_tensor(key)


def load_config(model_dir: str) -> LlamaConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{path} not found: --input must be a model directory with config.json")
    config = LlamaConfig.from_pretrained(model_dir)
    if config.model_type != "llama":
        raise ConversionError(f"{path}: model_type {config.model_type!r} is not 'llama'")
    return config


def expected_hf_shapes(config: LlamaConfig) -> dict[int, dict[str, torch.Size]]:
    """Per spec that owns a layer file: {hf_key: shape}, derived from the stage modules themselves."""
    specs = build_specs(config)
    out = {}
    for info in spec_layout(config):
        if info.owns_file:
            local = expected_state_shapes(specs[info.index])
            out[info.index] = {info.hf_prefix + k: s for k, s in local.items()}
    return out


def atomic_output(output: str, overwrite: bool):
    """Context: yields a temporary directory that becomes ``output`` only if the body succeeds."""

    class _Atomic:
        def __enter__(self):
            if os.path.exists(output) and not overwrite:
                raise ConversionError(f"{output} already exists: choose another --output or pass --overwrite")
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
            if os.path.exists(output):
                old = self.tmp + ".old"
                os.rename(output, old)
                os.rename(self.tmp, output)
                shutil.rmtree(old)
            else:
                os.rename(self.tmp, output)
            return False

    return _Atomic()


def hf_to_stages(input_dir: str, output: str, dtype: torch.dtype | None = None, overwrite: bool = False) -> None:
    """Hugging Face directory -> DeepSpeed pipeline layout (layer files, engine stub, ``latest``)."""
    config = load_config(input_dir)
    expected = expected_hf_shapes(config)
    with ExitStack() as stack:
        source = HFTensorSource(input_dir, stack)
        want = {k: s for shapes in expected.values() for k, s in shapes.items()}
        problems = [
            f"missing tensor {k!r} (expected shape {tuple(s)})" for k, s in want.items() if k not in source.key_to_file
        ]
        problems += [
            f"tensor {k!r} has shape {source.shape(k)}, config.json implies {tuple(s)}"
            for k, s in want.items()
            if k in source.key_to_file and source.shape(k) != tuple(s)
        ]
        tied_head_key = "lm_head.weight" if config.tie_word_embeddings else None
        problems += [
            f"unexpected tensor {k!r} (shape {source.shape(k)})"
            for k in source.key_to_file
            if k not in want and k != tied_head_key and not k.endswith(IGNORED_SUFFIXES)
        ]
        if problems:
            raise ConversionError(f"{input_dir} does not match its config.json:\n  " + "\n  ".join(problems))

        with atomic_output(output, overwrite) as tmp:
            tag_dir = os.path.join(tmp, CONVERTED_TAG)
            os.makedirs(tag_dir)
            layout = spec_layout(config)
            start, total_bytes = time.time(), 0
            for n, (index, shapes) in enumerate(expected.items(), 1):
                prefix = layout[index].hf_prefix
                state = {}
                for hf_key in shapes:
                    t = source.get(hf_key)
                    state[hf_key[len(prefix):]] = t if dtype is None else t.to(dtype)
                torch.save(state, os.path.join(tag_dir, layer_file_name(index)))
                nbytes = sum(t.numel() * t.element_size() for t in state.values())
                total_bytes += nbytes
                log(f"{n}/{len(expected)} {layer_file_name(index)} <- {prefix}* "
                    f"({len(state)} tensors, {nbytes / 2**20:.1f} MiB, {time.time() - start:.1f}s)")
                del state
            torch.save({"module": None, "dp_world_size": 1}, os.path.join(tag_dir, ENGINE_STUB_FILE))
            with open(os.path.join(tmp, LATEST_FILE), "w") as f:
                f.write(CONVERTED_TAG)  # DeepSpeed writes the tag without a newline
            copy_side_files(input_dir, tmp, dtype)
    log(f"wrote {output} ({total_bytes / 2**20:.1f} MiB in {time.time() - start:.1f}s, tag {CONVERTED_TAG})")


def stages_to_hf(
    input_dir: str,
    output: str,
    tag: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD,
    overwrite: bool = False,
) -> None:
    """Pipeline checkpoint (converted, or saved by train.py) -> sharded safetensors + index."""
    config = load_config(input_dir)
    tag = read_tag(input_dir, tag)
    tag_dir = os.path.join(input_dir, tag)
    expected = expected_hf_shapes(config)
    layout = spec_layout(config)

    # Plan shards from the layer files' shapes; layer files are memory-mapped, not read.
    problems, plan = [], []  # plan: (spec index, hf_key, nbytes) in model order
    for index, shapes in expected.items():
        path = os.path.join(tag_dir, layer_file_name(index))
        if not os.path.isfile(path):
            problems.append(f"missing layer file {path}")
            continue
        prefix = layout[index].hf_prefix
        state = load_layer_file(path)
        local_expected = {k[len(prefix):]: s for k, s in shapes.items()}
        found = check_state_dict(path, state, local_expected)
        problems += found
        if not found:
            for local_key, t in state.items():
                itemsize = t.element_size() if dtype is None else torch.finfo(dtype).bits // 8
                plan.append((index, prefix + local_key, t.numel() * itemsize))
        del state
    if problems:
        raise ConversionError(f"{input_dir} (tag {tag}) does not match its config.json:\n  " + "\n  ".join(problems))

    limit = parse_size(max_shard_size)
    shards: list[list[tuple[int, str, int]]] = [[]]
    shard_bytes = 0
    for item in plan:
        if shards[-1] and shard_bytes + item[2] > limit:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(item)
        shard_bytes += item[2]

    start, weight_map, total = time.time(), {}, 0
    with atomic_output(output, overwrite) as tmp:
        cache: dict[int, dict[str, torch.Tensor]] = {}  # open layer files of the shard being written
        for n, shard in enumerate(shards, 1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for index, hf_key, nbytes in shard:
                if index not in cache:
                    cache = {index: load_layer_file(os.path.join(tag_dir, layer_file_name(index)))}
                t = cache[index][hf_key[len(layout[index].hf_prefix):]]
                tensors[hf_key] = (t if dtype is None else t.to(dtype)).contiguous()
                weight_map[hf_key] = name
                total += nbytes
            save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
            log(f"{n}/{len(shards)} {name} ({len(tensors)} tensors, {time.time() - start:.1f}s)")
            del tensors
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        copy_side_files(input_dir, tmp, dtype)
    log(f"wrote {output} ({total / 2**20:.1f} MiB in {len(shards)} shard(s), {time.time() - start:.1f}s, tag {tag})")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="Hugging Face model dir, or a pipeline checkpoint dir with --to-hf")
    p.add_argument("--output", required=True, help="directory to create (must not exist unless --overwrite)")
    p.add_argument("--to-hf", action="store_true", help="pipeline checkpoint -> Hugging Face safetensors")
    p.add_argument("--tag", default=None, help="with --to-hf: checkpoint tag to export (default: the one in 'latest')")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: keep each tensor's dtype)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, help="with --to-hf: largest safetensors shard")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists (only once conversion succeeded)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if args.to_hf:
            stages_to_hf(args.input, args.output, args.tag, dtype, args.max_shard_size, args.overwrite)
        else:
            if args.tag is not None:
                raise ConversionError("--tag applies only with --to-hf")
            hf_to_stages(args.input, args.output, dtype, args.overwrite)
    except (ConversionError, CheckpointError, OSError) as e:
        print(f"convert2ckpt.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
