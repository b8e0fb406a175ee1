"""Per-stage memory, measured against the planner's prediction, on CPU ranks.

    python benchmarks/bench_stage_memory.py [--pipes 2,4] [--vocab 128256] [--hidden 256] [--layers 4]
        [--seq 1024] [--chunks 256,0] [--grad-acc 4] [--ds zero0] [--partition compute] [--checkpointing]
        [--json FILE]
    python benchmarks/bench_stage_memory.py --replan FILE    # the predictions again, for the saved measurements

A scaled-down large-vocabulary Llama (random weights, fp32) trains 3 steps with ``deepspeed train.py``
for every pipeline depth and every ``loss_chunk_tokens`` of ``--chunks`` (0: the whole logits).
Each rank reports, from train.py's end-of-run lines:
- model states: the census of the tensors it holds (weights, gradients, optimizer states) before the
  second optimizer step (training/observation/memory_census.py);
- step peak: the peak of allocated tensor bytes during the second step above its start
  (``count_step_memory=true``: every tensor the step creates, counted as a GPU allocator would):
  the gradients, the saved activations of the micro-batches in flight, the loss buffer, temporaries.

Predicted, for the same layout and the same split (parallel/memory_plan.py, as estimate_memory.py
prints it): model states = weights + gradients + optimizer states; step peak = gradients + activations
+ loss buffer + one gradient of the stage's largest parameter (g.tmp).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import final_figures  # noqa: E402
from models.files.hf_convert import hf_to_stages  # noqa: E402
from models.tiny import save_random_model, tiny_config, write_random_tokens  # noqa: E402
from parallel.layout import Layout  # noqa: E402
from parallel.memory_plan import shape_of, stage_estimates  # noqa: E402
from parallel.partition import splitter  # noqa: E402
from tools.launch import deepspeed_command  # noqa: E402
from training.resilience.ports import free_port  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20
STEPS = 3
ZERO = {"zero0": 0, "zero1": 1}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipes", default="2,4", help="pipeline depths, one run each (one rank per stage)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--chunks", default="256,0", help="loss_chunk_tokens values, one run each (0: whole logits)")
    p.add_argument("--checkpointing", action="store_true", help="activation_checkpoint_interval=1")
    p.add_argument("--grad-acc", type=int, default=4)
    p.add_argument("--ds", default="zero0", choices=sorted(ZERO))
    p.add_argument("--partition", default="compute", help="partition_method")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--workdir", default=None, help="keep the model, data and logs here (default: a temporary one)")
    p.add_argument("--replan", default=None, help="a --json file: recompute its predictions without training")
    return p.parse_args(argv)


def model_config(args):
    """The scaled-down large-vocabulary Llama (GQA: 4 query, 2 KV heads)."""
    return tiny_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
    )


def build_model(workdir: str, args) -> tuple[str, str]:
    """The scaled-down model as layer files, and a token file for the runs."""
    hf, ckpt, data = (os.path.join(workdir, name) for name in ("hf", "ckpt", "tokens.jsonl"))
    if not os.path.exists(ckpt):
        config = model_config(args)
        save_random_model(config, hf)
        hf_to_stages(hf, ckpt)
    write_random_tokens(data, STEPS * args.grad_acc, args.seq, args.vocab)
    return ckpt, data


def run(workdir: str, ckpt: str, data: str, pipe: int, chunk: int, args) -> dict:
    """One training run; per rank: model states and step peak, in MiB."""
    out = os.path.join(workdir, f"pipe{pipe}_chunk{chunk}")
    overrides = {
        "model_name_or_path": ckpt,
        "output_dir": out,
        "data": "tokens",
        "data.train_file": data,
        "data.max_seq_length": args.seq,
        "data.shuffle": "false",
        "data.cache_dir": os.path.join(workdir, "cache"),
        "num_stages": pipe,
        "partition_method": args.partition,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": args.grad_acc,
        "max_steps": STEPS,
        "precision": "fp32",
        "ds": args.ds,
        "loss_chunk_tokens": chunk,
        "activation_checkpoint_interval": int(args.checkpointing),
        "count_step_memory": "true",
    }
    shutil.rmtree(out, ignore_errors=True)
    cmd = deepspeed_command(pipe, "train.py", [f"{k}={v}" for k, v in overrides.items()], port=free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"[bench] pipe {pipe}, loss_chunk_tokens {chunk}: training {STEPS} steps ...", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    with open(out + ".log", "w") as f:
        f.write(log)
    if proc.returncode != 0:
        raise RuntimeError(f"train.py failed (rc {proc.returncode}); its output ends:\n{log[-3000:]}")
    figures = final_figures(out)  # train.py's final figures per rank, as its last lines print them
    for key, what in (("states", "model states"), ("step_peak", "step peak")):
        if not figures[key]:
            raise RuntimeError(f"train.py reported no {what}; its output ends:\n{log[-3000:]}")
    return {"states": figures["states"], "step_peak": figures["step_peak"]}


def predicted(config, pipe: int, chunk: int, args) -> tuple[list, list[int]]:
    layout = Layout(
        stages=pipe,
        dp=1,
        zero=ZERO[args.ds],
        micro_batch=1,
        seq_len=args.seq,
        grad_accum=args.grad_acc,
        dtype="fp32",
        loss_chunk=chunk,
        checkpointing=args.checkpointing,
    )
    params, layers = splitter(config, None, args.partition)(layout)
    return stage_estimates(params, layout, shape_of(config), layers), layers


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replan:
        with open(args.replan) as f:
            saved = json.load(f)
        args = argparse.Namespace(**{**saved["args"], "replan": args.replan, "json": args.json})
        measured = {(r["pipe"], r["chunk"]): r for r in saved["rows"]}
    else:
        workdir = args.workdir or tempfile.mkdtemp(prefix="bench_stage_memory_")
        os.makedirs(workdir, exist_ok=True)
        ckpt, data = build_model(workdir, args)
        measured = {}
        for pipe in (int(p) for p in args.pipes.split(",")):
            for chunk in (int(c) for c in args.chunks.split(",")):
                measured[pipe, chunk] = run(workdir, ckpt, data, pipe, chunk, args)
    config = model_config(args)
    rows = []
    for (pipe, chunk), m in measured.items():
        estimates, layers = predicted(config, pipe, chunk, args)
        for e, n, states, peak in zip(estimates, layers, m["states"], m["step_peak"]):
            rows.append(
                dict(
                    pipe=pipe,
                    chunk=chunk,
                    stage=e.stage,
                    layers=n,
                    params_m=e.parameters / 1e6,
                    states_pred=e.model_states / MIB,
                    states_meas=states,
                    peak_pred=(e.grads + e.activations + e.loss + e.grad_temp) / MIB,
                    peak_meas=peak,
                    loss_pred=e.loss / MIB,
                )
            )
    print(
        f"\nvocabulary {args.vocab}, hidden {args.hidden}, {args.layers} layers, seq {args.seq}, micro-batch 1, "
        f"grad_acc {args.grad_acc}, fp32, {args.ds}, partition_method={args.partition}, activation checkpointing "
        f"{'on' if args.checkpointing else 'off'}; MiB per rank\n"
    )
    print(
        "| pipe | loss_chunk_tokens | stage | layers | params (M) | model states predicted | measured | ratio "
        "| step peak predicted | measured | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['pipe']} | {r['chunk']} | {r['stage']} | {r['layers']} | {r['params_m']:.1f} "
            f"| {r['states_pred']:.0f} | {r['states_meas']:.0f} | {r['states_pred'] / r['states_meas']:.2f} "
            f"| {r['peak_pred']:.0f} | {r['peak_meas']:.0f} | {r['peak_pred'] / r['peak_meas']:.2f} |"
        )
    chunks = sorted({r["chunk"] for r in rows})
    if 0 in chunks and len(chunks) > 1:
        print("\nLast stage's step peak, chunked vs whole logits:")
        for pipe in sorted({r["pipe"] for r in rows}):
            last = {r["chunk"]: r["peak_meas"] for r in rows if r["pipe"] == pipe and r["stage"] == pipe - 1}
            for chunk in chunks[1:]:
                print(
                    f"  pipe {pipe}: {last[0]:.0f} MiB without chunking, {last[chunk]:.0f} MiB with chunks of {chunk}: "
                    f"{last[0] / last[chunk]:.1f}x lower"
                )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            runs = [{"pipe": p, "chunk": c, **m} for (p, c), m in measured.items()]
            json.dump(
                {"args": {k: v for k, v in vars(args).items() if k not in ("json", "replan", "workdir")}, "rows": runs},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
