"""Why a Hugging Face model directory cannot be loaded, with the command that fixes it: for the scripts
that load one as a user of an export would (scripts/generate.py, scripts/eval_hf.py)."""

from __future__ import annotations

import os

from safetensors import SafetensorError

# What from_pretrained raises on a missing, unconverted or damaged directory.
LOAD_ERRORS = (OSError, RuntimeError, EOFError, ValueError, SafetensorError)


class HFDirError(RuntimeError):
    """A Hugging Face model directory that cannot be loaded; the message says why and what fixes it."""


def load_model_and_tokenizer(path: str):
    """(the model in fp32, eval mode, through AutoModelForCausalLM; its tokenizer) from the directory
    ``path``, as a user of an export would load them; HFDirError with the reason otherwise."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problem = missing_dir_problem(path)
    if problem:
        raise HFDirError(problem)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return model, AutoTokenizer.from_pretrained(path)
    except LOAD_ERRORS as e:
        raise HFDirError(load_failure(path, e)) from None


def missing_dir_problem(path: str) -> str | None:
    """Checked before loading: transformers takes a path that is not a directory for a Hub model id
    and tries the network."""
    if os.path.isdir(path):
        return None
    what = "is not a directory" if os.path.exists(path) else "does not exist"
    return (
        f"--model {path} {what}: pass a Hugging Face model directory, e.g. one written by "
        f"`python convert2ckpt.py --to-hf --input CKPT_DIR --output HF_DIR`"
    )


def load_failure(path: str, error: BaseException) -> str:
    """Why the directory ``path`` could not be loaded as a Hugging Face model (``error``: what loading
    raised), with the command that fixes it where there is one: transformers' own errors name no
    fix, and for a damaged safetensors file no file. Weight files are checked from headers and sizes."""
    # Imported only on failure: it imports DeepSpeed (seconds, and a warning line) that a run never needs.
    from models.files.pipeline_dir import (
        HF_WEIGHT_NAMES,
        CheckpointError,
        first_line,
        hf_weight_files,
        is_pipeline_checkpoint,
        missing_shards,
        open_safetensors,
        torch_file_damage,
    )

    try:
        shards = missing_shards(path)  # transformers names one missing shard, and no fix
    except CheckpointError as e:
        return str(e)
    if shards:
        return shards
    files = hf_weight_files(path)
    if not files and is_pipeline_checkpoint(path):
        export = path.rstrip(os.sep) + "-hf"
        return (
            f"{path} is a pipeline checkpoint, not a Hugging Face model: export it with "
            f"`python convert2ckpt.py --to-hf --input {path} --output {export}`, then pass --model {export}"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"{path} has no config.json: not a Hugging Face model directory"
    if not files:
        return f"{path} has no weights: expected {HF_WEIGHT_NAMES}"
    for file in files:
        if file.endswith(".bin"):
            damage = torch_file_damage(file)
            if damage:
                return damage
            continue
        try:
            with open_safetensors(file):
                pass
        except CheckpointError as e:
            return str(e)
    if not any(os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer.model")):
        return (
            f"{path} has no tokenizer (tokenizer.json or tokenizer.model): copy the tokenizer files of the model "
            f"it came from into it"
        )
    return f"cannot load {path}: {first_line(error)}"
