"""adamw_impl=deepspeed (DeepSpeed's FusedAdam) trains what torch's fused AdamW trains, and resumes from its checkpoint.

In train.py, 4 CPU ranks, fp32: run A (conftest, torch's fused AdamW, pipe 2 x data 2, ZeRO-1) resumed at step 4 with
DeepSpeed's FusedAdam (its C++ op on CPU) trains steps 5-8 as A did. A change of adamw_impl reads the saved optimizer
states per parameter (training/checkpoints/reshard.py: torch's AdamW keeps its step count in a tensor, FusedAdam in a
Python int), so this checks both the optimizer's numbers and that hand-over; Adam's moments left at zero would be 3.2e-3
off at step 6 (tests/test_reshard.py). The first run on a machine JIT-builds DeepSpeed's fused_adam op (about a minute
on 2 cores, then cached in the virtualenv's torch_extensions)."""

from __future__ import annotations

import pytest

from tests.test_reshard import assert_continues_a, resume

pytestmark = pytest.mark.multirank


def test_deepspeed_fused_adam_continues_torch_fused_adamw_exactly(run_a):
    root = run_a[0]
    out, stdout = resume(root, "fused_adam", root / "A", "global_step4", adamw_impl="deepspeed")
    assert "adamw_impl 'torch_fused' -> 'deepspeed'" in stdout and "read per parameter" in stdout
    assert_continues_a(root, out, 5)
