"""Mean next-token loss of a Hugging Face model directory on the first documents of a text corpus.

    python scripts/eval_hf.py --model work/demo/hf-export --data work/demo/corpus.jsonl [--docs 16 --seq-len 128]

Loads with AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained, as a user of the
exported model would, and scores each document as <s> text </s> truncated to --seq-len tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from training.observation.logs import quiet_dependencies  # noqa: E402

quiet_dependencies("warning")  # the known-harmless lines of its dependencies filtered, as train.py does

import torch  # noqa: E402

from models.files.hf_dir_checks import HFDirError, load_model_and_tokenizer  # noqa: E402
from parallel.layout import count_arg  # noqa: E402


def error(message: str) -> int:
    print(f"eval_hf.py: error: {message}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True, help='JSONL corpus, {"text": ...} per line')
    p.add_argument("--docs", type=count_arg(1), default=16, help="how many documents from the start of the file")
    p.add_argument("--seq-len", type=count_arg(2), default=128, help="tokens scored per document (2 or more)")
    args = p.parse_args(argv)

    try:
        model, tok = load_model_and_tokenizer(args.model)
    except HFDirError as e:
        return error(str(e))
    try:
        with open(args.data) as f:
            texts = [json.loads(line)["text"] for _, line in zip(range(args.docs), f)]
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = e.strerror if isinstance(e, OSError) else 'not JSONL with a "text" field per line'
        return error(f"--data {args.data}: {what}")
    if not texts:
        return error(f"--data {args.data} holds no documents")
    losses = []
    with torch.no_grad():
        for text in texts:
            ids = [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id][
                : args.seq_len
            ]
            x = torch.tensor([ids])
            losses.append(model(input_ids=x, labels=x).loss.item())
    print(
        f"{args.model}: mean loss {sum(losses) / len(losses):.4f} over {len(losses)} documents "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, tokenizer vocab {len(tok)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
