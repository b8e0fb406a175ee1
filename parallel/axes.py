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
