"""ZeRO-1 over a data axis of one rank (a pipeline stage with data parallelism 1, one GPU): no gradient all-reduce and
no flat copies of the gradients (training/optim.py's ``no_reduction_over_one_rank``), the same steps to the bit."""

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


def run(precision: str, skip: bool, monkeypatch, ds_extra: dict | None = None) -> tuple[list[float], dict, Calls]:
    """STEPS steps of a 1-stage pipeline on the one rank of the process group, ZeRO-1 as train.py fills it at one
    rank; ``skip``: with ``no_reduction_over_one_rank``. Returns the losses, the weights and the calls of the steps."""
    import deepspeed

    from parallel.layout import Layout
    from parallel.stage import build_pipeline_model, pipeline_topology
    from training.optim import grad_norm_in_one_kernel, no_reduction_over_one_rank, param_groups

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
    with monkeypatch.context() as m:
        calls = Calls(m, engine.optimizer)
        losses = [engine.train_batch(iter(micro_batches(config.vocab_size))).item() for s in range(STEPS)]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, calls


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    import deepspeed
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    dist.destroy_process_group()


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
