"""What a parallel axis's plan is: the steps at which an axis acts on a rank's pipeline stage and its engine.

Each axis (tensor parallelism, parallel/tensor_parallel.py; sequence parallelism, parallel/sequence_parallel.py;
expert parallelism, parallel/expert_parallel.py; the DualPipeV schedule, parallel/dualpipev.py) is one
:class:`AxisPlan` subclass, built from the ``Layout`` alone, that overrides the steps where it acts; every other step
does nothing. ``parallel.stage.axis_plans(layout)`` gives the
plans a layout uses, in the order they apply (tensor, sequence, expert, schedule), and the steps run in this order:

1. ``before_build``: collectives that must precede the stage's own process groups (every rank, in the same order),
   and the attention function the decoder layers call;
2. ``stage_mixin``: a class put before ``LlamaPipelineModule`` in the stage's class: what building, saving and
   loading do with the axis's pieces (``parallel.stage.stage_class``);
3. ``apply``: the built stage changed in place; returns what the loss needs to know of this rank's share (fields of
   ``models.loss.LossSplit``), which ``build_pipeline_model`` hands to the loss;
4. ``ds_config_``: the keys of the DeepSpeed config the axis needs (training/optim.py's ``fill_ds_config``);
5. ``building_engine``: a context around ``deepspeed.initialize`` (training/build.py);
6. ``adopt_engine``: the engine ``deepspeed.initialize`` built, made the axis's (training/build.py);
7. ``announce``: the axis's start-up lines (training/announce.py);
8. ``end_check``: a check at the end of a run (training/loop.py).

A new axis is a new ``Layout`` field, a subclass in its own module, and an entry in ``parallel.stage.AXES``.
"""

from __future__ import annotations

import contextlib

from parallel.layout import Layout


class AxisPlan:
    """One parallel axis applied to a pipeline stage (the steps above); the base does nothing at any step."""

    stage_mixin: type | None = None

    def __init__(self, layout: Layout):
        self.layout = layout

    @staticmethod
    def used(layout: Layout) -> bool:
        """Whether ``layout`` uses this axis."""
        raise NotImplementedError

    def before_build(self, config, topology, attention: str) -> str:
        """Before the stage is built: returns the attention function (a registered name) the decoder layers call,
        given the one the config asks for."""
        return attention

    def apply(self, model) -> dict:
        """The built stage, changed in place; returns fields of ``models.loss.LossSplit`` for this rank's loss."""
        return {}

    def ds_config_(self, ds: dict) -> None:
        """Set the keys of the DeepSpeed config ``ds`` that the axis needs."""

    def building_engine(self) -> contextlib.AbstractContextManager:
        """A context ``deepspeed.initialize`` runs in (expert parallelism: DeepSpeed's MoE paths turned on)."""
        return contextlib.nullcontext()

    def adopt_engine(self, engine) -> None:
        """Make the engine ``deepspeed.initialize`` built the axis's."""

    def announce(self, engine, gather) -> list[str]:
        """The axis's start-up lines; ``gather(what, fn)`` runs ``fn`` on every rank and returns every rank's result
        (training.distributed.on_all_ranks)."""
        return []

    def end_check(self, model, gather) -> tuple[str, str]:
        """At the end of a run: (a problem that stops the run, else "", the line that says the check passed, or "")."""
        return "", ""
