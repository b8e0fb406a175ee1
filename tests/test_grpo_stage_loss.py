"""GRPOLoss on the last pipeline stage computes what a Hugging Face model with models.grpo's TRL formulas computes.

A tiny random Llama's stages chained in one process with the chunked head, over right-padded prompt + completion rows
(prompts and completions of different lengths), two simulated data-parallel ranks of two micro-batches each, every
micro-batch's loss divided by the micro-batches and averaged over ranks as DeepSpeed does: the step's loss and every
parameter's gradient equal LlamaForCausalLM + token_logps_and_entropy + grpo_loss with TRL's own accumulation
(1e-5 relative), for each loss type, beta 0 and > 0, with and without old log-probabilities, at temperature 0.7.
Logits not divided by the temperature, padding left in the mask, or dapo's loss divided by the accumulation steps
twice (TRL's normaliser and DeepSpeed) land far outside that tolerance. The recording pass returns the reference's
per-token log-probabilities, and the per-micro-batch metrics are grpo_loss's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from models.grpo import GRPO_METRICS, GRPOLoss, dapo_normalizer, grpo_loss, token_logps_and_entropy
from models.llama_pipe import build_sequential, spec_layout
from models.loss import IGNORE_INDEX
from models.tiny import tiny_config
from tests.test_stage_parity import copy_hf_weights, module_of, run_chain

TEMPERATURE, CHUNK, MAX_COMPLETION = 0.7, 5, 8
RANKS, MICRO, ROWS = 2, 2, 3  # simulated data-parallel ranks x micro-batches per rank x rows per micro-batch
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def world():
    """The HF model, the same weights as stages, and the step's micro-batches of rows (prompt, completion, advantage,
    old and reference per-token log-probabilities near the policy's: some ratios clipped, a non-zero kl)."""
    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=2)
    hf = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    funcs = build_sequential(config, loss_chunk_tokens=CHUNK)
    copy_hf_weights(funcs, config, hf.state_dict())
    micro_batches = []
    for _ in range(RANKS * MICRO):
        rows = []
        for _ in range(ROWS):
            prompt = torch.randint(3, config.vocab_size, (int(torch.randint(2, 9, ())),))
            completion = torch.randint(3, config.vocab_size, (int(torch.randint(1, MAX_COMPLETION + 1, ())),))
            with torch.no_grad():
                logps, _ = hf_logps(hf, prompt, completion)
            noise = 0.3 * torch.randn(2, len(completion))
            rows.append((prompt, completion, float(torch.randn(())) + 0.3, logps + noise[0], logps + noise[1]))
        micro_batches.append(rows)
    return config, hf, funcs, micro_batches


def hf_logps(hf, prompt, completion, temperature=TEMPERATURE) -> tuple[torch.Tensor, torch.Tensor]:
    """([C], [C]): each completion token's log-probability and the entropy of its tempered distribution, from the
    row run alone (TRL's ``logits[:, -C-1:-1]``)."""
    ids = torch.cat([prompt, completion])[None]
    logits = hf(input_ids=ids, use_cache=False).logits[:, len(prompt) - 1 : -1]  # [1,C,V]
    logps, entropies = token_logps_and_entropy(logits, completion[None], temperature)
    return logps[0], entropies[0]


def stage_batch(rows, pad_in_mask: bool = False):
    """((input_ids, position_ids), (labels, advantages, old, reference)) of right-padded rows, one padding column at
    least; ``pad_in_mask``: the padding labelled too (a masking bug)."""
    seq = max(len(p) + len(c) for p, c, *_ in rows) + 1
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    old, ref = torch.zeros(len(rows), seq), torch.zeros(len(rows), seq)
    for b, (p, c, _, o, r) in enumerate(rows):
        span = slice(len(p), len(p) + len(c))
        ids[b, : len(p)], ids[b, span] = p, c
        labels[b, span], old[b, span], ref[b, span] = c, o, r
        if pad_in_mask:
            labels[b, span.stop :] = 0
    advantages = torch.tensor([a for _, _, a, *_ in rows])
    return (ids, torch.arange(seq).repeat(len(rows), 1)), (labels, advantages, old, ref)


def step_tokens(micro_batches) -> int:
    return sum(len(c) for rows in micro_batches for _, c, *_ in rows)


def hf_step(hf, micro_batches, loss_type, beta, with_old, temperature=TEMPERATURE):
    """TRL's step: each rank sums its micro-batches' grpo_loss (divided by the accumulation steps, dapo by its
    window's normaliser), DDP averages over ranks. Returns (loss, each micro-batch's metrics)."""
    normalizer = dapo_normalizer(step_tokens(micro_batches), RANKS, MICRO, MICRO)
    total, metrics = 0.0, []
    for rows in micro_batches:
        width = max(len(c) for _, c, *_ in rows)
        mask, old, ref = (torch.zeros(len(rows), width) for _ in range(3))
        both = [hf_logps(hf, p, c, temperature) for p, c, *_ in rows]
        pad = lambda values: torch.stack([torch.cat([v, v.new_zeros(width - len(v))]) for v in values])  # noqa: E731
        padded, entropies = pad([lp for lp, _ in both]), pad([e for _, e in both]).detach()
        for b, (_, c, _, o, r) in enumerate(rows):
            mask[b, : len(c)], old[b, : len(c)], ref[b, : len(c)] = 1, o, r
        loss, m = grpo_loss(
            padded,
            torch.tensor([a for _, _, a, *_ in rows]),
            mask,
            old_per_token_logps=old if with_old else None,
            entropies=entropies,
            ref_per_token_logps=ref if beta else None,
            beta=beta,
            loss_type=loss_type,
            max_completion_length=MAX_COMPLETION,
            normalizer=normalizer,
            gradient_accumulation_steps=MICRO,
        )
        total = total + loss / RANKS
        metrics.append((mask.sum(), m))
    return total, metrics


def stage_step(funcs, loss_fn, micro_batches, with_old, pad_in_mask=False, told_micro_batches=MICRO):
    """DeepSpeed's step: each micro-batch's loss divided by the micro-batches, the mean over ranks.
    ``told_micro_batches``: what the loss is told DeepSpeed divides by (1: TRL's division and DeepSpeed's both)."""
    normalizer = dapo_normalizer(step_tokens(micro_batches), RANKS, MICRO, MICRO)
    loss_fn.set_step_normalizer(normalizer, told_micro_batches)
    total = 0.0
    for rows in micro_batches:
        (ids, pos), (labels, adv, old, ref) = stage_batch(rows, pad_in_mask)
        old = old if with_old else torch.empty(0)
        ref = ref if loss_fn.beta else torch.empty(0)
        total = total + loss_fn(run_chain(funcs, ids, pos), (labels, adv, old, ref)) / MICRO / RANKS
    return total


def differences(world, loss_type, beta, with_old, bug=None):
    """(relative difference of the step's loss, largest relative difference of a parameter's gradient, stats,
    reference metrics); ``bug``: what the stage side gets wrong."""
    config, hf, funcs, micro_batches = world
    hf.zero_grad(set_to_none=True)
    for f in funcs:
        module_of(f).zero_grad(set_to_none=True)
    expected, metrics = hf_step(hf, micro_batches, loss_type, beta, with_old)
    expected.backward()
    temperature = 1.0 if bug == "no temperature" else TEMPERATURE
    loss_fn = GRPOLoss(
        CHUNK, temperature=temperature, beta=beta, loss_type=loss_type, max_completion_length=MAX_COMPLETION
    )
    told = 1 if bug == "divided twice" else MICRO
    loss = stage_step(funcs, loss_fn, micro_batches, with_old, bug == "padding in the mask", told)
    loss.backward()
    loss_diff = abs(loss.item() - expected.item()) / abs(expected.item())
    grad_diff, checked = 0.0, 0
    for info in spec_layout(config):
        if info.owns_file:
            for key, param in module_of(funcs[info.index]).named_parameters():
                ref_grad = hf.get_parameter(info.hf_prefix + key).grad
                scale = ref_grad.abs().max().item()
                grad_diff = max(grad_diff, (param.grad - ref_grad).abs().max().item() / scale)
                checked += 1
    assert checked == len(list(hf.parameters()))
    return loss_diff, grad_diff, loss_fn.take_stats(), metrics


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta, with_old", [(0.0, False), (0.0, True), (0.04, False), (0.04, True)])
def test_the_step_loss_and_gradients_are_the_hf_models(world, loss_type, beta, with_old):
    loss_diff, grad_diff, stats, metrics = differences(world, loss_type, beta, with_old)
    assert loss_diff < REL_TOL and grad_diff < REL_TOL, (loss_diff, grad_diff)
    assert stats.shape == (RANKS * MICRO, len(GRPO_METRICS))
    for row, (tokens, m) in zip(stats, metrics):
        expected = [tokens] + [m.get(k, torch.tensor(0.0)) * tokens for k in GRPO_METRICS[1:6]]
        expected += [m["clip_ratio/low_min"], m["clip_ratio/high_max"]]
        torch.testing.assert_close(row, torch.stack(expected).double(), rtol=1e-5, atol=1e-5)
    if with_old:  # the ratios moved: the clip figures are exercised, not zeros
        assert stats[:, 4].sum() > 0
    assert len(GRPOLoss(CHUNK).take_stats()) == 0


@pytest.mark.parametrize("bug", ["no temperature", "padding in the mask", "divided twice"])
def test_wrong_temperature_masking_or_division_is_far_outside_the_tolerance(world, bug):
    loss_diff, grad_diff, _, _ = differences(world, "dapo", 0.04, True, bug)
    assert loss_diff > 100 * REL_TOL and grad_diff > 100 * REL_TOL, (loss_diff, grad_diff)


def test_recording_returns_the_per_token_logps(world):
    _, hf, funcs, micro_batches = world
    loss_fn = GRPOLoss(CHUNK, temperature=TEMPERATURE)
    loss_fn.recording = []
    rows = micro_batches[0]
    (ids, pos), labels = stage_batch(rows)
    with torch.no_grad():
        assert loss_fn(run_chain(funcs, ids, pos), labels).item() == 0.0
        (recorded,) = loss_fn.recording
        assert recorded.shape == ids.shape and len(loss_fn.stats) == 0
        for b, (p, c, *_) in enumerate(rows):
            torch.testing.assert_close(recorded[b, len(p) : len(p) + len(c)], hf_logps(hf, p, c)[0], rtol=0, atol=1e-5)
            assert recorded[b, : len(p)].abs().sum() == 0 and recorded[b, len(p) + len(c) :].abs().sum() == 0


def test_logits_and_missing_settings_are_refused(world):
    with pytest.raises(ValueError, match="loss_chunk_tokens > 0, not 0"):
        GRPOLoss(0)
    with pytest.raises(ValueError, match="needs max_completion_length"):
        GRPOLoss(CHUNK, loss_type="dr_grpo")
    (ids, pos), labels = stage_batch(world[3][0])
    with pytest.raises(ValueError, match="build with loss_chunk_tokens > 0"):
        GRPOLoss(CHUNK)(torch.zeros(*ids.shape, 8), labels)
    with pytest.raises(RuntimeError, match="needs set_step_normalizer"):
        GRPOLoss(CHUNK)(run_chain(world[2], ids, pos), (labels[0], labels[1], torch.empty(0), torch.empty(0)))
