"""Known-harmless output of our dependencies, named in one place and filtered at start, and DeepSpeed's
log level (``log_level``); ``log0``, the ``[train]`` line from rank 0.

Every rank of a job prints these lines, so a 16-rank job buried its own progress line under dozens of
them. Only lines whose cause is understood and harmless are listed; ``log_level=info`` (or debug)
shows them all again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings

# (category, message pattern) for warnings.filterwarnings.
HARMLESS_WARNINGS = [
    # DeepSpeed's ZeRO and pipeline collectives call the old name; same operation, same result.
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),
    # Pipelines with tied embeddings (pipe > 1): DeepSpeed's PipelineModule broadcasts the tied weight from its
    # first stage at start (_synchronize_tied_weights) with grad mode on; c10d's in-place broadcast has no
    # autograd kernel, so PyTorch warns at the first backward on every rank holding it. The broadcast copies
    # values into the leaf parameter: its gradient is unchanged (tests/test_helper_tools.py checks both).
    (UserWarning, r"c10d::broadcast_: an autograd kernel was not registered"),
]
# Messages of DeepSpeed's logger, and of the other loggers named here.
HARMLESS_LOG_RECORDS = [
    r"Setting accelerator to CPU",  # said at every import on a machine without a GPU (the CPU tests, the demo)
    # bitsandbytes on CPU (QLoRA) looks for an optional hub kernel at its first 4-bit matmul and uses its own
    r"Failed to load CPU gemm_4bit_forward from kernels-community",
    # torchao (fp8), imported by transformers' quantizers wherever it is installed: its CUDA-only extensions on a
    # machine without them, and torch's notice about the Enum it registers with torch.compile
    r"^Failed to load .*/torchao/_C.*\.so",
    r"is an Enum subclass and is now natively supported by torch\.compile",
]
FILTERED_LOGGERS = ["DeepSpeed", "bitsandbytes.backends.cpu.ops", "torchao", "torch.utils._pytree"]
# Lines DeepSpeed prints with print() on every rank.
HARMLESS_PRINTS = [
    r"^SEED_LAYERS=",  # PipelineModule's seeding settings: this project seeds per spec itself
    r"^DeepSpeed deepspeed\.ops\..* built successfully$",  # an op loaded from the extensions cache
]
# Lines C++ code writes to stderr (file descriptor 2) on every rank, past sys.stdout: dropped around the calls that
# print them (native_lines_dropped).
HARMLESS_NATIVE_LINES = [
    # torch.profiler's start and stop (profile_steps), said by its kineto library at a severity above its errors:
    # KINETO_LOG_LEVEL cannot hide them and keep the errors
    r"^USDT:.* profiler_(start|stop)$",
]
_filtering = {"on": False}  # quiet_dependencies ran (log_level below info)


class _DropKnown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(re.search(p, record.getMessage()) for p in HARMLESS_LOG_RECORDS)


class _LineFilter:
    """sys.stdout, less the lines matching HARMLESS_PRINTS (whole lines only; everything else passes)."""

    def __init__(self, stream):
        self._stream, self._partial = stream, ""

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        kept = [line for line in lines if not any(re.search(p, line) for p in HARMLESS_PRINTS)]
        if kept:
            self._stream.write("\n".join(kept) + "\n")
        return len(text)

    def flush(self) -> None:
        if self._partial:  # a prompt or progress text without its newline yet
            self._stream.write(self._partial)
            self._partial = ""
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def quiet_dependencies(level: str) -> None:
    """Filter the known-harmless lines unless ``level`` is info or debug. Call before importing deepspeed."""
    if level in ("info", "debug"):
        return
    _filtering["on"] = True
    for category, pattern in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name in FILTERED_LOGGERS:  # a logger's filter sees its own records only, not its children's
        logging.getLogger(name).addFilter(_DropKnown())
    if not isinstance(sys.stdout, _LineFilter):
        sys.stdout = _LineFilter(sys.stdout)


@contextlib.contextmanager
def native_lines_dropped():
    """Within (a short call: the profiler's start or stop), stderr's file descriptor goes to a temporary file,
    written out afterwards less HARMLESS_NATIVE_LINES: nothing else is lost, only delayed. A no-op where
    quiet_dependencies did not filter (log_level info or debug)."""
    if not _filtering["on"]:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            kept = [line for line in lines if not any(re.search(p, line.rstrip("\n")) for p in HARMLESS_NATIVE_LINES)]
            if kept:
                os.write(2, "".join(kept).encode())


def argv_log_level(argv: list[str], default: str = "warning") -> str:
    """``log_level=...`` from the command line, needed before Hydra parses it (imports print first)."""
    return next((a.split("=", 1)[1] for a in argv if a.startswith("log_level=")), default)


def set_log_level(level: str) -> None:
    """DeepSpeed's logger level from the ``log_level`` knob."""
    from deepspeed.utils import logger

    logger.setLevel(getattr(logging, level.upper()))


def log0(msg: str) -> None:
    """Print from global rank 0 only: train.py's ``[train]`` lines."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[train] {msg}", flush=True)
