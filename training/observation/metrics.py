"""Progress lines from one rank, and ``metrics.jsonl`` (one record per step and per eval, and the run's final
figures last)."""

from __future__ import annotations

import json
import math
import os
import statistics
import time

from models.host_memory import peak_rss_mb
from training.resilience.all_ranks import writing

# Dense peak TFLOP/s per GPU by device name (vendor datasheets, no sparsity): (bf16/fp16 tensor cores, fp32).
# The first entry whose every word is in torch.cuda.get_device_name() is used; mfu_peak_tflops overrides.
PEAK_TFLOPS = [
    ("H200", 989.4, 66.9),
    ("H100 PCIe", 756.0, 51.2),
    ("H100", 989.4, 66.9),  # SXM; the name is "NVIDIA H100 80GB HBM3"
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("A10G", 125.0, 31.2),
    ("L4", 121.0, 30.3),
]


FINAL = "final"  # the kind of metrics.jsonl's last record: the run's final figures


def device_peak_tflops(precision: str, override: float = 0.0, fp8: str | None = None) -> float | None:
    """Peak TFLOP/s of one device for ``precision``: ``override`` when set, else the table's entry for this
    GPU; None on a device the table does not know (a CPU: MFU is then omitted). An ``fp8`` run (its recipe) takes
    the bf16 dense peak, not the card's FP8 one: FP8 and bf16 runs compare on one scale (:func:`peak_basis`)."""
    if fp8:
        precision = "bf16"
    if override > 0:
        return override
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for words, half, single in PEAK_TFLOPS:
        if all(w in name for w in words.split()):
            return single if precision == "fp32" else half
    return None


def peak_basis(fp8: str | None, override: float = 0.0) -> str:
    """What an fp8 run's MFU is measured against, for its progress line and records ("" for any other run, whose
    peak is its precision's): the bf16 dense peak of the table, or mfu_peak_tflops where set."""
    if not fp8:
        return ""
    return f"mfu_peak_tflops={override:g}" if override > 0 else "the bf16 dense peak"


def peak_gpu_mb() -> float | None:
    """This rank's peak of allocated GPU memory (MiB, the caching allocator's count) since start; None without
    CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the model's training FLOPs per second over the peak of every device used."""
    return tokens_per_s * flops_per_token / peak_flops


class StepLogger:
    """Prints ``step | loss | lr | grad norm | tokens/s | s/step | ETA | peak memory`` every
    ``log_steps`` steps and writes every step to ``metrics.jsonl`` (``kind``: train or eval).

    ``tokens`` and ``tokens/s`` count the real (non-padding) tokens of the global batch, and
    ``label_tokens`` the tokens the loss was taken over (its denominator with loss_normalization=tokens);
    ``padding`` is the share of the tokens computed on (``fed_tokens``, the rows as fed) that were padding;
    with a mixture (``sources``), ``source_tokens`` gives the step's real tokens per source.
    ``mfu`` is written and printed where the job's peak FLOP/s is known (``peak_flops``, all devices; an fp8 run's
    ``mfu_peak`` and line name that peak, ``peak_basis``), and
    ``peak_gpu_mb`` (rank 0's peak of allocated GPU memory) on a CUDA device.
    ``compute_s`` (pipeline engine): the slowest rank's compute seconds in the step, which rank, and the median
    (training/observation/straggler.py). Each train record carries the run's ``layout`` (``{"pipe": P, "tensor": T,
    "sequence": S, "data": D}``): a run resumed on another layout shows where it changed.

    Only the rank created with ``active=True`` (global rank 0) writes anything. When resuming from
    ``start_step``, records of later steps (written after that checkpoint) are dropped first.
    """

    def __init__(
        self,
        output_dir: str,
        max_steps: int,
        log_steps: int,
        active: bool,
        start_step: int = 0,
        flops_per_token: float = 0.0,
        peak_flops: float | None = None,
        layout: dict[str, int] | None = None,
        sources: list[str] | None = None,
        sinks: list | None = None,
        peak_basis: str = "",
    ):
        self.active, self.max_steps, self.log_steps, self.layout = active, max_steps, log_steps, layout
        self.sources = sources or []  # a mixture's source names (data.sources)
        self.start_step, self.flops_per_token, self.peak_flops = start_step, flops_per_token, peak_flops
        self.peak_basis = peak_basis  # an fp8 run's: the line says which peak its MFU divides by (peak_basis)
        # called with every record as it is written (training/observation/tracking.py's W&B run)
        self.sinks = sinks or []
        self.start = self.last = time.time()
        self.file = None
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if active:
            kept = []
            if start_step and os.path.isfile(self.path):
                with open(self.path) as f:
                    kept = [line for line in f if _kept(json.loads(line), start_step)]
            with writing(self.path):
                self.file = open(self.path, "w")
                self.file.writelines(kept)

    def _write(self, record: dict) -> None:
        with writing(self.path):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        for sink in self.sinks:
            sink(record)

    def log(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
        tokens: int,
        label_tokens: int,
        fed_tokens: int = 0,
        source_tokens: list[int] | None = None,
        compute: list[float] | None = None,
        extra: dict[str, float] | None = None,
        fields: dict | None = None,
    ) -> None:
        """``extra``: the objective's metrics, written and printed; ``fields``: written only (compile=true's
        ``recompiles`` and ``compile_s``, whose changes have lines of their own)."""
        now = time.time()
        step_s, self.last = now - self.last, now
        if not self.active:
            return
        record = {
            "kind": "train",
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "label_tokens": label_tokens,
            "padding": round(1 - tokens / fed_tokens, 4) if fed_tokens else None,
            "step_s": round(step_s, 4),
            "tokens_per_s": round(tokens / step_s, 1),
            "peak_rss_mb": round(peak_rss_mb(), 1),
        }
        gpu_mb = peak_gpu_mb()
        if gpu_mb is not None:
            record["peak_gpu_mb"] = round(gpu_mb, 1)
        if self.layout:
            record["layout"] = self.layout
        if self.sources:  # the step's real tokens per source of the mixture
            record["source_tokens"] = dict(zip(self.sources, source_tokens))
        if compute:  # every rank's compute seconds in the step (training/observation/straggler.py)
            slowest = max(range(len(compute)), key=compute.__getitem__)
            record["compute_s"] = {
                "slowest_rank": slowest,
                "slowest": round(compute[slowest], 4),
                "median": round(statistics.median(compute), 4),
            }
        if self.peak_flops:
            record["mfu"] = round(mfu(tokens / step_s, self.flops_per_token, self.peak_flops), 4)
            if self.peak_basis:
                record["mfu_peak"] = self.peak_basis
        record.update(extra or {})
        record.update(fields or {})
        self._write(record)
        if step % self.log_steps and step not in (self.start_step + 1, self.max_steps):
            return
        eta = (now - self.start) / (step - self.start_step) * (self.max_steps - step)
        gn = "n/a" if grad_norm is None else f"{grad_norm:.3f}"
        util = f" | MFU {100 * record['mfu']:.1f}%" if "mfu" in record else ""
        util += f" vs {self.peak_basis}" if util and self.peak_basis else ""
        pad = "" if record["padding"] is None else f" ({100 * record['padding']:.0f}% padding)"
        gpu = f"peak GPU {record['peak_gpu_mb']:.0f} MiB | " if "peak_gpu_mb" in record else ""
        c = record.get("compute_s")
        slow = (
            f" | slowest rank {c['slowest_rank']} {c['slowest']:.2f} s compute (median {c['median']:.2f})" if c else ""
        )
        print(
            f"step {step}/{self.max_steps} | loss {loss:.4f}{_extra_line(extra)} | lr {lr:.2e} | grad_norm {gn} | "
            f"{record['tokens_per_s']:.0f} tokens/s{pad}{util} | {step_s:.2f} s/step{slow} | ETA {eta:.0f} s | "
            f"{gpu}peak RSS {record['peak_rss_mb']:.0f} MiB",
            flush=True,
        )

    def log_eval(
        self, step: int, loss: float | None, seconds: float, source: str = "", extra: dict[str, float] | None = None
    ) -> None:
        """One eval set's loss; ``source`` names one of data.eval_sources. ``extra``: DPO's metrics (their names
        prefixed with ``eval_``, as Trainer logs them), which replace the perplexity a DPO loss does not have; GRPO's
        rewards, without a loss (None)."""
        self.last += seconds  # eval time is not the next step's time
        if not self.active:
            return
        record = {"kind": "eval", "step": step} | ({} if loss is None else {"eval_loss": loss})
        if loss is None:
            record.update(extra or {})
            record["eval_s"] = round(seconds, 3)
            self._write({**record, "source": source} if source else record)
            name = f" ({source})" if source else ""
            print(f"eval @ step {step}{name}{_extra_line(extra)} | {seconds:.2f} s", flush=True)
            return
        if extra:
            record.update(extra)
            ppl = ""
        else:
            record["eval_ppl"] = math.exp(min(loss, 50.0))  # exp overflows past ~709; 50 is meaningless already
            ppl = f" | perplexity {record['eval_ppl']:.2f}"
        record["eval_s"] = round(seconds, 3)
        self._write({**record, "source": source} if source else record)
        name = f" ({source})" if source else ""
        print(f"eval @ step {step}{name} | eval loss {loss:.4f}{_extra_line(extra)}{ppl} | {seconds:.2f} s", flush=True)

    def close(self) -> None:
        if self.file:
            file, self.file = self.file, None
            with writing(self.path):
                file.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def _kept(record: dict, start_step: int) -> bool:
    """Whether a resumed run keeps an earlier record: its steps up to the checkpoint, without the earlier run's
    final figures (this run writes its own at its end)."""
    return record["step"] <= start_step and record["kind"] != FINAL


def write_final_record(output_dir: str, step: int, figures: dict) -> None:
    """Append metrics.jsonl's last record (global rank 0, after the last step, the file closed): ``{"kind":
    "final", "step": the step reached, **figures}``, the figures train.py prints last, per rank and unrounded
    (training/loop.py): ``peak_memory_mib`` (``{"host": peak RSS, "gpu": peak allocated}``, gpu on CUDA only),
    ``model_states_mib`` (``{"weights", "grads", "optimizer", "total"}``, where the census ran), and
    ``step_peak_at`` with ``step_peak_mib`` (where measured). Not sent to the W&B sinks."""
    path = os.path.join(output_dir, "metrics.jsonl")
    with writing(path), open(path, "a") as f:
        f.write(json.dumps({"kind": FINAL, "step": step, **figures}) + "\n")


def read_final_record(output_dir: str) -> dict | None:
    """The final figures of the run in ``output_dir`` (write_final_record's record); None where it wrote none (a
    run stopped or failed before its end)."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        finals = [r for r in map(json.loads, f) if r["kind"] == FINAL]
    return finals[-1] if finals else None


def _extra_line(extra: dict[str, float] | None) -> str:
    """`` | rewards/chosen 0.0123 | ...``: the objective's metrics in the progress line (a DPO step's under TRL's
    names; a MoE model's router loss and expert load, training/step.py's objective_metrics)."""
    return "".join(f" | {name} {value:.4f}" for name, value in (extra or {}).items())
