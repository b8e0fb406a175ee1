"""Mean next-token loss of a Hugging Face model directory on the first samples of a token file.

    python scripts/eval_hf.py --model work/demo/hf-export --data work/demo/train.jsonl [--samples 32]

Loads with LlamaForCausalLM.from_pretrained and AutoTokenizer.from_pretrained, as a user of the
exported model would.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoTokenizer, LlamaForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True, help="JSONL token file (input_ids per line, equal lengths)")
    p.add_argument("--samples", type=int, default=32, help="how many samples from the start of the file")
    args = p.parse_args()

    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with open(args.data) as f:
        rows = [json.loads(line)["input_ids"] for _, line in zip(range(args.samples), f)]
    with torch.no_grad():
        loss = model(input_ids=torch.tensor(rows), labels=torch.tensor(rows)).loss.item()
    print(f"{args.model}: loss {loss:.4f} on {len(rows)} samples "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, tokenizer vocab {len(tokenizer)})")


if __name__ == "__main__":
    main()
