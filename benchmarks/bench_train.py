"""Training throughput: a plain Hugging Face loop against train.py, and pipeline / data-parallel scaling.

    python benchmarks/bench_train.py                      # CPU: 34 M-parameter Llama, seq 256, fp32, 8 micro-batches
    python benchmarks/bench_train.py --model llama3.2-1b --precision bf16 --seq 2048 --cases a,b   # one GPU
    python benchmarks/bench_train.py --model llama3.2-3b --precision bf16 --seq 4096 --micro-batch-size 1 \
        --micro-batches 2 --checkpointing --cases a,ac,b,bc,bkl --time-limit 240   # the GPU cases of issue 45

The same model (random init), the same global batch (``--micro-batches`` micro-batches of
``--micro-batch-size`` x ``--seq`` tokens) and the same number of steps after warm-up, for:

  a   plain loop: LlamaForCausalLM + torch.optim.AdamW (fused, as train.py) + clip_grad_norm_, one
      process, --threads threads
  x   two copies of a at once, one thread each: no communication at all, so (x)/(a) is what this
      machine gives two ranks (shared caches and memory bandwidth), the ceiling for c and d
  b   train.py, num_stages=1, one rank, --threads threads (ds=zero1, the default); b0: ds=zero0;
      b1: ZeRO-1 with DeepSpeed's GPU defaults (reduce_scatter and contiguous_gradients on, which
      train.py turns off on CPU)
  c   train.py, num_stages=2, two ranks, one thread each (partition_method=compute, the default);
      c2: partition_method=parameters (DeepSpeed's default); c3: ds=zero0
  d   train.py, num_stages=1, data-parallel 2, two ranks, one thread each; d0: ds=zero0; d1: as b1
  e   train.py, num_stages=1, one rank, one thread: the reference for c, c2 and d (e0, with ds=zero0:
      for c3 and d0; e1 for d1). With --threads 1 (the default) e, e0 and e1 are the commands of b,
      b0 and b1, whose runs serve for both.
  ac  a with each decoder layer compiled (``torch.compile`` per layer, as torchtitan compiles its blocks)
  bc  b with ``compile=true`` (train.py's compiled decoder layers)
  bk  bc with ``kernels=liger`` (Liger's RMSNorm, SwiGLU and RoPE kernels; CUDA only) and train.py's optimizer,
      torch's fused AdamW
  bkl bk with ``loss_impl=liger`` (Liger's fused linear cross entropy instead of the chunked loss): the issue's (d),
      train.py compiled with every Liger kernel and a fused optimizer (torch's; bd measures DeepSpeed's)
  bl  b with ``loss_impl=liger``: Liger's fused linear cross entropy against the chunked loss, nothing else changed
  bd  b with ``adamw_impl=deepspeed``: DeepSpeed's FusedAdam against torch's fused AdamW (its op is JIT-built at
      the run's start, on a GPU with the CUDA toolkit's nvcc: minutes, outside the timed steps; on CPU its C++ op)
  bc8r, bc8t  bc with ``fp8=rowwise`` / ``fp8=tensorwise`` (torchao's Float8Linear in the decoder layers; compute
      capability >= 8.9): the issue's goal is 1.2 x bc; their MFU divides by the same bf16 dense peak as bc's
  The compile time of ac, bc, bk, bkl, bc8r and bc8t is in their warm-up steps (``--warmup``), hence two of them.

--threads 1 for a and b: c and d give each rank one of the 2 cores, so one thread is the per-core
reference all ratios share (and one matmul peak); a 2-thread process on a 2-core machine also loses a
whole parallel region whenever any other process takes a core for a moment, which made (b)/(a) a
measure of the neighbours.

Cases run interleaved, ``--rounds`` times (a x b ..., a x b ..., ...), because other jobs and the
machine's speed itself drift (the same plain loop ran 4.4 or 5.1 s/step minutes apart on an idle
machine); each ratio pairs the two cases' runs of the same round and the verdict takes the median
round. Each round starts by measuring the matmul rate (fp32 on CPU, at one thread and at
--threads; on a GPU, --precision's dtype). Per step, train.py's metrics.jsonl gives the wall time
(``step_s``); a monitor samples /proc/stat and the ranks' CPU times, so each case also shows the
share of a core its ranks got and how many cores other processes used meanwhile; before each run it
waits (up to --max-wait s) for other processes to use less than --quiet cores. --profile times
DeepSpeed's pipeline instructions in every rank (forward, backward, send/recv, reduce, optimizer
step, data loading; wall and CPU seconds per step).

MFU = tokens/s x FLOPs per token / peak, with FLOPs per token = 6 N + 12 L H Q T as torchtitan counts
them (models/llama_pipe.flops_per_token, the count train.py's progress line uses): N the matmul parameters
(everything but the input embedding; the LM head counts even when tied), and attention's QK^T and AV for
L layers of H heads of Q dims over T tokens, without discount for the causal mask. Two peaks, two
columns: "MFU" divides by the device's published dense peak (training/observation/metrics.py's table: 989 TFLOP/s bf16
for an H100 SXM or H200; n/a on CPU), the scale peers publish; "MFU (measured)" by the best square-matmul
rate measured in this run at the case's threads per rank, times its ranks.

--micro-batch-size > 1 stacks that many rows per micro-batch (train.py's micro_batch_size); --checkpointing
recomputes activations (the plain loop: Hugging Face's gradient checkpointing, non-reentrant; train.py:
activation_checkpoint_interval=1), the recomputation not counted as model FLOPs. --time-limit bounds the
whole run: a case that would start after it is skipped, one running past it is stopped and marked, and the
table is printed with what finished; a failing case (an out-of-memory, a missing key) is marked and the
others run. --json is rewritten after every case.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# ZeRO-1 as DeepSpeed configures it for GPUs; on CPU train.py turns both off (training/optim.py,
# zero1_settings): cases b1, d1 and e1 measure what that saves.
GPU_DEFAULTS_JSON = "zero1_deepspeed_defaults.json"
GPU_DEFAULTS = {"zero_optimization": {"stage": 1, "reduce_scatter": True, "contiguous_gradients": True}}
CASES = {
    # name: (description, ranks, num_stages, threads per rank (None: --threads), extra train.py overrides)
    "a": ("plain HF loop (LlamaForCausalLM + torch AdamW, fused)", 1, None, None, []),
    "x": ("two plain HF loops at once, 1 thread each (no communication: the machine's 2-rank ceiling)", 2, None, 1, []),
    "b": ("train.py, num_stages=1, 1 rank", 1, 1, None, []),
    "b0": ("train.py, num_stages=1, 1 rank, ds=zero0", 1, 1, None, ["ds=zero0"]),
    "b1": (
        "train.py, num_stages=1, 1 rank, ZeRO-1 with DeepSpeed's GPU defaults (reduce_scatter, contiguous_gradients)",
        1,
        1,
        None,
        [f"ds_config={{work}}/{GPU_DEFAULTS_JSON}"],
    ),
    "c": ("train.py, num_stages=2 (pipe 2 x data 1)", 2, 2, 1, []),
    "c2": ("train.py, num_stages=2, partition_method=parameters", 2, 2, 1, ["partition_method=parameters"]),
    "c3": ("train.py, num_stages=2, ds=zero0", 2, 2, 1, ["ds=zero0"]),
    "d": ("train.py, num_stages=1, data-parallel 2", 2, 1, 1, []),
    "d0": ("train.py, num_stages=1, data-parallel 2, ds=zero0", 2, 1, 1, ["ds=zero0"]),
    "d1": (
        "train.py, num_stages=1, data-parallel 2, ZeRO-1 with DeepSpeed's GPU defaults",
        2,
        1,
        1,
        [f"ds_config={{work}}/{GPU_DEFAULTS_JSON}"],
    ),
    "e": ("train.py, num_stages=1, 1 rank, 1 thread", 1, 1, 1, []),
    "e0": ("train.py, num_stages=1, 1 rank, 1 thread, ds=zero0", 1, 1, 1, ["ds=zero0"]),
    "e1": (
        "train.py, num_stages=1, 1 rank, 1 thread, ZeRO-1 with DeepSpeed's GPU defaults",
        1,
        1,
        1,
        [f"ds_config={{work}}/{GPU_DEFAULTS_JSON}"],
    ),
    "ac": ("plain HF loop, each decoder layer torch.compile'd", 1, None, None, []),
    "bc": ("train.py, num_stages=1, 1 rank, compile=true", 1, 1, None, ["compile=true"]),
    "bk": (
        "train.py, num_stages=1, 1 rank, compile=true, kernels=liger, torch fused AdamW",
        1,
        1,
        None,
        ["compile=true", "kernels=liger"],
    ),
    "bkl": (
        "train.py, num_stages=1, 1 rank, compile=true, kernels=liger, loss_impl=liger, torch fused AdamW",
        1,
        1,
        None,
        ["compile=true", "kernels=liger", "loss_impl=liger"],
    ),
    "bl": ("train.py, num_stages=1, 1 rank, loss_impl=liger", 1, 1, None, ["loss_impl=liger"]),
    "bd": (
        "train.py, num_stages=1, 1 rank, adamw_impl=deepspeed (DeepSpeed's FusedAdam)",
        1,
        1,
        None,
        ["adamw_impl=deepspeed"],
    ),
    "bc8r": ("train.py, num_stages=1, 1 rank, compile=true, fp8=rowwise", 1, 1, None, ["compile=true", "fp8=rowwise"]),
    "bc8t": (
        "train.py, num_stages=1, 1 rank, compile=true, fp8=tensorwise",
        1,
        1,
        None,
        ["compile=true", "fp8=tensorwise"],
    ),
}
# The plain-loop cases: (copies started together, decoder layers compiled)
PLAIN = {"a": (1, False), "x": (2, False), "ac": (1, True)}
# Ratios: case -> (reference, ideal (None: the pipeline's 2M/(M+K-1)), target as a fraction of the ideal)
RATIOS = {
    "x": ("a", 2.0, None),
    "b": ("a", 1.0, 0.95),
    "b0": ("a", 1.0, 0.95),
    "b1": ("a", 1.0, 0.95),
    "c": ("e", None, 0.9),
    "c2": ("e", None, 0.9),
    "c3": ("e0", None, 0.9),
    "d": ("e", 2.0, 0.9),
    "d0": ("e0", 2.0, 0.9),
    "d1": ("e1", 2.0, 0.9),
    "ac": ("a", 1.0, None),
    "bc": ("ac", 1.0, 1.0),  # the goal: train.py compiled at least the best plain loop
    "bk": ("ac", 1.0, 1.0),
    "bkl": ("ac", 1.0, 1.0),  # the (d) against the best plain loop
    "bl": ("b", 1.0, None),  # one lever each: Liger's loss against the chunked one
    "bd": ("b", 1.0, None),  # DeepSpeed's FusedAdam against torch's fused AdamW
    "bc8r": ("bc", 1.2, 1.0),  # issue 61's goal: FP8 at least 1.2 x train.py compiled in bf16 (3B shape)
    "bc8t": ("bc", 1.2, 1.0),
}
# With --threads 1, e and e0 are the same commands as b and b0: their runs serve for both.
ALIASES = {"e": "b", "e0": "b0", "e1": "b1"}
CPU_SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
)


# ---------------------------------------------------------------- model, data, FLOPs


def model_spec(args) -> tuple[str, dict]:
    """(conf/model group entry, architecture overrides) for both the plain loop and train.py."""
    if args.model:
        return args.model, {}
    shape = dict(CPU_SHAPE)
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    ):
        value = getattr(args, key)
        if value is not None:
            shape[key] = value
    shape["max_position_embeddings"] = max(512, args.seq)
    return "tiny", shape


def llama_config(group: str, overrides: dict):
    from training.configuration.model_source import model_group_config

    return model_group_config(group, **overrides)


# ---------------------------------------------------------------- CPU accounting


def system_busy_s() -> float:
    """CPU seconds all processes have used since boot (/proc/stat; 0 where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class Monitor(threading.Thread):
    """Stamps each new metrics.jsonl train line with wall time, system CPU and the ranks' CPU time."""

    def __init__(self, launcher_pid: int, metrics_path: str, period: float = 0.25):
        super().__init__(daemon=True)
        self.launcher_pid, self.path, self.period = launcher_pid, metrics_path, period
        self.stamps: list[tuple[float, float, float]] = []  # per train line: (time, system busy s, ranks' cpu s)
        self.stop = threading.Event()
        self.ranks: dict[int, object] = {}
        self.rank_cpu: dict[int, float] = {}

    def ranks_cpu(self) -> float:
        import psutil

        try:
            for child in psutil.Process(self.launcher_pid).children(recursive=True):
                if child.pid not in self.ranks:
                    try:
                        if any(a.startswith("--local_rank") for a in child.cmdline()):
                            self.ranks[child.pid] = child
                    except psutil.Error:
                        pass
        except psutil.Error:
            pass
        for pid, p in self.ranks.items():
            try:
                t = p.cpu_times()
                self.rank_cpu[pid] = t.user + t.system
            except psutil.Error:
                pass  # exited: keep its last reading
        return sum(self.rank_cpu.values())

    def run(self) -> None:
        seen = 0
        while not self.stop.is_set():
            lines = 0
            if os.path.isfile(self.path):
                with open(self.path) as f:
                    lines = sum(1 for line in f if '"kind": "train"' in line)
            cpu = self.ranks_cpu()
            if lines > seen:
                now, busy = time.time(), system_busy_s()
                self.stamps += [(now, busy, cpu)] * (lines - seen)
                seen = lines
            self.stop.wait(self.period)


def per_step_cpu(stamps: list[tuple[float, float, float]], ranks: int) -> list[tuple[float, float]]:
    """Per train line after the first: (share of a core per rank, cores used by other processes) since the
    line before."""
    out = []
    for (t0, b0, c0), (t1, b1, c1) in zip(stamps, stamps[1:]):
        wall = t1 - t0
        if wall <= 0:  # lines that arrived in the same poll
            out.append((float("nan"), float("nan")))
            continue
        out.append(((c1 - c0) / wall / ranks, max(0.0, (b1 - b0) - (c1 - c0)) / wall))
    return out


def other_cores_now(seconds: float = 1.0) -> float:
    """Cores busy with processes other than this one over the next ``seconds`` (/proc/stat)."""
    b0, c0 = system_busy_s(), time.process_time()
    time.sleep(seconds)
    return max(0.0, system_busy_s() - b0 - (time.process_time() - c0)) / seconds


def wait_for_quiet(threshold: float, max_wait: float) -> tuple[float, float]:
    """Wait (at most ``max_wait`` s) until other processes use less than ``threshold`` cores; (waited s, cores)."""
    if max_wait <= 0:
        return 0.0, float("nan")
    start = time.time()
    while True:
        busy = other_cores_now()
        if busy < threshold or time.time() - start >= max_wait:
            return time.time() - start, busy


# ---------------------------------------------------------------- workers (run in a subprocess)


def matmul_worker(spec: dict) -> dict:
    """Best square-matmul rate (FLOP/s) at ``threads`` threads, in ``dtype`` on ``device``."""
    import torch

    torch.set_num_threads(spec["threads"])
    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    best = {}
    for n in spec["sizes"]:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(2):
            a @ b
        sync()
        reps = max(2, int(spec["flop_per_rep"] / (2 * n**3)))
        rates = []
        for _ in range(spec["repeats"]):
            t = time.perf_counter()
            for _ in range(reps):
                a @ b
            sync()
            rates.append(2 * n**3 * reps / (time.perf_counter() - t))
        best[n] = max(rates)
    return {"flops": max(best.values()), "by_size": best}


def plain_worker(spec: dict) -> dict:
    """Cases a and ac: LlamaForCausalLM + torch.optim.AdamW, the same global batch as train.py, timed per step."""
    import torch
    from transformers import LlamaForCausalLM

    from training.observation.profiling import StepProfiler
    from training.optim import param_groups

    torch.set_num_threads(spec["threads"])
    device = spec["device"]
    config = llama_config(spec["group"], spec["overrides"])
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):  # drawn where it trains: a 3 B model's initialisation on one CPU thread takes minutes
        model = LlamaForCausalLM(config)
    model.train()
    if spec.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.get("compile"):
        for layer in model.model.layers:  # one compiled block per decoder layer, as torchtitan's apply_compile
            layer.compile()
    # The optimizer train.py builds (training/optim.py): torch's AdamW with its fused kernel.
    opt = torch.optim.AdamW(param_groups(model, 0.0), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=spec["fused"])
    with open(spec["data"]) as f:
        rows = [json.loads(line)["input_ids"] for line in f]
    micro, seq, rows_per = spec["micro_batches"], spec["seq"], spec.get("micro_batch_size", 1)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=spec["precision"] == "bf16")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # --plain-trace-step: that step traced as train.py's profile_steps traces one (the export is not timed)
    profiler = StepProfiler([spec["trace_step"]] * 2 if spec.get("trace_step") else [], spec.get("trace_dir", ""), 0)
    steps = []
    for step in range(spec["steps"]):
        with profiler.step(step + 1):
            t0, c0, b0 = time.perf_counter(), time.process_time(), system_busy_s()
            fwd = bwd = 0.0  # CPU seconds (one thread: the work; immune to time-slicing by other processes)
            for i in range(micro):
                first = (step * micro + i) * rows_per
                ids = torch.tensor([rows[(first + r) % len(rows)][:seq] for r in range(rows_per)], device=device)
                c = time.process_time()
                with autocast:
                    loss = model(input_ids=ids, labels=ids).loss
                c1 = time.process_time()
                (loss / micro).backward()
                fwd, bwd = fwd + c1 - c, bwd + time.process_time() - c1
            c = time.process_time()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            wall = time.perf_counter() - t0
            cpu = time.process_time() - c0
            steps.append(
                {
                    "step_s": wall,
                    "cpu_s": cpu,
                    "other_cores": max(0.0, system_busy_s() - b0 - cpu) / wall,
                    "forward_cpu_s": fwd,
                    "backward_cpu_s": bwd,
                    "optimizer_cpu_s": time.process_time() - c,
                }
            )
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return {"steps": steps, "peak_gpu_mib": peak}


class CaseFailed(Exception):
    """A case that failed or ran past --time-limit: marked in the table, the other cases still run."""


def remaining_s(args) -> float | None:
    """Seconds left of --time-limit (None: no limit)."""
    return None if not args.time_limit else args.time_limit - (time.time() - args.started_at)


def stop_tree(proc: subprocess.Popen) -> None:
    """End a case's process and everything it started (its own session: the launcher and its ranks)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_worker(kind: str, spec: dict, threads: int, copies: int = 1, timeout: float | None = None) -> list[dict] | dict:
    """``copies`` worker processes started together; the result of each (one dict when copies is 1).
    CaseFailed when one fails or ``timeout`` seconds pass."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", kind, "--spec", json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for _ in range(copies)
    ]
    deadline = None if timeout is None else time.time() + timeout
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=None if deadline is None else max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs:
                stop_tree(p)
            raise CaseFailed("stopped at --time-limit") from None
        if proc.returncode != 0:
            last = err.strip().splitlines()[-1] if err.strip() else "no message"
            raise CaseFailed(f"failed (rc {proc.returncode}): {last}\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results[0] if copies == 1 else results


# ------------------------------------------ profiling tables (the ranks run benchmarks/harness.profile_rank)


def profile_table(case: str, prof_dir: str, warmup: int) -> list[str]:
    """Markdown rows: per rank, the median per-step seconds of each instruction (wall / CPU)."""
    rows = []
    names = (
        "train_batch",
        "_exec_forward_pass",
        "_exec_backward_pass",
        "_exec_send_activations",
        "_exec_recv_activations",
        "_exec_send_grads",
        "_exec_recv_grads",
        "_exec_reduce_grads",
        "_exec_reduce_tied_grads",
        "_exec_optimizer_step",
        "_exec_load_micro_batch",
    )
    for fname in sorted(os.listdir(prof_dir)):
        rank = fname[4:-5]
        with open(os.path.join(prof_dir, fname)) as f:
            steps = json.load(f)[warmup:]
        if not steps:
            continue
        cells = []
        for n in names:
            wall = median(st.get(n, [0, 0.0, 0.0])[1] for st in steps)
            cpu = median(st.get(n, [0, 0.0, 0.0])[2] for st in steps)
            cells.append(f"{wall:.2f} / {cpu:.2f}")
        other = median(st["train_batch"][1] - sum(st.get(n, [0, 0.0, 0.0])[1] for n in names[1:]) for st in steps)
        rows.append(f"| {case} | {rank} | " + " | ".join(cells) + f" | {other:.2f} |")
    return rows


PROFILE_HEADER = (
    "| case | rank | train_batch | forward | backward | send act. | recv act. | send grad | recv grad | "
    "reduce grads | reduce tied | optimizer step | load batch | rest (wall) |"
)


# ---------------------------------------------------------------- train.py runs


def case_args(train_args: list[str], case: str) -> list[str]:
    """--train-arg values for ``case``: plain ones for every case, 'c:KEY=VALUE' for case c only."""
    out = []
    for a in train_args:
        head, sep, rest = a.partition(":")
        if sep and "=" not in head:
            if case in head.split(","):
                out.append(rest)
        else:
            out.append(a)
    return out


def run_train(case: str, args, group: str, overrides: dict, tokenizer: str, data: str, run_dir: str) -> dict:
    from tools.launch import deepspeed_command, remove_shm_leftovers
    from training.resilience.ports import free_port

    _, ranks, stages, threads, extra = CASES[case]
    threads = threads or args.threads
    dp = ranks // stages
    out = os.path.join(run_dir, "out")
    shutil.rmtree(out, ignore_errors=True)
    port = free_port()
    profiled = ["benchmarks/bench_train.py", "--profile-rank", os.path.join(run_dir, "profile")]
    entry = profiled if args.profile else ["train.py"]
    train_args = [
        *entry[1:],
        f"model={group}",
        f"model.tokenizer={tokenizer}",
        *[f"model.architecture.{k}={v}" for k, v in overrides.items()],
        f"num_stages={stages}",
        f"ds={args.ds}",
        f"precision={args.precision}",
        f"micro_batch_size={args.micro_batch_size}",
        f"gradient_accumulation_steps={args.micro_batches // dp}",
        f"max_steps={args.warmup + args.steps}",
        "data=tokens",
        f"data.train_file={data}",
        f"data.max_seq_length={args.seq}",
        f"data.cache_dir={os.path.join(args.work, 'cache')}",
        f"output_dir={out}",
        "resume=never",
        "save_final=false",  # the trained weights are not needed: no minutes writing a 3B model's states
        "min_free_disk_gb=0",
        *(["activation_checkpoint_interval=1"] if args.checkpointing else []),
        *[a.format(work=args.work) for a in extra],
        *case_args(args.train_arg, case),
    ]
    cmd = deepspeed_command(ranks, entry[0], train_args, port)
    if any(GPU_DEFAULTS_JSON in a for a in extra):
        with open(os.path.join(args.work, GPU_DEFAULTS_JSON), "w") as f:
            json.dump(GPU_DEFAULTS, f)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    log_path = os.path.join(run_dir, "log.txt")
    if args.profile:
        shutil.rmtree(os.path.join(run_dir, "profile"), ignore_errors=True)
        os.makedirs(os.path.join(run_dir, "profile"))
    timeout = remaining_s(args)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        monitor = Monitor(proc.pid, os.path.join(out, "metrics.jsonl"))
        monitor.start()
        try:
            rc = proc.wait(timeout=None if timeout is None else max(1.0, timeout))
        except subprocess.TimeoutExpired:
            stop_tree(proc)
            rc = None
        monitor.stop.set()
        monitor.join()
    remove_shm_leftovers(port)  # a crashed rank's
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        why = "stopped at --time-limit" if rc is None else f"failed (rc {rc})"
        lines = [line.strip() for line in tail.splitlines() if "launch.py" not in line]
        first = next((i for i, line in enumerate(lines) if "error" in line.lower()), None)
        said = " / ".join(lines[first : first + 3]) if first is not None else "see the log"
        raise CaseFailed(f"{why}: {said} (log {log_path})\n{tail}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if r["kind"] == "train"]
    peak_mib = peak_memory_mib(out)
    cpu = [(float("nan"), float("nan"))] + per_step_cpu(monitor.stamps, ranks)  # step 1 has no line before it
    for entry in os.listdir(out):  # only a profile_steps trace is kept (scripts/plot_timeline.py reads out/profile)
        path = os.path.join(out, entry)
        if entry == "profile":
            continue
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    measured = range(args.warmup, len(records))
    profile = profile_table(case, os.path.join(run_dir, "profile"), args.warmup) if args.profile else []
    return {
        "profile": profile,
        "step_s": [records[i]["step_s"] for i in measured],
        "tokens": records[-1]["tokens"],
        "warmup_s": [r["step_s"] for r in records[: args.warmup]],
        "cpu_share": [cpu[i][0] if i < len(cpu) else float("nan") for i in measured],
        "other_cores": [cpu[i][1] if i < len(cpu) else float("nan") for i in measured],
        "peak_mib": peak_mib,
    }


def peak_memory_mib(output_dir: str) -> float | None:
    """The largest rank's peak memory from train.py's final figures (metrics.jsonl's last record; its line "peak
    memory per rank (MiB): rank 0 host 568 / GPU 9120, ..."): GPU where there is one, else host RSS; None
    without the record."""
    from benchmarks.harness import final_figures

    return max(final_figures(output_dir)["peak"], default=None)


def split_bound_line(config, micro: int, stages: int = 2) -> str:
    """How each partition method splits the model in ``stages``, each stage's share of the matmul work
    (parameter counts, the input embedding 0; attention and the loss left out) and the best pipeline
    speed-up that split allows: 1 / (largest share x (M + K - 1) / M). The ideal 2M/(M+K-1) assumes
    equal stages, which whole layers may not allow."""
    from models.llama_pipe import spec_weights
    from parallel.partition import stage_boundaries

    work = spec_weights(config, "compute")
    parts = []
    for method in ("compute", "parameters"):
        bounds = stage_boundaries(config, stages, method)
        shares = [sum(work[bounds[s] : bounds[s + 1]]) / sum(work) for s in range(stages)]
        best = 1 / (max(shares) * (micro + stages - 1) / micro)
        specs = " | ".join(f"specs {bounds[s]}-{bounds[s + 1] - 1}" for s in range(stages))
        parts.append(
            f"{method}: {specs}, work {' / '.join(f'{100 * x:.1f}%' for x in shares)}, best speed-up {best:.3f}"
        )
    return f"{stages}-stage splits (share of the matmul work per stage): " + "; ".join(parts)


def run_plain(args, group: str, overrides: dict, data: str, device: str, case: str) -> dict:
    """Case a; ac, its decoder layers compiled; x: two independent plain loops at once (the machine's ceiling
    for two ranks that never communicate; their step times are pooled, tokens counted for both)."""
    copies, compiled = PLAIN[case]
    spec = dict(
        group=group,
        overrides=overrides,
        data=data,
        micro_batches=args.micro_batches,
        seq=args.seq,
        steps=args.warmup + args.steps,
        threads=args.threads,
        device=device,
        precision=args.precision,
        fused=not args.plain_default_adamw,
        compile=compiled,
        micro_batch_size=args.micro_batch_size,
        checkpointing=args.checkpointing,
        trace_step=args.plain_trace_step,
        trace_dir=os.path.join(args.work, f"run_{case}", "out"),  # its profile/rank0.pt.trace.json, as train.py's
    )
    peak_mib = None
    if copies == 1:
        result = run_worker("plain", spec, args.threads, timeout=remaining_s(args))
        steps, peak_mib = result["steps"], result["peak_gpu_mib"]
        measured = steps[args.warmup :]
    else:
        runs = [r["steps"] for r in run_worker("plain", spec, args.threads, copies, timeout=remaining_s(args))]
        for i, run in enumerate(runs):  # the sibling loops are this case's own work, not other processes
            siblings = sum(median(s["cpu_s"] / s["step_s"] for s in other) for j, other in enumerate(runs) if j != i)
            for s in run:
                s["other_cores"] = max(0.0, s["other_cores"] - siblings)
        steps = [s for run in runs for s in run[: args.warmup]]
        measured = [s for run in runs for s in run[args.warmup :]]
    profile = []
    if args.profile:
        cells = [f"{median(s['step_s'] for s in measured):.2f} / {median(s['cpu_s'] for s in measured):.2f}"]
        cells += [f"- / {median(s[k] for s in measured):.2f}" for k in ("forward_cpu_s", "backward_cpu_s")]
        cells += ["-"] * 6 + [f"- / {median(s['optimizer_cpu_s'] for s in measured):.2f} (clip + AdamW)", "-"]
        profile = [f"| {case} | 0 | " + " | ".join(cells) + " | - |"]
    return {
        "profile": profile,
        "step_s": [s["step_s"] for s in measured],
        "tokens": copies * args.micro_batches * args.micro_batch_size * args.seq,
        "warmup_s": [s["step_s"] for s in steps[: args.warmup]],
        "cpu_share": [s["cpu_s"] / s["step_s"] for s in measured],  # cores busy, as train.py's per rank
        "other_cores": [s["other_cores"] for s in measured],
        "peak_mib": peak_mib,  # GPU only
    }


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="", help="a conf/model entry (e.g. llama3.2-1b); default: the CPU shape below on model=tiny"
    )
    for key, value in CPU_SHAPE.items():
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, default=None, help=f"default {value}")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--seq", type=int, default=256, help="tokens per sample")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (the global batch)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch")
    p.add_argument(
        "--checkpointing", action="store_true", help="recompute activations in backward (every case; see above)"
    )
    p.add_argument("--time-limit", type=float, default=0.0, help="seconds for the whole run (0: none); see above")
    p.add_argument("--warmup", type=int, default=1, help="steps discarded per run")
    p.add_argument("--steps", type=int, default=3, help="steps measured per run")
    p.add_argument("--rounds", type=int, default=2, help="times every case runs, interleaved")
    p.add_argument("--threads", type=int, default=1, help="threads of the single-process cases a and b")
    p.add_argument(
        "--cases", default="a,x,b,b0,b1,c,c2,c3,d,d0,d1,e,e0,e1", help=f"comma-separated, from {list(CASES)}"
    )
    p.add_argument("--ds", default="zero1", help="train.py's ds= group entry")
    p.add_argument(
        "--train-arg",
        action="append",
        default=[],
        help="extra train.py override, repeatable; 'c:KEY=VALUE' applies it to case c only",
    )
    p.add_argument(
        "--quiet",
        type=float,
        default=0.3,
        help="a step counts as quiet when other processes used fewer cores than this; runs start after "
        "waiting (at most --max-wait s) for such a moment",
    )
    p.add_argument("--max-wait", type=float, default=60.0)
    p.add_argument(
        "--plain-default-adamw",
        action="store_true",
        help="case a with torch.optim.AdamW's default implementation instead of fused=True (train.py's)",
    )
    p.add_argument(
        "--plain-trace-step",
        type=int,
        default=0,
        help="cases a and ac: trace this step (from 1) with torch.profiler into WORK/run_<case>/out/profile, as "
        "train.py's profile_steps writes it (scripts/plot_timeline.py prints where its GPU time went); 0 = off",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="time DeepSpeed's pipeline instructions per rank (wall / CPU s per step) and print them",
    )
    p.add_argument("--work", default=os.path.join(ROOT, "work", "bench_train"))
    p.add_argument("--json", default="", help="write the raw results here")
    p.add_argument("--table", default="", help="write the printed tables here as well (markdown)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--spec", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def median(values) -> float:
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


def summarize(
    case: str,
    runs: list[dict],
    args,
    peak: dict[int, float],
    flops: float,
    device: str,
    quiet: float,
    device_peak: float | None = None,
) -> dict:
    """Medians over every measured step of every round, and over the quiet steps only. ``mfu``: against
    ``device_peak`` (FLOP/s of one device, the datasheet's; None: n/a), ``mfu_measured`` against the matmul rate
    measured in this run (``peak``, per thread count)."""
    _, ranks, _, threads, _ = CASES[case]
    threads = threads or args.threads
    steps = [
        (s, share, other)
        for res in runs
        for s, share, other in zip(res["step_s"], res["cpu_share"], res["other_cores"])
    ]
    quiet_steps = [s for s, _, other in steps if other == other and other < quiet]
    tokens = runs[0]["tokens"]
    step_s = median(s for s, _, _ in steps)
    quiet_s = median(quiet_steps)
    peak_flops = peak[threads if device == "cpu" else 1] * ranks
    return dict(
        ranks=ranks,
        threads=threads,
        tokens=tokens,
        step_s=step_s,
        tokens_per_s=tokens / step_s,
        mfu=tokens / step_s * flops / (device_peak * ranks) if device_peak else None,
        mfu_measured=tokens / step_s * flops / peak_flops,
        quiet_n=len(quiet_steps),
        n=len(steps),
        quiet_step_s=quiet_s,
        quiet_tokens_per_s=tokens / quiet_s if quiet_steps else float("nan"),
        quiet_mfu=tokens / quiet_s * flops / peak_flops if quiet_steps else float("nan"),
        cpu_share=median(x for _, x, _ in steps),
        other_cores=median(o for _, _, o in steps),
        per_round=[median(res["step_s"]) for res in runs],
        peak_mib=max((r["peak_mib"] for r in runs if r.get("peak_mib") is not None), default=None),
    )


def ratio_rows(results: dict[str, list[dict]], micro: int, stages: int = 2) -> list[tuple]:
    """(case, reference, per-round ratios of tokens/s, ideal, target) for every case with a reference.

    Each round's ratio pairs the two cases' per-round median step times (run minutes apart at most),
    so a drift of the machine's speed between rounds cancels; the verdict uses the median round."""
    rows = []
    for case, (ref, ideal, fraction) in RATIOS.items():
        if case not in results or ref not in results:
            continue
        ideal = ideal if ideal is not None else 2 * micro / (micro + stages - 1)
        per_round = []
        for run, ref_run in zip(results[case], results[ref]):
            per_round.append((run["tokens"] / median(run["step_s"])) / (ref_run["tokens"] / median(ref_run["step_s"])))
        rows.append((case, ref, per_round, ideal, None if fraction is None else fraction * ideal))
    return rows


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--profile-rank" in argv:  # inside a rank launched by --profile (the launcher put --local_rank=N first)
        argv = [a for a in argv if not a.startswith("--local_rank")]
        from benchmarks.harness import profile_rank

        profile_rank(argv[1], argv[2:])
        return
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.spec)
        print(json.dumps(matmul_worker(spec) if args.worker == "matmul" else plain_worker(spec)))
        return

    import torch

    from models.tiny import train_tokenizer, write_random_tokens

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not 0 <= args.plain_trace_step <= args.warmup + args.steps:
        sys.exit(
            f"--plain-trace-step {args.plain_trace_step}: a run has steps 1..{args.warmup + args.steps} "
            f"(--warmup {args.warmup} + --steps {args.steps}): pick one of them, or 0 for none"
        )
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"unknown cases {unknown}: choose from {list(CASES)}")
    aliased = {
        e: b
        for e, b in ALIASES.items()
        if args.threads == 1
        and e in cases
        and b in cases
        and case_args(args.train_arg, e) == case_args(args.train_arg, b)
    }
    run_cases = [c for c in cases if c not in aliased]
    group, overrides = model_spec(args)
    config = llama_config(group, overrides)
    from models.llama_pipe import flops_per_token, model_parameters

    six_n, attn = flops_per_token(config, args.seq)  # the same count train.py's MFU uses
    total = model_parameters(config)
    flops = six_n + attn
    os.makedirs(args.work, exist_ok=True)
    tokenizer = os.path.join(args.work, "tokenizer")
    if any(c not in PLAIN for c in run_cases) and not os.path.isfile(os.path.join(tokenizer, "tokenizer.model")):
        train_tokenizer(tokenizer, 512)  # train.py trains from scratch with a tokenizer; the plain loop needs none
    data = os.path.join(args.work, f"tokens_{args.seq}_{config.vocab_size}.jsonl")
    if not os.path.isfile(data):
        write_random_tokens(
            data,
            max(64, args.micro_batches * args.micro_batch_size * (args.warmup + args.steps + 1)),
            args.seq,
            min(config.vocab_size, 32000),
        )

    started = time.strftime("%Y-%m-%d %H:%M")
    args.started_at = time.time()
    print(
        f"model: {group} {overrides or ''}: {total / 1e6:.1f} M params, {six_n / 6 / 1e6:.1f} M matmul params; "
        f"{flops / 1e6:.1f} MFLOP/token (6N {six_n / 1e6:.1f} + attention {attn / 1e6:.1f}, torchtitan's count); "
        f"{args.micro_batches} x {args.micro_batch_size} x {args.seq} tokens/step, {args.precision}, {device}"
        + (", activation checkpointing" if args.checkpointing else ""),
        flush=True,
    )
    from training.observation.metrics import device_peak_tflops

    listed = device_peak_tflops(args.precision) if device == "cuda" else None  # the datasheet's dense peak
    device_peak = listed * 1e12 if listed else None

    mm_dtype = "float32" if args.precision == "fp32" or device == "cpu" else "bfloat16"
    mm_sizes = [1024, 2048] if device == "cpu" else [8192]
    results: dict[str, list[dict]] = {c: [] for c in run_cases}
    failures: dict[str, str] = {}
    peaks: dict[int, list[float]] = {}
    run = dict(args=vars(args), started=started, flops_per_token=flops, six_n=six_n, attn=attn, params=total)
    run.update(device=device, device_peak_flops=device_peak, peaks=peaks, results=results, failures=failures)
    for r in range(args.rounds):
        for threads in sorted({1, args.threads}) if device == "cpu" else [1]:
            if device == "cpu":  # other processes' CPU use is what it waits out
                wait_for_quiet(args.quiet, args.max_wait)
            spec = dict(
                threads=threads,
                device=device,
                dtype=mm_dtype,
                sizes=mm_sizes,
                repeats=5,
                flop_per_rep=2e10 if device == "cpu" else 2e13,
            )
            peak = run_worker("matmul", spec, threads)
            peaks.setdefault(threads, []).append(peak["flops"])
            print(
                f"round {r + 1}: matmul {mm_dtype} at {threads} thread(s): {peak['flops'] / 1e9:.1f} GFLOP/s",
                flush=True,
            )
        for case in run_cases:
            left = remaining_s(args)
            if case in failures or (left is not None and left <= 0):
                failures.setdefault(case, "not run: --time-limit reached")
                continue
            waited, busy = wait_for_quiet(args.quiet, args.max_wait) if device == "cpu" else (0.0, 0.0)
            start = time.time()
            try:
                if case in PLAIN:
                    res = run_plain(args, group, overrides, data, device, case)
                else:
                    run_dir = os.path.join(args.work, f"run_{case}")
                    os.makedirs(run_dir, exist_ok=True)
                    res = run_train(case, args, group, overrides, tokenizer, data, run_dir)
            except CaseFailed as failed:
                failures[case] = str(failed)
                summary_line, _, tail = str(failed).partition("\n")
                print(f"round {r + 1} case {case}: {summary_line}\n{tail[-1500:]}", flush=True)
                write_json(args, run, cases, aliased, peaks, flops, device, device_peak)
                continue
            res["round"] = r + 1
            results[case].append(res)
            tokens_s = res["tokens"] / median(res["step_s"])
            util = f"{100 * tokens_s * flops / device_peak:.1f}% MFU | " if device_peak else ""
            print(
                f"round {r + 1} case {case}: {tokens_s:.0f} tokens/s | {util}s/step "
                f"{' '.join(f'{s:.2f}' for s in res['step_s'])} "
                f"(warm-up {' '.join(f'{s:.2f}' for s in res['warmup_s'])})"
                f" | peak memory {res['peak_mib'] or 'n/a'} MiB | cores busy per rank "
                f"{' '.join(f'{x:.2f}' for x in res['cpu_share'])} | other processes (cores) "
                f"{' '.join(f'{x:.2f}' for x in res['other_cores'])} | waited {waited:.0f} s for < {args.quiet} busy "
                f"cores (then {busy:.2f}) | {time.time() - start:.0f} s",
                flush=True,
            )
            write_json(args, run, cases, aliased, peaks, flops, device, device_peak)
    for e, b in aliased.items():
        results[e] = results[b]
    summary, rows = write_json(args, run, cases, aliased, peaks, flops, device, device_peak)
    tables = io.StringIO()
    with contextlib.redirect_stdout(tables):
        print_tables(args, started, device, mm_dtype, peaks, cases, aliased, summary, failures, rows, results, config)
    print(tables.getvalue(), end="", flush=True)
    if args.table:
        with open(args.table, "w") as f:
            f.write(tables.getvalue())
    if any(not why.startswith("not run") for why in failures.values()):
        sys.exit(f"cases failed: {', '.join(c for c, why in failures.items() if not why.startswith('not run'))}")


def write_json(args, run: dict, cases, aliased, peaks, flops, device, device_peak) -> tuple[dict, list]:
    """The summary of every case finished so far and the ratios; the whole run written to --json (after every
    case, so a run stopped from outside leaves what it measured)."""
    results = {**run["results"], **{e: run["results"][b] for e, b in aliased.items()}}
    peak = {t: max(v) for t, v in peaks.items()}
    summary = {
        case: summarize(case, results[case], args, peak, flops, device, args.quiet, device_peak)
        for case in cases
        if results.get(case)
    }
    rows = ratio_rows({c: r for c, r in results.items() if r}, args.micro_batches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run, "summary": summary, "ratios": rows}, f, indent=1)
    return summary, rows


def print_tables(args, started, device, mm_dtype, peaks, cases, aliased, summary, failures, rows, results, config):
    peak = {t: max(v) for t, v in peaks.items()}
    print()
    print(
        f"{started}, {os.cpu_count()} CPUs, {device}; matmul peak ({mm_dtype}, best of {args.rounds} rounds): "
        + ", ".join(f"{t} thread(s) {v / 1e9:.1f} GFLOP/s" for t, v in sorted(peak.items()))
    )
    print()
    print(
        "| case | what | ranks x threads | s/step (median) | per-round medians | tokens/s | MFU | MFU (measured) | "
        f"steps with other processes < {args.quiet} cores | cores busy per rank | other processes (cores) | "
        "peak memory (MiB, largest rank; GPU where there is one) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        what = CASES[case][0] + (f" (the runs of {aliased[case]})" if case in aliased else "")
        extra = case_args(args.train_arg, case)
        if extra:
            what += " " + " ".join(extra)
        if case not in summary:
            why = failures.get(case, "no run").splitlines()[0]
            print(f"| {case} | {what} | {why} |" + " |" * 9)
            continue
        s = summary[case]
        mfu = "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
        print(
            f"| {case} | {what} | {s['ranks']} x {s['threads']} | {s['step_s']:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in s['per_round'])} | {s['tokens_per_s']:.0f} | {mfu} | "
            f"{100 * s['mfu_measured']:.1f}% | {s['quiet_n']}/{s['n']} | {s['cpu_share']:.2f} | "
            f"{s['other_cores']:.2f} | {'n/a' if s['peak_mib'] is None else round(s['peak_mib'])} |"
        )
    print()
    if rows:
        print("| ratio of tokens/s | median of rounds | per round | ideal | target | median / ideal | |")
        print("|---|---|---|---|---|---|---|")
        for case, ref, per_round, ideal, target in rows:
            value = median(per_round)
            verdict = "" if target is None else ("met" if value >= target else "MISSED")
            print(
                f"| ({case})/({ref}) | {value:.3f} | {', '.join(f'{x:.3f}' for x in per_round)} | {ideal:.3f} | "
                f"{'-' if target is None else f'>= {target:.3f}'} | {value / ideal:.3f} | {verdict} |"
            )
        print()
    if any(CASES[c][2] == 2 for c in cases):
        print(split_bound_line(config, args.micro_batches))
        print()
    if args.profile:
        print("Per rank, median seconds per step, wall / CPU (this thread) of each pipeline instruction:")
        print(PROFILE_HEADER)
        print("|---" * (PROFILE_HEADER.count("|") - 1) + "|")
        for case in cases:
            for res in results.get(case, [])[-1:]:
                for row in res.get("profile", []):
                    print(row)
        print()


if __name__ == "__main__":
    main()
