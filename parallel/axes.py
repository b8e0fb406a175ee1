"""The parallel axes (parallel/axis.py says what one is), in the order their plans apply: tensor, sequence, expert,
schedule. Apart from parallel/stage.py so that validation and the planner (parallel/memory_plan.py, which
parallel/stage.py's partitioning imports) can loop over the axes' rules."""

from __future__ import annotations

from parallel.axis import AxisPlan
from parallel.dualpipev import DualPipeVPlan
from parallel.expert_parallel import ExpertParallelPlan
from parallel.sequence_parallel import SequenceParallelPlan
from parallel.tensor_parallel import TensorParallelPlan

AXES: tuple[type[AxisPlan], ...] = (TensorParallelPlan, SequenceParallelPlan, ExpertParallelPlan, DualPipeVPlan)


def grpo_layout_problems(layout, ds_config: str | None = None) -> list[str]:
    """train_objective=grpo's rules on ``layout`` (a ``parallel.layout.Layout``): the pipeline engine's and each
    axis's. Validation, the planner's fit search and estimate_memory ask these same lines."""
    problems = layout.engine.needs_pipeline("train_objective=grpo", ds_config)
    return problems + [p for axis in AXES for p in axis.objective_problems(layout, "grpo")]


def fp8_layout_problems(layout, recipe: str, ds_config: str | None = None) -> list[str]:
    """``fp8`` = ``recipe``'s rules on ``layout``: the pipeline engine's and each axis's (models/fp8.py has the
    settings' own). Validation, the planner's fit search and estimate_memory ask these same lines."""
    problems = layout.engine.needs_pipeline(f"fp8={recipe}", ds_config)
    return problems + [p for axis in AXES for p in axis.fp8_problems(layout, recipe)]
