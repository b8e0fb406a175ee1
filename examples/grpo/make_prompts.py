"""Write the GRPO example's prompts: JSONL, one {"prompt": text} per line (data=grpo reads it).

python examples/grpo/make_prompts.py --output work/grpo/prompts.jsonl [--count 64]
"""

from __future__ import annotations

import argparse
import json
import os

WORDS = ["apple", "river", "stone", "green", "light", "music", "table", "cloud"]


def prompts(count: int) -> list[dict]:
    """``count`` short prompts, each a different pair of words."""
    return [{"prompt": f"Tell me about the {WORDS[i % 8]} by the {WORDS[i // 8 % 8]}"} for i in range(count)]


def write_prompts(path: str, count: int) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in prompts(count))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--count", type=int, default=64, help="prompts")
    args = p.parse_args()
    write_prompts(args.output, args.count)
    print(f"[grpo] wrote {args.count} prompts to {args.output}")


if __name__ == "__main__":
    main()
