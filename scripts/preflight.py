"""Check a training command before booking the cluster: the same config validation train.py runs,
for a given world size, then the layout and the planner's per-GPU memory estimate for it, with the
pipeline schedule's bubble (pipeline_schedule=dualpipev: its activations against 1F1B's).

    python scripts/preflight.py --world-size 16 model_name_or_path=CKPT_DIR num_stages=8 ds=zero1_offload \\
        micro_batch_size=1 gradient_accumulation_steps=16 data.train_file=train.jsonl data.max_seq_length=4096

Arguments after the options are train.py's Hydra overrides, unchanged. Exits 1 with train.py's error
message when the config is invalid. Nothing is started: no process group, no model, no tokenizing (with
num_epochs, already tokenized data is counted for the steps the run will take).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training.observation.logs import argv_log_level, quiet_dependencies  # noqa: E402

# as train.py does, before DeepSpeed is imported (training/observation/logs.py)
quiet_dependencies(argv_log_level(sys.argv))

from parallel.layout import count_arg  # noqa: E402
from training.configuration.preflight import check  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--world-size", type=count_arg(1), required=True, help="ranks the job will launch (nodes x GPUs per node)"
    )
    p.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    args = p.parse_args(argv)
    try:
        lines = check(args.world_size, args.overrides)
    except ValueError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
