"""``compile=true``: every layer of a rank's pipeline stage compiled with ``torch.compile``, through DeepSpeed's own
support, its rules, and the compile figures of a run.

DeepSpeed 0.19.8's ``engine.compile()`` (deepspeed/runtime/engine.py) calls ``PipelineModule.compile``
(deepspeed/runtime/pipe/module.py), which compiles each of the stage's layers on its own: a module in place
(``nn.Module.compile``: the same object, class, parameters and state-dict keys, so layer files, checkpoints, tied
weights and activation checkpointing by class name are untouched), the tied LM head's function with
``torch.compile``. Backend: the accelerator's (``inductor`` on CPU and CUDA). The decoder layers of a stage share
their compiled graphs (the same code, parameters as inputs). A micro-batch whose rows are one document each runs a layer
as one graph (the layer asks the host first, models/attention.py's ``rows_are_whole_documents``); over packed rows the
per-document attention runs eagerly between the compiled parts of a layer: it finds the documents of each row with
data-dependent Python.

Shapes: the micro-batch length changes with the rows when ``data.pad_to_multiple_of`` > 0 (each micro-batch is cut
to its longest row, rounded up); torch recompiles at the first new length and then treats the length as dynamic,
so a run compiles its layers about twice however many lengths occur. Eval's first pass (no gradients) compiles
once more. :class:`CompileLog` reports what was compiled (torch._dynamo's counters, every rank's, the most).

Refused before start (:func:`compile_problems`), each with what to use instead: the parts whose compiled runs have
not been checked against the Hugging Face reference, and DualPipeV, whose deferred weight gradients break the
graph at every linear layer (compiling buys nothing there). Per family: docs/models.md's "What each family runs
with" (tests/test_family_axes.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from models.families import moe_spec
from models.family_qwen3_5 import compile_problems as qwen3_5_compile_problems
from parallel.axes import AXES
from parallel.layout import Layout

# More micro-batch lengths than this: a warning with their number (dynamo's default recompile limit; torch marks the
# length dynamic at the first change, so they cost one recompile, and dynamic kernels).
MANY_LENGTHS = 8
# Compiled variants dynamo keeps per function before it runs that function eagerly (torch._dynamo.config
# .recompile_limit, 8 by default). The layers of a stage share their functions' code (nn.Module's call, transformers'
# decoder-layer call), and one decoder layer alone has 8 variants: called by the pipeline (a tuple) and by its own
# stage class (a tensor) x with and without gradients (activation checkpointing's first forward, eval) x a fixed and
# a dynamic length; the eval's first pass then hit the limit and ran the layers eagerly (measured on 4 CPU ranks).
# Rows of one document each or packed (models/attention.py's rows_are_whole_documents) double that, to 16 at most.
RECOMPILE_LIMIT = 64


def compile_problems(cfg, model_config, layout: Layout) -> list[str]:
    """What ``compile=true`` does not run with (cfg: training.configuration.schema.TrainConfig), each with what to use
    instead; [] when compile is off."""
    if not cfg.compile:
        return []
    off = "or set compile=false"
    problems = []
    for axis in AXES:  # what each parallel axis does not run compiled
        problems += axis.compile_problems(layout)
    if cfg.peft.method != "none":
        problems.append(
            f"compile=true with peft.method={cfg.peft.method}: PEFT's adapter layers are not checked compiled: "
            f"train LoRA with compile=false, or train every weight (peft.method=none) compiled"
        )
    problems += qwen3_5_compile_problems(getattr(model_config, "model_type", None))
    moe = moe_spec(model_config) if model_config is not None else None
    if moe is not None:
        problems.append(
            f"compile=true with the Mixture-of-Experts model_type {model_config.model_type}: its routing (tokens "
            "per expert, data-dependent shapes) and expert parallelism's all-to-all are not checked compiled: set "
            "compile=false (the dense families llama, mistral, qwen2, qwen3, gemma3_text compile)"
        )
    problems += layout.engine.pipeline_only(
        f"compile=true with ZeRO-{layout.zero} and num_stages=1 (DeepSpeed's data-parallel engine): its "
        "parameter and gradient partitioning hooks are not checked compiled: use ds=zero1 (or zero0; "
        f"num_stages=1 then runs the pipeline engine), {off}"
    )
    return problems


def compile_warnings(cfg, layout: Layout) -> list[str]:
    """With compile on and micro-batches cut to their rows (data.pad_to_multiple_of > 0): how many lengths occur,
    when that is more than dynamo keeps compiled graphs of one function."""
    pad = cfg.data.pad_to_multiple_of
    if not cfg.compile or pad <= 0:
        return []
    lengths = math.ceil(cfg.data.max_seq_length / pad)
    if lengths <= MANY_LENGTHS:
        return []
    return [
        f"compile=true with data.pad_to_multiple_of {pad}: micro-batches come in up to {lengths} lengths "
        f"(data.max_seq_length {cfg.data.max_seq_length} / {pad}); torch recompiles the layers at the first new "
        "length and then treats the length as dynamic (kernels for any length): raise data.pad_to_multiple_of "
        "(64 suits GPU kernels), or set it to 0 (every row data.max_seq_length long, one length); the log and "
        "metrics.jsonl count the recompiles"
    ]


def compile_engine(engine, enabled: bool) -> None:
    """``compile=true``: DeepSpeed's ``engine.compile()``, each layer of this rank's stage compiled on its own with
    the accelerator's backend; compiling happens in the first step that runs each layer."""
    if not enabled:
        return
    import torch._dynamo  # seconds to import: only where compile is on (this module is validate.py's too)

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    engine.compile(backend=get_accelerator().get_compile_backend())


def compiled_here() -> tuple[int, float]:
    """(graphs compiled in this process, seconds spent compiling them, forward and backward): torch._dynamo's own
    counters."""
    from torch._dynamo.utils import calculate_time_spent, counters  # seconds to import: only with compile on

    return counters["stats"]["unique_graphs"], calculate_time_spent()["total_wall_time"]


class CompileLog:
    """The compile figures of a run with ``compile=true``, after each step (a collective: every rank calls it).

    The first step compiles every layer: one line says how long it took (the slowest rank's seconds). A graph
    compiled after the first step is a recompile (a new micro-batch length, eval's first pass): a line whenever
    their count grows. Every train record of metrics.jsonl gets ``recompiles`` (the most of any rank) and
    ``compile_s`` (seconds compiling so far, the slowest rank)."""

    def __init__(self, enabled: bool, first_step: int, log):
        self.enabled, self.first_step, self.log = enabled, first_step, log
        self.graphs_at_first = 0
        self.recompiles = 0

    def after_step(self, step: int) -> dict:
        if not self.enabled:
            return {}
        graphs, seconds = compiled_here()
        if step == self.first_step:
            self.graphs_at_first = graphs
        device = get_accelerator().current_device_name()
        mine = torch.tensor([graphs - self.graphs_at_first, seconds, graphs], dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # [3]: recompiles, seconds, graphs; each the most of any rank
        recompiles, seconds, graphs = int(mine[0]), float(mine[1]), int(mine[2])
        if step == self.first_step:
            self.log(
                f"compile: step {step} compiled the stages' layers (torch.compile, backend "
                f"{get_accelerator().get_compile_backend()}): {graphs} graphs, {seconds:.1f} s compiling (the most of "
                "any rank)"
            )
        elif recompiles > self.recompiles:
            self.log(
                f"compile: {recompiles} graphs recompiled since step {self.first_step} (a new micro-batch length, "
                f"or eval's first pass), by step {step}; {seconds:.1f} s compiling in all"
            )
        self.recompiles = recompiles
        return {"recompiles": recompiles, "compile_s": round(seconds, 2)}
