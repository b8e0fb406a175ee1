"""Generate text with a Hugging Face model directory (for example the one convert2ckpt.py --to-hf wrote).

    python scripts/generate.py --model work/demo/hf-export --prompt "The for statement" --max-new-tokens 40

Loads with AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained, as a user of the
exported model would, and calls its generate: sampled (top-k, fixed seed) by default,
greedy with --greedy. A directory that cannot be loaded (missing, a pipeline checkpoint, damaged
weights) ends in one line saying why and, where there is one, the command that fixes it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from training.observation.logs import quiet_dependencies  # noqa: E402

quiet_dependencies("warning")  # the known-harmless lines of its dependencies filtered, as train.py does

import torch  # noqa: E402

from models.files.hf_dir_checks import HFDirError, load_model_and_tokenizer  # noqa: E402
from parallel.layout import count_arg  # noqa: E402

DEFAULT_PROMPTS = ("The for statement", "A class definition", "Exceptions are")  # topics of the demo corpus


def error(message: str) -> int:
    print(f"generate.py: error: {message}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--prompt", action="append", help="prompt (repeatable); default: three demo prompts")
    p.add_argument("--max-new-tokens", type=count_arg(1), default=40)
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--top-k", type=count_arg(1), default=20, help="sample among the k most likely tokens")
    p.add_argument(
        "--temperature", type=count_arg(0, float, strict=True, maximum=100), default=0.7, help="sampling temperature"
    )
    p.add_argument(
        "--repetition-penalty",
        type=count_arg(0, float, strict=True, maximum=10),
        default=1.3,
        help="> 1 discourages loops in tiny models",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    try:
        model, tok = load_model_and_tokenizer(args.model)
    except HFDirError as e:
        return error(str(e))
    sampling = {} if args.greedy else dict(do_sample=True, top_k=args.top_k, temperature=args.temperature)
    for prompt in args.prompt or DEFAULT_PROMPTS:
        torch.manual_seed(args.seed)
        # <s> + prompt, as training saw every document start (the tokenizer may not add <s> itself)
        ids = torch.tensor([[tok.bos_token_id, *tok(prompt, add_special_tokens=False)["input_ids"]]])  # [1, prompt]
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_new_tokens,
            repetition_penalty=args.repetition_penalty,
            pad_token_id=tok.eos_token_id,
            **sampling,
        )
        text = tok.decode(out[0], skip_special_tokens=True)  # out: [1, prompt + new tokens]
        print(f"[generate] prompt {prompt!r}:\n" + "\n".join("    | " + line for line in text.splitlines()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
