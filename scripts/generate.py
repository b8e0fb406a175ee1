"""Generate text with a Hugging Face model directory (for example the one convert2ckpt.py --to-hf wrote).

    python scripts/generate.py --model work/demo/hf-export --prompt "The for statement" --max-new-tokens 40

Loads with LlamaForCausalLM.from_pretrained and AutoTokenizer.from_pretrained, as a user of the
exported model would, and calls LlamaForCausalLM.generate: sampled (top-k, fixed seed) by default,
greedy with --greedy. A directory that cannot be loaded (missing, a pipeline checkpoint, damaged
weights) ends in one line saying why and, where there is one, the command that fixes it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from safetensors import SafetensorError
from transformers import AutoTokenizer, LlamaForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_PROMPTS = ("The for statement", "A class definition", "Exceptions are")  # topics of the demo corpus


def missing_dir_problem(path: str) -> str | None:
    """Checked before loading: transformers takes a path that is not a directory for a Hub model id
    and tries the network."""
    if os.path.isdir(path):
        return None
    what = "is not a directory" if os.path.exists(path) else "does not exist"
    return (f"--model {path} {what}: pass a Hugging Face model directory, e.g. one written by "
            f"`python convert2ckpt.py --to-hf --input CKPT_DIR --output HF_DIR`")


def load_failure(path: str, error: BaseException) -> str:
    """Why the directory ``path`` could not be loaded as a Hugging Face model (``error``: what loading
    raised), with the command that fixes it where there is one: transformers' own errors name no
    fix, and for a damaged safetensors file no file. Weight files are checked from headers and sizes."""
    # Imported only on failure: it imports DeepSpeed (seconds, and a warning line) that a run never needs.
    sys.path.insert(0, REPO)
    from models.checkpoint import (HF_WEIGHT_NAMES, CheckpointError, first_line, hf_weight_files, is_pipeline_checkpoint,
                                   open_safetensors, torch_file_damage)

    files = hf_weight_files(path)
    if not files and is_pipeline_checkpoint(path):
        export = path.rstrip(os.sep) + "-hf"
        return (f"{path} is a pipeline checkpoint, not a Hugging Face model: export it with "
                f"`python convert2ckpt.py --to-hf --input {path} --output {export}`, then pass --model {export}")
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
        return (f"{path} has no tokenizer (tokenizer.json or tokenizer.model): copy the tokenizer files of the model "
                f"it came from into it")
    return f"cannot load {path}: {first_line(error)}"


def error(message: str) -> int:
    print(f"generate.py: error: {message}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--prompt", action="append", help="prompt (repeatable); default: three demo prompts")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--top-k", type=int, default=20, help="sample among the k most likely tokens")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--repetition-penalty", type=float, default=1.3, help="> 1 discourages loops in tiny models")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    problem = missing_dir_problem(args.model)
    if problem:
        return error(problem)
    try:
        model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(args.model)
    except (OSError, RuntimeError, EOFError, ValueError, SafetensorError) as e:  # what loading a damaged directory raises
        return error(load_failure(args.model, e))
    sampling = {} if args.greedy else dict(do_sample=True, top_k=args.top_k, temperature=args.temperature)
    for prompt in args.prompt or DEFAULT_PROMPTS:
        torch.manual_seed(args.seed)
        # <s> + prompt, as training saw every document start (the tokenizer may not add <s> itself)
        ids = torch.tensor([[tok.bos_token_id, *tok(prompt, add_special_tokens=False)["input_ids"]]])  # [1, prompt]
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             repetition_penalty=args.repetition_penalty, pad_token_id=tok.eos_token_id, **sampling)
        text = tok.decode(out[0], skip_special_tokens=True)  # out: [1, prompt + new tokens]
        print(f"[generate] prompt {prompt!r}:\n" + "\n".join("    | " + line for line in text.splitlines()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
