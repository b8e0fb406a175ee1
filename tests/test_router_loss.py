"""models/router_loss.py: Hugging Face's MoE load-balancing loss from sums that travel through the pipeline stages,
against transformers' own ``load_balancing_loss_func`` (Mixtral's and Qwen3-MoE's), in one process, fp32."""

from __future__ import annotations

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as mixtral_loss
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func as qwen3_moe_loss

from models.router_loss import RouterStats, load_balancing_loss

LAYERS, ROWS, EXPERTS, TOP_K = 4, 12, 8, 2


def gate_logits(seed: int) -> list[torch.Tensor]:
    """One [rows, experts] router output per MoE layer, each a leaf that collects its gradient."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(ROWS, EXPERTS, generator=g).requires_grad_() for _ in range(LAYERS)]


def through_two_stages(logits: list[torch.Tensor], cut: int) -> torch.Tensor:
    """Stage 0 holds layers [:cut], stage 1 the rest. The sums cross the boundary as DeepSpeed passes activations
    (received as new leaves; the gradient of the one that needs it sent back for stage 0's backward)."""
    sent = RouterStats.zeros(EXPERTS)
    for layer in logits[:cut]:
        sent = sent.add_layer(layer, TOP_K)
    received = RouterStats(sent.tokens.detach(), sent.probs.detach().requires_grad_(), sent.rows.detach())
    total = received
    for layer in logits[cut:]:
        total = total.add_layer(layer, TOP_K)
    loss = load_balancing_loss(total)
    loss.backward()  # on stage 1
    if sent.probs.requires_grad:  # stage 0 holds MoE layers (with cut 0 it is all dense and passes zeros on)
        sent.probs.backward(received.probs.grad)
    return loss


@pytest.mark.parametrize("reference", [mixtral_loss, qwen3_moe_loss], ids=["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("cut", [0, 1, 2, 3])
def test_sums_through_the_stages_give_hugging_faces_loss_and_gradients(reference, cut):
    expected_logits, logits = gate_logits(0), gate_logits(0)
    expected = reference(tuple(expected_logits), EXPERTS, TOP_K)
    expected.backward()
    loss = through_two_stages(logits, cut)
    assert torch.equal(loss, expected)  # bit-identical: the same sums, added in the same order
    for ours, theirs in zip(logits, expected_logits):
        assert torch.equal(ours.grad, theirs.grad)


def test_a_loss_per_stage_is_another_number():
    """Each stage over its own layers, summed or averaged: far outside the 1e-6 of the parity tests."""
    logits = gate_logits(1)
    whole = qwen3_moe_loss(tuple(logits), EXPERTS, TOP_K)
    per_stage = []
    for layers in (logits[:2], logits[2:]):
        stats = RouterStats.zeros(EXPERTS)
        for layer in layers:
            stats = stats.add_layer(layer, TOP_K)
        per_stage.append(load_balancing_loss(stats))
    for combined in (sum(per_stage), sum(per_stage) / 2):
        assert abs(combined.item() - whole.item()) / whole.item() > 1e-3, (combined.item(), whole.item())
