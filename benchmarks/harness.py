"""One train.py run as the benchmark scripts measure it (benchmarks/bench_lora.py, bench_dpo.py, bench_layouts.py):
launched with DeepSpeed's runner, then its step time and real tokens per second from metrics.jsonl and, per
rank, the model-state bytes and peak memory train.py reports at the end (metrics.jsonl's last record)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

from tools.launch import deepspeed_command, remove_shm_leftovers
from training.observation.metrics import read_final_record
from training.resilience.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def final_figures(output_dir: str) -> dict:
    """Per rank, train.py's final figures of the run in ``output_dir`` (metrics.jsonl's last record), as its last
    lines print them: the model states' totals, the peak memory (GPU where there is one, else host RSS) and its
    kind, the second step's peak (count_step_memory); a figure the run did not measure is an empty list."""
    final = read_final_record(output_dir) or {}
    peaks = final.get("peak_memory_mib", [])
    gpu = [float(f"{p['gpu']:.0f}") for p in peaks if "gpu" in p]
    return {
        "states": [float(f"{s['total']:.2f}") for s in final.get("model_states_mib", [])],
        "peak": gpu or [float(f"{p['host']:.0f}") for p in peaks],
        "peak_kind": "GPU" if gpu else "host RSS",
        "step_peak": [float(f"{p:.1f}") for p in final.get("step_peak_mib", [])],
    }


def run_ranks(ranks: int, script: str, args: list[str]) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus ranks script args`` from the repo root, one thread per CPU rank, its output captured.
    The smoke tests (tests/test_bench_scripts.py) put the tests' forked launch in its place: the figures are the
    ranks' own either way, and a launch takes seconds instead of the launcher's 15."""
    port = free_port()
    try:
        return subprocess.run(
            deepspeed_command(ranks, script, args, port),
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            check=False,
        )
    finally:
        remove_shm_leftovers(port)


def run_python(argv: list[str]) -> subprocess.CompletedProcess:
    """``python argv`` from the repo root, one thread, its output captured: a benchmark's worker in a process of its
    own (its peak memory its own). The smoke tests fork it from theirs as they do the ranks (``run_ranks``)."""
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )


def measure_train(
    ranks: int, overrides: list[str], output_dir: str, warmup: int, name: str = "train.py", script: list | None = None
) -> dict:
    """Run ``deepspeed --num_gpus ranks train.py overrides`` (one thread per CPU rank) and measure it: the
    median step time and tokens/s after ``warmup`` steps, model states and peak memory per rank (MiB).
    ``script``: what the launcher starts instead of train.py (a profiling wrapper, see ``profile_rank``)."""
    entry = script or ["train.py"]
    proc = run_ranks(ranks, entry[0], [*entry[1:], *overrides])
    if proc.returncode:
        raise SystemExit(f"{name}: train.py failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if r["kind"] == "train"]
    timed = steps[warmup:] or steps
    return {
        "step_s": statistics.median(r["step_s"] for r in timed),
        "tokens_s": statistics.median(r["tokens_per_s"] for r in timed),
        **final_figures(output_dir),
        "loss": steps[-1]["loss"],
        "log": proc.stdout,
    }


def add_run_args(p, seq: int, micro_batch: int, global_batch: int, steps: int) -> None:
    """The options every train.py benchmark takes (bench_layouts.py, bench_padding.py): ranks, precision, ZeRO
    config, the model's shape, sequence, batch, steps, warm-up and the work directory."""
    from parallel.layout import count_arg

    p.add_argument("--gpus", type=count_arg(1), default=4, help="ranks (CPU processes here, GPUs elsewhere)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--ds", default="zero1")
    add_model_args(p)
    p.add_argument("--seq", type=count_arg(2), default=seq)
    p.add_argument("--micro-batch", type=count_arg(1), default=micro_batch)
    p.add_argument("--global-batch", type=count_arg(1), default=global_batch, help="samples per optimizer step")
    p.add_argument("--steps", type=count_arg(1), default=steps)
    p.add_argument("--warmup", type=count_arg(0), default=2, help="steps left out of the median")
    p.add_argument("--work-dir", default=None, help="where the model and runs go (default: a temporary directory)")


def add_pipeline_args(p, micro_help: str = "samples per micro-batch") -> None:
    """The options of the benchmarks that compare cases on one pipeline layout (bench_lora.py, bench_dpo.py):
    ranks, stages, precision, ZeRO config, the model's shape, sequence, batch, steps, warm-up, work directory."""
    p.add_argument("--gpus", type=int, default=4, help="ranks (CPU processes here, GPUs elsewhere)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--ds", default="zero1")
    add_model_args(p)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1, help=micro_help)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--work-dir", default=None, help="where the model and runs go (default: a temporary directory)")


def add_model_args(p) -> None:
    """The random model's shape, as the benchmark scripts take it (defaults: 41 M parameters, 8 layers)."""
    for name, default in (
        ("hidden-size", 512),
        ("intermediate-size", 1408),
        ("num-hidden-layers", 8),
        ("num-attention-heads", 8),
        ("num-key-value-heads", 4),
        ("vocab-size", 8192),
    ):
        p.add_argument(f"--{name}", type=int, default=default)


def bench_model(args, work: str) -> str:
    """The converted checkpoint of the random model ``add_model_args`` describes, made once in ``work``."""
    from models.tiny import converted_random_model

    return converted_random_model(
        work,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        max_position_embeddings=max(512, args.seq),
    )


def run_as_rank(argv: list[str], flag: str, fn) -> bool:
    """A benchmark script started by the launcher as a rank (``script flag DIR train.py-args``, the launcher's
    ``--local_rank=N`` put first): runs ``fn(DIR, train.py-args)`` and returns True; False when ``flag`` is absent."""
    if flag not in argv:
        return False
    argv = [a for a in argv if not a.startswith("--local_rank")]
    fn(argv[1], argv[2:])
    return True


def per_rank_text(values, fmt: str = "{:.0f}") -> str:
    """One figure per rank for a table cell, or the figure once when every rank has it."""
    texts = [fmt.format(v) for v in values]
    return texts[0] if len(set(texts)) == 1 else ", ".join(texts)


def run_overrides(args, ckpt: str, data: str, work: str, out: str) -> list[str]:
    """train.py's overrides every benchmark run shares: the model, data and its cache, a fresh ``out``, the
    precision, ZeRO config, micro-batch and step count of ``args``, no checkpoint before the end."""
    shutil.rmtree(out, ignore_errors=True)
    return [
        f"model_name_or_path={ckpt}",
        f"output_dir={out}",
        f"data.train_file={data}",
        f"data.max_seq_length={args.seq}",
        f"data.cache_dir={os.path.join(work, 'cache')}",
        f"ds={args.ds}",
        f"precision={args.precision}",
        f"micro_batch_size={args.micro_batch}",
        f"max_steps={args.steps}",
        "save_steps=0",
        "min_free_disk_gb=0",
    ]


# Pipeline instructions timed by ``profile_rank`` (wall and this thread's CPU time, per call).
PROFILED = (
    "_exec_load_micro_batch",
    "_exec_forward_pass",
    "_exec_backward_pass",
    "_exec_weight_pass",
    "_exec_send_activations",
    "_exec_recv_activations",
    "_exec_send_grads",
    "_exec_recv_grads",
    "_exec_commit_p2p",
    "_exec_reduce_tied_grads",
    "_exec_reduce_grads",
    "_exec_optimizer_step",
)


def profile_rank(out_dir: str, train_argv: list[str]) -> None:
    """Run train.py in this process with the pipeline engines' instructions timed (1F1B's and DualPipeV's, as
    each schedule calls them through its engine's instruction map); per step, write ``out_dir/rank<R>.json``:
    [{instruction: [calls, wall s, cpu s]}, ...] (one dict per train_batch)."""
    import time

    from deepspeed.runtime.pipe.engine import PipelineEngine

    from parallel.dualpipev import wrap_instructions

    steps: list[dict] = []
    current: dict = {}

    def timed(name, fn):
        def wrapper(self, *a, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(self, *a, **k)
            finally:
                rec = current.setdefault(name, [0, 0.0, 0.0])
                rec[0] += 1
                rec[1] += time.perf_counter() - t
                rec[2] += time.thread_time() - c

        wrapper.__name__ = fn.__name__
        return wrapper

    wrap_instructions(PROFILED, lambda fn: timed(fn.__name__, fn))
    train_batch = timed("train_batch", PipelineEngine.train_batch)

    def train_batch_and_record(self, *a, **k):
        current.clear()
        try:
            return train_batch(self, *a, **k)
        finally:
            steps.append({k2: list(v) for k2, v in current.items()})

    PipelineEngine.train_batch = train_batch_and_record
    run_train_recording(out_dir, train_argv, steps)


def run_train_recording(out_dir: str, train_argv: list[str], steps: list) -> None:
    """Run train.py in this rank's process; at exit write ``steps`` (what the caller's wrappers record per step) to
    ``out_dir/rank<R>.json``."""
    import atexit
    import runpy

    def dump():
        with open(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(steps, f)

    atexit.register(dump)
    sys.argv = [os.path.join(ROOT, "train.py"), *train_argv]
    runpy.run_path(sys.argv[0], run_name="__main__")
