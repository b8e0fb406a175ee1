"""Build the tiny debug Llama (Hugging Face format) and a raw-text training corpus, offline.

python scripts/make_tiny_model.py --output work/tiny-hf --data work/corpus.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.observation.logs import quiet_dependencies  # noqa: E402

quiet_dependencies("warning")  # the known-harmless lines of its dependencies filtered, as train.py does

from models.tiny import save_random_model, tiny_config, train_tokenizer, write_text_corpus  # noqa: E402
from parallel.layout import count_arg  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="Hugging Face model directory to write")
    p.add_argument("--data", required=True, help='JSONL text corpus to write ({"text": ...} per document)')
    p.add_argument("--layers", type=count_arg(1), default=4, help="decoder layers")
    p.add_argument("--seed", type=int, default=0, help="weight init seed")
    args = p.parse_args()

    config = tiny_config(num_hidden_layers=args.layers)
    train_tokenizer(args.output, config.vocab_size)
    save_random_model(config, args.output, seed=args.seed)
    n = write_text_corpus(args.data)
    print(
        f"[tiny] wrote {args.output} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}) and {args.data} ({n} documents)"
    )


if __name__ == "__main__":
    main()
