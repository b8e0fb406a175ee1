"""Tokenize a training set once, before the job, with N worker processes (the work: data/prepare.py).

    python scripts/prepare_data.py --workers 16 --output /data/prepared/corpus-4k \\
        model_name_or_path=CKPT_DIR data=text data.train_file='/data/corpus/*.parquet' data.max_seq_length=4096

Arguments after the options are train.py's Hydra overrides (the model, for its tokenizer and vocabulary, and
the data.* settings): the output holds the rows train.py would tokenize, in shards, with the settings and the
tokenizer's SHA-256. Then train with data.train_file=OUTPUT (the same overrides): the job starts without
tokenizing, and refuses the directory if its settings or tokenizer differ. --split eval prepares data.eval_file.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.observation.logs import quiet_dependencies  # noqa: E402

quiet_dependencies("warning")

from data.checks import data_problems  # noqa: E402
from data.prepare import prepare  # noqa: E402
from data.sources import DataError  # noqa: E402
from data.tokenize_settings import data_settings, tokenizer_dir  # noqa: E402
from parallel.layout import count_arg  # noqa: E402
from training.configuration.model_source import resolve_model  # noqa: E402
from training.configuration.preflight import composed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="the prepared directory to write (must not exist)")
    p.add_argument("--workers", type=count_arg(1), default=os.cpu_count() or 1, help="tokenizing processes")
    p.add_argument("--split", choices=("train", "eval"), default="train", help="data.train_file or data.eval_file")
    p.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    args = p.parse_args(argv)
    try:
        cfg = composed(args.overrides)
        model_config, problems = resolve_model(cfg)
        problems += data_problems(cfg)
        source = cfg.data.train_file if args.split == "train" else cfg.data.eval_file
        if cfg.data.sources or cfg.data.eval_sources:
            problems.append(
                "a mixture is prepared one source at a time: run this once per source with data.train_file=PATH "
                "(and its format), then list the prepared directories in data.sources / data.eval_sources"
            )
        elif args.split == "eval" and not source:
            problems.append("--split eval prepares data.eval_file, which is not set")
        if problems:
            raise ValueError("\n  ".join(["the overrides cannot be prepared for:", *problems]))
        meta = prepare(source, data_settings(cfg, model_config), tokenizer_dir(cfg), args.output, args.workers)
    except (ValueError, DataError) as e:
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        return 1
    print(
        f"prepared {args.output}: {meta['num_samples']} samples of {meta['seq_len']} tokens in {len(meta['shards'])} "
        f"shards, {meta['tokens']} tokens, {meta['build_s']:.1f} s ({meta['tokens_per_s']:,} tokens/s, "
        f"{args.workers} workers); train with data.train_file={args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
