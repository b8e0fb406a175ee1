"""Stress runs of train.py on 4 CPU ranks (pipe 2 x data 2, a tiny Llama): clean exits and flat memory.

    python tools/stress.py                     # both parts below
    python tools/stress.py --repeats 5 --steps 0   # only 5 short runs
    python tools/stress.py --repeats 0         # only the long run

1. ``--repeats`` short runs (default 20; ``--repeat-steps`` steps each, a checkpoint at the end):
   counts non-zero exits (every rank must leave its process group and exit 0; DeepSpeed on CPU once
   aborted at exit about 1 run in 60) and /dev/shm segments left behind.
2. One long run of ``--steps`` steps (default 500) with a checkpoint every ``--save-steps`` (50) and
   ``--save-total-limit`` (3): per-rank RSS at each save (train.py's "saved checkpoint" line) must
   stay flat, and exactly ``--save-total-limit`` checkpoints must be left.

Everything is written under ``--work`` (default ``work/stress``); a summary is printed and saved
to ``<work>/results.json``. Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from training.observation.logs import quiet_dependencies  # noqa: E402

quiet_dependencies("warning")  # the known-harmless lines of its dependencies filtered, as train.py does

from tools.launch import deepspeed_command, remove_shm_leftovers  # noqa: E402
from training.checkpoints.save_restore import SAVED_LINE  # noqa: E402
from training.resilience.ports import free_port  # noqa: E402


def prepare(work: str) -> tuple[str, str]:
    """A tiny converted Llama (4 layers, hidden 64, vocab 512) and 64 random 16-token samples."""
    import random

    ckpt, data = os.path.join(work, "ckpt"), os.path.join(work, "train.jsonl")
    if not os.path.isdir(ckpt):
        from models.files.hf_convert import hf_to_stages
        from models.tiny import save_random_model, tiny_config, train_tokenizer

        hf = os.path.join(work, "hf")
        save_random_model(tiny_config(), hf, seed=0)
        train_tokenizer(hf, vocab_size=512)
        hf_to_stages(hf, ckpt)
    if not os.path.isfile(data):
        rng = random.Random(0)
        with open(data, "w") as f:
            for _ in range(64):
                f.write(json.dumps({"input_ids": [rng.randrange(3, 512) for _ in range(16)]}) + "\n")
    return ckpt, data


def run(work: str, name: str, ckpt: str, data: str, steps: int, save_steps: int, save_total_limit: int) -> dict:
    """One 4-rank train.py job in a fresh output_dir; its log goes to ``<work>/<name>.log``."""
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    port = free_port()
    train_args = [
        f"model_name_or_path={ckpt}",
        f"data.train_file={data}",
        "data.max_seq_length=16",
        f"data.cache_dir={os.path.join(work, 'cache')}",
        "num_stages=2",
        "micro_batch_size=1",
        "gradient_accumulation_steps=2",
        "precision=fp32",
        "ds=zero1",
        f"max_steps={steps}",
        f"save_steps={save_steps}",
        f"save_total_limit={save_total_limit}",
        "log_steps=50",
        f"output_dir={out}",
    ]
    cmd = deepspeed_command(4, "train.py", train_args, port=port)
    start = time.time()
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
    )
    seconds = time.time() - start
    with open(os.path.join(work, f"{name}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    leftovers = remove_shm_leftovers(port)
    saves = {
        int(m.group(1)): {"rss_mib": [int(x) for x in m.group(2).split(", ")], "peak_rank0_mib": int(m.group(3))}
        for m in SAVED_LINE.finditer(proc.stdout)
    }
    tags = (
        sorted((t for t in os.listdir(out) if t.startswith("global_step")), key=lambda t: int(t[11:]))
        if os.path.isdir(out)
        else []
    )
    return {
        "name": name,
        "returncode": proc.returncode,
        "seconds": round(seconds, 1),
        "shm_left": len(leftovers),
        "saves": saves,
        "checkpoints": tags,
        "aborted_at_exit": "terminate called" in proc.stderr,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20, help="short runs to repeat (0: none)")
    p.add_argument("--repeat-steps", type=int, default=4, help="steps of each short run")
    p.add_argument("--steps", type=int, default=500, help="steps of the long run (0: no long run)")
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--save-total-limit", type=int, default=3)
    p.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=20.0,
        help="allowed growth of any rank's RSS between the first and the last save of the long run",
    )
    p.add_argument("--work", default=os.path.join(REPO, "work", "stress"))
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    ckpt, data = prepare(args.work)
    results, ok = {}, True

    if args.repeats:
        runs = []
        for i in range(args.repeats):
            r = run(args.work, "repeat", ckpt, data, args.repeat_steps, 0, 0)
            runs.append({k: r[k] for k in ("returncode", "seconds", "shm_left", "aborted_at_exit")})
            print(
                f"repeat {i + 1}/{args.repeats}: exit {r['returncode']}, {r['seconds']} s, "
                f"{r['shm_left']} shm segments left",
                flush=True,
            )
        failed = [i + 1 for i, r in enumerate(runs) if r["returncode"] != 0]
        results["repeats"] = {
            "runs": runs,
            "nonzero_exits": len(failed),
            "failed_runs": failed,
            "shm_segments_left": sum(r["shm_left"] for r in runs),
        }
        print(
            f"repeats: {len(failed)} of {args.repeats} runs exited non-zero {failed or ''}; exit codes "
            f"{sorted({r['returncode'] for r in runs})}; {results['repeats']['shm_segments_left']} shm segments left; "
            f"{sum(r['seconds'] for r in runs) / len(runs):.1f} s per run",
            flush=True,
        )
        ok &= not failed and not results["repeats"]["shm_segments_left"]

    if args.steps:
        r = run(args.work, "long", ckpt, data, args.steps, args.save_steps, args.save_total_limit)
        first, last = min(r["saves"], default=None), max(r["saves"], default=None)
        growth = (
            [b - a for a, b in zip(r["saves"][first]["rss_mib"], r["saves"][last]["rss_mib"])] if r["saves"] else []
        )
        expected = min(args.save_total_limit, len(r["saves"])) if args.save_total_limit else len(r["saves"])
        results["long"] = {**r, "rss_growth_mib": growth, "expected_checkpoints": expected}
        print(
            f"long run: exit {r['returncode']}, {args.steps} steps in {r['seconds']} s, {len(r['saves'])} saves",
            flush=True,
        )
        for step, s in sorted(r["saves"].items()):
            print(f"  step {step}: RSS per rank {s['rss_mib']} MiB (rank 0 peak {s['peak_rank0_mib']} MiB)")
        print(
            f"  RSS growth step {first} -> {last}: {growth} MiB; checkpoints left: {r['checkpoints']} "
            f"(expected {expected})",
            flush=True,
        )
        ok &= (
            r["returncode"] == 0
            and len(r["checkpoints"]) == expected
            and last == args.steps
            and max(growth, default=0) <= args.max_rss_growth_mib
        )

    with open(os.path.join(args.work, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'PASS' if ok else 'FAIL'} (details: {os.path.join(args.work, 'results.json')})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
