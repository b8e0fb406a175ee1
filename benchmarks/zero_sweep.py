"""Every ZeRO configuration on the same model and data, in one table and one chart.

    python benchmarks/zero_sweep.py [--steps 6] [--hidden 256] [--layers 4] [--ranks 4]

Trains a small Llama from scratch (bf16, raw text packed into 128-token rows, micro-batch 2) with
`deepspeed --num_gpus RANKS train.py` for each configuration of ds_configs/ (pipeline configurations
with num_stages=2, the others with num_stages=1), plus activation checkpointing and gradient
accumulation variants. Records per-rank peak memory (host RSS here; GPU memory on a GPU), seconds per
step (median after the first step), tokens/s and the final loss. A configuration that cannot run
gets a row with the reason train.py gave. Writes benchmarks/results/zero_sweep.md, .png and .json (the raw rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from parallel.layout import count_arg, offloads  # noqa: E402
from tools.launch import deepspeed_command  # noqa: E402
from training.configuration.model_source import model_group_config  # noqa: E402
from training.observation.metrics import read_final_record  # noqa: E402
from training.resilience.ports import free_port  # noqa: E402

PIPELINE_CONFIGS = ("zero0", "zero1", "zero1_offload")  # DeepSpeed's pipeline engine runs ZeRO 0/1 only


def cases(configs: list[str]) -> list[dict]:
    """(config, activation checkpointing, gradient accumulation) combinations to run."""
    out = [dict(ds=c, ckpt=False, ga=4) for c in configs]
    out += [dict(ds="zero1", ckpt=True, ga=4), dict(ds="zero1", ckpt=False, ga=8), dict(ds="zero3", ckpt=True, ga=4)]
    return [c for c in out if c["ds"] in configs]


def run(case: dict, args, work: str, tokenizer: str, corpus: str) -> dict:
    with open(os.path.join(ROOT, "ds_configs", f"{case['ds']}.json")) as f:
        zero = json.load(f).get("zero_optimization", {})
    stages = 2 if case["ds"] in PIPELINE_CONFIGS else 1
    name = f"{case['ds']}{'_ckpt' if case['ckpt'] else ''}_ga{case['ga']}"
    out = os.path.join(work, "runs", name)
    train_args = [
        "model=tiny",
        f"model.tokenizer={tokenizer}",
        f"model.architecture.hidden_size={args.hidden}",
        f"model.architecture.intermediate_size={int(args.hidden * 2.75)}",
        f"model.architecture.num_hidden_layers={args.layers}",
        f"ds={case['ds']}",
        f"num_stages={stages}",
        "micro_batch_size=2",
        f"gradient_accumulation_steps={case['ga']}",
        f"activation_checkpoint_interval={1 if case['ckpt'] else 0}",
        f"max_steps={args.steps}",
        "data=text",
        f"data.train_file={corpus}",
        "data.max_seq_length=128",
        f"data.cache_dir={os.path.join(work, 'cache')}",
        f"output_dir={out}",
        "resume=never",
        "save_steps=0",
    ]
    cmd = deepspeed_command(args.ranks, "train.py", train_args, port=free_port())
    if os.path.isdir(out):
        subprocess.run(["rm", "-rf", out], check=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    offload = "+".join(name for name, on in zip(("optimizer", "param"), offloads(zero)) if on)
    row = dict(
        name=name,
        ds=case["ds"],
        stage=zero.get("stage", 0),
        offload=offload or "none",
        ckpt=case["ckpt"],
        ga=case["ga"],
        stages=stages,
        batch=2 * case["ga"] * (args.ranks // stages),
    )
    if proc.returncode != 0:
        row["reason"] = failure_reason(proc.stderr + proc.stdout)
        return row
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if r["kind"] == "train"]
    final = read_final_record(out)  # train.py's final figures per rank, taken as its last lines print them
    peaks = [
        (int(f"{p['host']:.0f}"), int(f"{p['gpu']:.0f}") if "gpu" in p else None) for p in final["peak_memory_mib"]
    ]
    s_per_step = statistics.median(r["step_s"] for r in steps[1:])
    states = [float(f"{s['total']:.2f}") for s in final["model_states_mib"]]
    row.update(states_mib=max(states), estimate_mib=estimate_states_mib(args, row, zero))
    row.update(
        memory=max(h for h, _ in peaks),
        gpu=max((g or 0) for _, g in peaks) or None,
        s_per_step=s_per_step,
        tokens_per_s=steps[-1]["tokens"] / s_per_step,
        loss=steps[-1]["loss"],
    )
    return row


def estimate_states_mib(args, row: dict, zero: dict) -> float:
    """The planner's model-state bytes for the most loaded rank of this run, with the offloaded states
    (on CPU the host is the device, and the census counts them) and ZeRO-3's reduce bucket."""
    from parallel.layout import Layout
    from parallel.memory_plan import estimate
    from parallel.partition import splitter

    config = model_group_config(
        "tiny", hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75), num_hidden_layers=args.layers
    )
    layout = Layout(row["stages"], args.ranks // row["stages"], zero.get("stage", 0), *offloads(zero), dtype="bf16")
    params, _ = splitter(config, None)(layout)
    e = estimate(params, layout)
    # ZeRO-1/2 release their reduce bucket at the end of each backward (DeepSpeed's _release_ipg_buffers),
    # so the census, taken at the optimizer step, sees it only with ZeRO-3, which keeps it.
    return (e.model_states + e.host + (e.buffers if layout.zero == 3 else 0.0)) / 2**20


def failure_reason(output: str) -> str:
    """train.py's error message (its first line and the indented problem lines under it), one line."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if "train.py: error:" in line), None)
    if start is None:
        return "failed: " + (lines[-1] if lines else "no output")
    message = [lines[start].split("train.py: error:", 1)[1]]
    message += [line.strip() for line in lines[start + 1 :] if line.startswith("  ")]
    return " ".join(m.strip() for m in message if m.strip())


def write_results(rows: list[dict], args, command: str) -> None:
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    lines = [
        "# ZeRO sweep",
        "",
        f"Command: `{command.strip()}`. {args.ranks} CPU ranks (gloo), bf16, tiny Llama (hidden {args.hidden}, "
        f"{args.layers} layers) "
        f"from scratch, 128-token rows, micro-batch 2, {args.steps} steps. Memory: peak host RSS of the largest rank "
        "(on CPU, mostly the framework's ~380 MiB per rank). Model states: the bytes of the tensors holding weights, "
        "gradients and optimizer states on the most loaded rank, measured before the second optimizer step "
        "(training/observation/memory_census.py), next to the planner's estimate for the same layout "
        "(scripts/estimate_memory.py; offloaded states counted, since the host is the device here).",
        "",
        "| config | ZeRO stage | offload | activation checkpointing | gradient accumulation | batch size | pipeline "
        "stages | "
        "memory (MiB, max rank) | model states measured (MiB) | planner estimate (MiB) | estimate / measured | "
        "time per step (s) | tokens/s | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = (
            f"| `{r['ds']}` | {r['stage']} | {r['offload']} | {'on' if r['ckpt'] else 'off'} | {r['ga']} | "
            f"{r['batch']} | {r['stages']} |"
        )
        if "reason" in r:
            lines.append(f"{head} cannot run here: {r['reason']} | | | | | | |")
        else:
            lines.append(
                f"{head} {r['memory']} | {r['states_mib']:.2f} | {r['estimate_mib']:.2f} | "
                f"{r['estimate_mib'] / r['states_mib']:.2f} | {r['s_per_step']:.3f} | {r['tokens_per_s']:.0f} | "
                f"{r['loss']:.4f} |"
            )
    with open(os.path.join(ROOT, "benchmarks", "results", "zero_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "reason" not in r]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["name"] for r in ok]
    ax_mem.barh(names, [r["memory"] for r in ok], color="tab:blue")
    ax_mem.set_xlabel("peak memory, largest rank (MiB)")
    ax_time.barh(names, [r["s_per_step"] for r in ok], color="tab:orange")
    ax_time.set_xlabel("time per step (s)")
    ax_time.set_yticklabels([])
    skipped = [r["name"] for r in rows if "reason" in r]
    fig.suptitle("ZeRO sweep" + (f" (cannot run here: {', '.join(skipped)}; see zero_sweep.md)" if skipped else ""))
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "benchmarks", "results", "zero_sweep.png"), dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--steps", type=count_arg(2), default=6, help="steps per run (2 or more: the time per step skips the first)"
    )
    p.add_argument("--hidden", type=count_arg(1), default=256)
    p.add_argument("--layers", type=count_arg(1), default=4)
    p.add_argument("--ranks", type=count_arg(1), default=4, help="ranks (CPU processes or GPUs)")
    p.add_argument("--work", default=os.path.join(ROOT, "work", "zero_sweep"))
    p.add_argument(
        "--replan",
        action="store_true",
        help="no training: recompute the planner column of benchmarks/results/zero_sweep.json's rows and rewrite the "
        "table",
    )
    args = p.parse_args()
    if args.replan:
        with open(os.path.join(ROOT, "benchmarks", "results", "zero_sweep.json")) as f:
            rows = json.load(f)
        for row in rows:
            if "reason" not in row:
                with open(os.path.join(ROOT, "ds_configs", f"{row['ds']}.json")) as f:
                    row["estimate_mib"] = estimate_states_mib(args, row, json.load(f).get("zero_optimization", {}))
        with open(os.path.join(ROOT, "benchmarks", "results", "zero_sweep.json"), "w") as f:
            json.dump(rows, f, indent=1)
        write_results(
            rows, args, "python benchmarks/zero_sweep.py " + " ".join(a for a in sys.argv[1:] if a != "--replan")
        )
        print("[sweep] rewrote benchmarks/results/zero_sweep.md and .png with the current planner")
        return

    from models.tiny import train_tokenizer, write_text_corpus
    from training.configuration.ds_json import available_ds_configs

    os.makedirs(args.work, exist_ok=True)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    tokenizer, corpus = os.path.join(args.work, "tokenizer"), os.path.join(args.work, "corpus.jsonl")
    if not os.path.isfile(os.path.join(tokenizer, "tokenizer.model")):
        train_tokenizer(tokenizer, 512)
    write_text_corpus(corpus)
    rows = []
    for case in cases(available_ds_configs()):
        row = run(case, args, args.work, tokenizer, corpus)
        print(
            f"[sweep] {row['name']}: "
            + (
                f"cannot run: {row['reason']}"
                if "reason" in row
                else f"{row['memory']} MiB, {row['s_per_step']:.3f} s/step, loss {row['loss']:.4f}"
            ),
            flush=True,
        )
        rows.append(row)
    with open(os.path.join(ROOT, "benchmarks", "results", "zero_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    write_results(rows, args, "python benchmarks/zero_sweep.py " + " ".join(sys.argv[1:]))
    print("[sweep] wrote benchmarks/results/zero_sweep.md and benchmarks/results/zero_sweep.png")


if __name__ == "__main__":
    main()
