"""DualPipeV (``pipeline_schedule=dualpipev``): glue around DeepSpeed's ``DualPipeVModule`` and engine.

The specs are cut into 2 x num_stages pieces; pipeline rank r builds piece r (phase 0, activations flow
towards the last rank) and piece 2 x num_stages - 1 - r (phase 1, they flow back), so rank 0 holds the
embedding and the LM head (a tied one is a single module there) and reads both the inputs and the labels.
DeepSpeed's ``deepspeed.initialize`` picks ``DualPipeVEngine`` for such a module; it exchanges activation
shapes once (rows are fed whole), sends no bool tensor and needs at least 2 x num_stages micro-batches.
:class:`DualPipeVPlan` applies the schedule (parallel/axis.py's steps); its ``adopt_engine`` makes the engine a
``LlamaDualPipeVEngine``: DualPipe's split of the weight gradients (zero bubble), which DeepSpeed's schedule
leaves out, and eval passes of any length.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import BackwardPass, CommitP2P, DualPipeVSchedule, PipeInstruction
from torch import nn

from models.family_gemma4 import axis_problems as gemma4_axis_problems
from models.llama_pipe import LlamaPipelineModule
from parallel.axis import AxisPlan, ModelFacts, RuleSettings
from parallel.layout import PIPELINE_SCHEDULES, Layout


class WeightPass(PipeInstruction):
    """Compute the weight gradients the oldest deferred backward pass left (zero bubble)."""


class ZeroBubbleDualPipeVSchedule(DualPipeVSchedule):
    """DeepSpeed's ``DualPipeVSchedule`` with the weight gradients split off where DualPipe defers them.

    DeepSpeed's schedule keeps every weight gradient inside ``BackwardPass`` and leaves the places DeepSeek's
    DualPipeV computes deferred ones (its ``weight_chunk``) as bare commits. Here the backward passes DualPipeV
    runs "with zero bubble" (step 3's B1, the second half of step 6, step 7's B0) compute only the gradients of
    their inputs, which the peer waits for (``defer_weights=True``), and a ``WeightPass`` follows each such
    commit (steps 3, 7 and 8) to compute the weights' part of the oldest one: idle time filled with work no
    peer waits for. The instruction stream is DeepSpeed's, step by step; only those instructions change.
    """

    def steps(self):
        if self.forward_only:
            yield from super().steps()
            return
        p, r = self.stages, self.stage_id
        half = (r + 1) // 2  # step 6's first deferred backward: B1 there on odd ranks, B0 on even ones
        lengths = [2 * (p - r - 1), r + 2, p - r - 1, self.micro_batches - 2 * p + r + 1, p - r - 1, r + 1]
        lengths += [p - r - 1, r + 1, 1]
        ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        for index, cmds in enumerate(super().steps()):
            step = next(i for i, end in enumerate(ends) if index < end) + 1
            i = index - (ends[step - 2] if step > 1 else 0)  # the iteration within its step
            if step == 3:  # nB1W1F1: B1 deferred, W after the second commit
                cmds = _defer(cmds, lambda phase: phase == 1)
                cmds = _weight_after_commit(cmds, 2)
            elif step == 6:  # nB1B0, the second half deferred
                cmds = _defer(cmds, lambda phase: i > half or (i == half and (phase == 0 or r % 2 == 1)))
            elif step == 7:  # nWB0: W after the first commit, B0 deferred
                cmds = _weight_after_commit(_defer(cmds, lambda phase: phase == 0), 1)
            elif step == 8:  # nW
                cmds = cmds + [WeightPass()]
            yield cmds


def _defer(cmds: list, deferred) -> list:
    return [
        BackwardPass(c.buffer_id, phase=c.phase, defer_weights=True)
        if isinstance(c, BackwardPass) and deferred(c.phase)
        else c
        for c in cmds
    ]


def _weight_after_commit(cmds: list, nth: int) -> list:
    commits = [i for i, c in enumerate(cmds) if isinstance(c, CommitP2P)]
    at = commits[nth - 1] + 1
    return cmds[:at] + [WeightPass()] + cmds[at:]


class WeightGradStore:
    """Weight gradients put off by the backward passes that run with ``deferring`` set: each such pass's are one
    batch (``flush``), computed oldest first by ``pop`` (a ``WeightPass``)."""

    def __init__(self):
        self.deferring, self.pending, self.batches = False, [], deque()
        self.layers = 0  # linear layers routed through DeferrableLinear

    def flush(self) -> None:
        self.batches.append(self.pending)
        self.pending = []

    def pop(self) -> None:
        for weight, grad_output, inputs in self.batches.popleft():
            # through the leaf's AccumulateGrad, so DeepSpeed's gradient hooks see it as from any backward
            torch.autograd.backward(weight, grad_tensors=grad_output.t() @ inputs)  # [out,N] @ [N,in]


class DeferrableLinear(torch.autograd.Function):
    """``F.linear`` whose weight gradient is queued in ``store`` instead of computed while it defers."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        # the Parameter itself (a leaf that outlives the step), for the deferred accumulation
        ctx.store, ctx.weight, ctx.has_bias = store, weight, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])  # [N,out], [N,in]
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            if ctx.store.deferring:
                ctx.store.pending.append((ctx.weight, grad_2d, x_2d))
            else:
                grad_weight = grad_2d.t() @ x_2d
        return grad_x, grad_weight, grad_bias, None


def defer_linear_weights_(modules, store: WeightGradStore) -> int:
    """Route every plain ``nn.Linear`` of ``modules`` (the decoder's projections and LoRA's adapters; not the
    LM head, a quantised or a tensor-parallel layer, which are subclasses) through ``DeferrableLinear``.
    Returns how many."""
    count = 0
    for module in modules:
        for linear in module.modules():
            if type(linear) is nn.Linear:
                linear.forward = _deferrable_forward(linear, store)
                count += 1
    return count


def _deferrable_forward(linear: nn.Linear, store: WeightGradStore):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return DeferrableLinear.apply(x, linear.weight, linear.bias, store)

    return forward


class LlamaDualPipeVEngine(DualPipeVEngine):
    """DeepSpeed 0.19.8's ``DualPipeVEngine`` with two changes.

    1. Zero bubble: the schedule is :class:`ZeroBubbleDualPipeVSchedule`; a backward pass it marks
       ``defer_weights`` computes its inputs' gradients only (the peer waits for those), the pieces' linear
       layers queueing their weight gradients (:class:`WeightGradStore`), and each ``WeightPass`` computes the
       oldest batch. Every gradient is computed once, as before; only when changes.
    2. Eval passes of any length: its inference schedule numbers a micro-batch's phase-1 slot ``micro_batch +
       num_micro_batches``, while the engine moves labels and turn-around activations to ``buffer_id +
       self.micro_batches`` (the training gradient_accumulation_steps): an eval pass of another length read an
       empty slot (``'NoneType' object has no attribute 'clone'``) or another micro-batch's labels. The engine
       counts the pass's micro-batches while it runs.
    """

    def _train_schedule(self):
        return ZeroBubbleDualPipeVSchedule(
            micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id
        )

    def eval_batch(self, data_iter, *args, num_micro_batches=None, **kwargs):
        training = self.micro_batches
        self.micro_batches = training if num_micro_batches is None else num_micro_batches
        try:
            return super().eval_batch(data_iter, *args, num_micro_batches=num_micro_batches, **kwargs)
        finally:
            self.micro_batches = training

    def _exec_backward_pass(self, buffer_id, phase, defer_weights=False):
        self.weight_grads.deferring = defer_weights
        try:
            DualPipeVEngine._exec_backward_pass(self, buffer_id, phase)
        finally:
            self.weight_grads.deferring = False
        if defer_weights:
            self.weight_grads.flush()

    def _exec_weight_pass(self):
        # as PipelineEngine's backward of a non-loss stage: bf16's low-precision gradients cleared before,
        # added to the fp32 ones after
        bf16 = self.using_bf16_optimizer
        if bf16:
            self.optimizer.clear_lp_grads()
        self._running_engine_backward = True
        try:
            self.weight_grads.pop()
        finally:
            self._running_engine_backward = False
        if bf16 and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    _INSTRUCTION_MAP = {
        **DualPipeVEngine._INSTRUCTION_MAP,
        BackwardPass: _exec_backward_pass,
        WeightPass: _exec_weight_pass,
    }


def wrap_instructions(names, wrap) -> None:
    """Replace each pipeline instruction function named in ``names`` by ``wrap(function)``, in the instruction
    map of every engine class train.py may run (each schedule's engine keeps its own map). Only the maps: the
    DualPipeV engines' instructions call PipelineEngine's through super(), which must not be wrapped twice."""
    for engine in (PipelineEngine, DualPipeVEngine, LlamaDualPipeVEngine):
        for instruction, fn in list(engine._INSTRUCTION_MAP.items()):
            if getattr(fn, "__name__", "") in names:
                engine._INSTRUCTION_MAP[instruction] = wrap(fn)


class LlamaDualPipeVModule(DualPipeVModule, LlamaPipelineModule):
    """The stage's class with DualPipeV (``DualPipeVPlan.stage_class``): DeepSpeed's ``DualPipeVModule`` before
    ``LlamaPipelineModule``, two pieces per rank."""


class DualPipeVPlan(AxisPlan):
    """``pipeline_schedule`` (parallel/axis.py's rules), and the steps of ``pipeline_schedule=dualpipev``.

    The stage: :class:`LlamaDualPipeVModule` (DeepSpeed's split from ``boundaries``, now 2 x num_stages + 1 of them,
    ``Layout.pieces``; its clipping and layer-file fixes), two pieces per rank. DeepSpeed's methods run each per
    piece (``activate_phase``), so layer files keep their global spec index whichever rank wrote them: the
    checkpoint pieces are DeepSpeed's ``DualPipeVModule.save_state_dict`` / ``load_state_dir``.

    The engine: ``deepspeed.initialize`` builds DeepSpeed's ``DualPipeVEngine`` for such a module (it picks the
    class itself, from the module's type); :meth:`adopt_engine` then swaps the engine's class for
    :class:`LlamaDualPipeVEngine`, a subclass that adds no state of its own but the weight-gradient store set here,
    and routes the pieces' linear layers through it (as expert parallelism's does: building the subclass directly
    would mean repeating ``deepspeed.initialize``'s own set-up around the engine's construction)."""

    stage_class = LlamaDualPipeVModule
    checkpoint_pieces = (DualPipeVModule.save_state_dict, DualPipeVModule.load_state_dir)
    harmless_settings = (
        (
            ("data.group_by_length",),
            lambda cfg, layout: not layout.feeds_rows_whole,
            "groups rows of similar length so micro-batches are cut short, but DualPipeV feeds every row whole "
            "(it only reorders the samples): drop data.group_by_length",
        ),
    )

    @staticmethod
    def used(layout: Layout) -> bool:
        return layout.schedule == "dualpipev"

    @staticmethod
    def layout_problems(
        layout: Layout, model: ModelFacts = ModelFacts(), settings: RuleSettings = RuleSettings()
    ) -> list[str]:
        """pipeline_schedule's rules, with the numbers and the knob to change: a known schedule; DualPipeV's 2
        pipeline ranks or more (so the pipeline engine), its 2 x num_stages micro-batches in flight and pieces (of
        the model's ``num_layers`` decoder layers; None: not checked), rows fed whole, no tensor or sequence
        parallelism."""
        if layout.schedule not in PIPELINE_SCHEDULES:
            return [f"pipeline_schedule {layout.schedule!r} unknown: choose one of {list(PIPELINE_SCHEDULES)}"]
        if layout.schedule != "dualpipev":
            return []
        k, num_layers, problems = layout.stages, model.num_layers, []
        problems += gemma4_axis_problems(model.model_type, "pipeline_schedule", layout.schedule)
        if k < 2:
            return [
                f"pipeline_schedule=dualpipev with num_stages {k}: DualPipeV needs 2 pipeline ranks or more; set "
                "num_stages >= 2 or pipeline_schedule=1f1b"
            ]
        if layout.grad_accum < 2 * k:
            problems.append(
                f"pipeline_schedule=dualpipev needs gradient_accumulation_steps >= 2 x num_stages = {2 * k} (each "
                f"rank holds two pieces, {2 * k} in flight); got {layout.grad_accum}: raise gradient_accumulation_steps"
            )
        if num_layers is not None and num_layers >= 1 and 2 * k > num_layers:
            problems.append(
                f"pipeline_schedule=dualpipev cuts the model into 2 x num_stages = {2 * k} pieces, more than its "
                f"{num_layers} decoder layers: set num_stages <= {num_layers // 2}"
            )
        if settings.pad_to_multiple_of:
            problems.append(
                f"pipeline_schedule=dualpipev with data.pad_to_multiple_of {settings.pad_to_multiple_of}: DualPipeV "
                "sends activation shapes once, so every micro-batch must have the same length; set "
                "data.pad_to_multiple_of=0 (rows fed whole; data.packing=true keeps the padding low)"
            )
        for name, n in (("tensor_parallel", layout.tp), ("sequence_parallel", layout.sp)):
            if n > 1:
                problems.append(
                    f"pipeline_schedule=dualpipev with {name} {n} is not supported yet (no parity test of the two "
                    f"together): use {name}=1 or pipeline_schedule=1f1b"
                )
        return problems

    @staticmethod
    def objective_problems(layout: Layout, train_objective: str) -> list[str]:
        """train_objective=grpo: generation runs stage after stage down the 1F1B pipeline."""
        if layout.schedule != "dualpipev" or train_objective != "grpo":
            return []
        return [
            "pipeline_schedule=dualpipev with train_objective=grpo: generation runs stage after stage down the "
            "pipeline (parallel/pipeline_generation.py), not round DualPipeV's V of two pieces per rank; set "
            "pipeline_schedule=1f1b"
        ]

    @staticmethod
    def fp8_problems(layout: Layout, recipe: str) -> list[str]:
        return (
            [
                f"fp8={recipe} with pipeline_schedule=dualpipev: DualPipeV defers the weight gradients of plain "
                "nn.Linear layers only, so torchao's Float8Linear would silently lose the zero bubble (not "
                "checked): set pipeline_schedule=1f1b, or fp8=null"
            ]
            if layout.schedule == "dualpipev"
            else []
        )

    @staticmethod
    def compile_problems(layout: Layout) -> list[str]:
        return (
            [
                "compile=true with pipeline_schedule=dualpipev: DualPipeV's zero bubble queues each linear layer's "
                "weight gradient from inside its backward for a later pass (parallel/dualpipev.py), a side effect "
                "torch.compile does not trace: every linear layer breaks the graph and runs eagerly (14 graphs and 17 "
                "breaks per decoder layer), so compiling buys nothing there: set pipeline_schedule=1f1b, or set "
                "compile=false"
            ]
            if layout.schedule == "dualpipev"
            else []
        )

    @staticmethod
    def warnings(layout: Layout, local_world_size: int) -> list[str]:
        """1F1B with fewer micro-batches than stages: most of each step is the pipeline's bubble."""
        k, micro_batches = layout.stages, layout.grad_accum
        if k > 1 and micro_batches < k and layout.schedule == "1f1b":
            return [
                f"gradient_accumulation_steps {micro_batches} < num_stages {k}: the pipeline bubble dominates "
                f"(ideal efficiency {micro_batches}/{micro_batches + k - 1}); raise gradient_accumulation_steps"
            ]
        return []

    @staticmethod
    def defaults(cfg, is_set) -> list[tuple[str, object, str]]:
        """The defaults DualPipeV cannot run with, for the user's ``pipeline_schedule=dualpipev`` alone: the
        micro-batches in flight, and rows fed whole."""
        k = cfg.num_stages
        if cfg.pipeline_schedule != "dualpipev" or k < 2:
            return []
        adapted = []
        if cfg.gradient_accumulation_steps < 2 * k and not is_set("gradient_accumulation_steps"):
            adapted.append(
                ("gradient_accumulation_steps", 2 * k, f"DualPipeV keeps 2 x num_stages = {2 * k} in flight")
            )
        if cfg.data.pad_to_multiple_of and not is_set("data.pad_to_multiple_of"):
            adapted.append(("data.pad_to_multiple_of", 0, "DualPipeV sends activation shapes once: rows fed whole"))
        return adapted

    def adopt_engine(self, engine) -> None:
        if type(engine) is not DualPipeVEngine:
            return
        engine.__class__ = LlamaDualPipeVEngine
        engine.weight_grads = WeightGradStore()
        pieces = [m for funcs in engine.module.phase_funcs for m in funcs if isinstance(m, nn.Module)]
        engine.weight_grads.layers = defer_linear_weights_(pieces, engine.weight_grads)

    def announce(self, engine, gather) -> list[str]:
        deferring = gather("counting deferrable layers", lambda: engine.weight_grads.layers)
        return [
            f"schedule: DualPipeV, {self.layout.pieces} pieces, two per pipeline rank; zero bubble: the weight "
            f"gradients of {', '.join(map(str, deferring))} linear layers (per rank) deferred where DualPipe does"
        ]


def short_eval_problem(layout: Layout, name: str, count: int) -> str:
    """An eval set of ``count`` samples too short for one DualPipeV pass (``Layout.least_micro_batches`` per
    data-parallel rank), in training's words; "" when it is long enough, or the schedule is 1F1B."""
    micro, dp, least = layout.micro_batch, layout.dp, layout.least_micro_batches
    if layout.schedule != "dualpipev" or count // dp // micro >= least:
        return ""
    return (
        f"the eval set{f' {name}' if name else ''} has {count} samples: {count // dp // micro} "
        f"micro-batches per data-parallel rank (micro_batch_size {micro} x dp {dp}), and DualPipeV "
        f"needs {least} per pass (2 x num_stages): add eval data, raise data.eval_fraction, or lower "
        "micro_batch_size"
    )
