"""DeepSpeed's ZeRO-1 bookkeeping around a step made cheaper by training/optim.py, the same steps to the bit: over a
data axis of one rank (a pipeline stage with data parallelism 1, one GPU) no gradient all-reduce and no flat copies
of the gradients (``no_reduction_over_one_rank``); bf16's check for inf or NaN gradients in one foreach norm
(``overflow_check_in_one_kernel``)."""

from __future__ import annotations

import pytest
import torch

from models.tiny import tiny_config

pytestmark = pytest.mark.slow

STEPS, GAS, SEQ = 3, 2, 16


def micro_batches(vocab: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(GAS):
        ids = torch.randint(3, vocab, (1, SEQ), generator=g)
        out.append(((ids, torch.arange(SEQ).unsqueeze(0)), ids.clone()))
    return out


class Calls:
    """Counts deepspeed.comm.all_reduce calls and the ZeRO optimizer's flattening of gradient lists (flat copies)."""

    def __init__(self, monkeypatch, optimizer):
        import deepspeed.comm

        self.all_reduce, self.flatten = 0, 0
        reduce, flatten = deepspeed.comm.all_reduce, optimizer.flatten

        def counted_reduce(*args, **kwargs):
            self.all_reduce += 1
            return reduce(*args, **kwargs)

        def counted_flatten(tensors):
            self.flatten += 1
            return flatten(tensors)

        monkeypatch.setattr(deepspeed.comm, "all_reduce", counted_reduce)
        monkeypatch.setattr(optimizer, "flatten", counted_flatten)


def run(
    precision: str, skip: bool, monkeypatch, ds_extra: dict | None = None, overflow_check: bool = False, poison=None
) -> tuple[list[float], dict, Calls]:
    """STEPS steps of a 1-stage pipeline on the one rank of the process group, ZeRO-1 as train.py fills it at one
    rank; ``skip``: with ``no_reduction_over_one_rank``; ``overflow_check``: with ``overflow_check_in_one_kernel``;
    ``poison(model)`` before the steps. Returns the losses, the weights and the calls of the steps."""
    import deepspeed

    from parallel.layout import Layout
    from parallel.stage import build_pipeline_model, pipeline_topology
    from training.optim import (
        grad_norm_in_one_kernel,
        no_reduction_over_one_rank,
        overflow_check_in_one_kernel,
        param_groups,
    )

    config = tiny_config(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    layout = Layout(stages=1, dp=1)
    torch.manual_seed(0)
    model = build_pipeline_model(config, pipeline_topology(layout), layout)
    ds = {
        "train_batch_size": GAS,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": 1, "reduce_scatter": False, "contiguous_gradients": False},
        **(ds_extra or {}),
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1), config=ds)
    grad_norm_in_one_kernel(engine.optimizer)
    if skip:
        no_reduction_over_one_rank(engine.optimizer)
    if overflow_check:
        overflow_check_in_one_kernel(engine.optimizer)
    if poison is not None:
        poison(model)
    with monkeypatch.context() as m:
        calls = Calls(m, engine.optimizer)
        losses = [engine.train_batch(iter(micro_batches(config.vocab_size))).item() for s in range(STEPS)]
    calls.skipped_steps = engine.skipped_steps
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_rank_steps_without_the_reduction_are_the_same_to_the_bit(one_rank, monkeypatch, precision):
    losses, weights, calls = run(precision, False, monkeypatch)
    skipped_losses, skipped_weights, skipped = run(precision, True, monkeypatch)
    assert skipped_losses == losses
    for name, w in weights.items():
        assert torch.equal(skipped_weights[name], w), name
    # DeepSpeed's gradient all-reduce, one per step (one dtype, one bucket), gone; bf16's overflow flag's stays
    assert skipped.all_reduce == calls.all_reduce - STEPS == (STEPS if precision == "bf16" else 0), calls.all_reduce
    assert skipped.flatten < calls.flatten, (skipped.flatten, calls.flatten)  # the bucket's flat copy is gone
    assert losses[-1] < losses[0]  # it trains (the same micro-batches each step)


def test_a_reduction_that_would_round_is_left_to_deepspeed(one_rank, monkeypatch):
    """Gradients in fp32 reduced in bf16 (``communication_data_type``): DeepSpeed's reduction rounds them, so the
    skip must not apply, and the steps are DeepSpeed's whatever the skip."""
    bf16_comm = {"communication_data_type": "bf16"}
    losses, weights, calls = run("fp32", False, monkeypatch, bf16_comm)
    skipped_losses, skipped_weights, skipped = run("fp32", True, monkeypatch, bf16_comm)
    assert skipped_losses == losses and skipped.all_reduce == calls.all_reduce == STEPS
    unrounded, _, _ = run("fp32", True, monkeypatch)
    assert unrounded != losses  # the rounding shows in the losses: a skip here would change them


def overflow_cases(device: str) -> dict[str, list]:
    big = torch.finfo(torch.float32).max
    finite = [torch.randn(300), torch.full((7,), big), torch.empty(0), torch.randn(40).bfloat16(), None]
    finite.append(torch.full((5,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16))
    cases = {"finite": finite}
    for name, value in (("nan", float("nan")), ("inf", float("inf")), ("-inf", -float("inf"))):
        for dtype in (torch.float32, torch.bfloat16):
            bad = torch.randn(50).to(dtype)
            bad[17] = value
            cases[f"{name} {dtype}"] = [*finite[:3], bad, *finite[3:]]
    return {name: [None if g is None else g.to(device) for g in grads] for name, grads in cases.items()}


def assert_overflow_check_is_deepspeeds(device: str) -> None:
    """Gradients on ``device`` with a NaN, +inf or -inf (fp32, bf16) among finite ones as large as the dtype holds, an
    empty one and a missing one: the same answer as DeepSpeed's per-gradient check, in a few ops whatever their
    number (tests/test_gpu_parity.py: on a GPU)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from tests.test_config import ops_of
    from training.optim import overflow_check_in_one_kernel

    optimizer = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)  # what the check reads of it, no more
    optimizer.bit16_groups = [[], []]
    serial = DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial.__get__(optimizer)
    overflow_check_in_one_kernel(optimizer)
    for name, grads in overflow_cases(device).items():
        optimizer.averaged_gradients = {0: grads[:4], 1: grads[4:]}
        ours, theirs = optimizer.has_overflow_partitioned_grads_serial(), serial()
        assert ours.shape == theirs.shape == (1,) and ours.dtype == theirs.dtype == torch.bool, name
        assert ours.device == theirs.device and ours.item() == theirs.item() == (name != "finite"), name
    ours_ops = []
    for grads in ([torch.randn(64, device=device)], [torch.randn(64, device=device).bfloat16() for _ in range(40)]):
        optimizer.averaged_gradients = {0: grads, 1: []}
        ours_ops.append(len(ops_of(lambda *_: optimizer.has_overflow_partitioned_grads_serial(), None, None)))
    assert ours_ops[0] == ours_ops[1] < 16, ours_ops  # launches per step: not per gradient
    assert len(ops_of(lambda *_: serial(), None, None)) >= 4 * len(grads)


def test_the_overflow_check_in_one_kernel_is_deepspeeds():
    assert_overflow_check_is_deepspeeds("cpu")


def test_bf16_steps_with_the_overflow_check_in_one_kernel_are_deepspeeds(one_rank, monkeypatch):
    """bf16 steps with the one-kernel check: the same losses and weights to the bit; with a NaN weight the same steps
    skipped (non-finite gradients: DeepSpeed skips the update)."""
    losses, weights, calls = run("bf16", True, monkeypatch)
    ours_losses, ours_weights, ours = run("bf16", True, monkeypatch, overflow_check=True)
    assert ours_losses == losses and calls.skipped_steps == ours.skipped_steps == 0
    assert all(torch.equal(ours_weights[n], w) for n, w in weights.items())

    def poison(model):
        with torch.no_grad():
            next(p for n, p in model.named_parameters() if "mlp" in n).view(-1)[0] = float("nan")

    _, weights, calls = run("bf16", True, monkeypatch, poison=poison)
    _, ours_weights, ours = run("bf16", True, monkeypatch, overflow_check=True, poison=poison)
    assert calls.skipped_steps == ours.skipped_steps == STEPS
    for name, w in weights.items():
        torch.testing.assert_close(ours_weights[name], w, rtol=0, atol=0, equal_nan=True)
