"""The loss normalisation in one process: CausalLMLoss's scale, put through DeepSpeed's own divisions
(each micro-batch's loss / grad_acc, gradients averaged over data-parallel ranks), gives the gradient of
Hugging Face's loss with ``num_items_in_batch`` over the whole global batch (Trainer's definition)."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from models.loss import IGNORE_INDEX, CausalLMLoss, causal_lm_loss, label_tokens
from models.tiny import tiny_config


def uneven_micro_batches(dp: int, gas: int, seq: int = 24, vocab: int = 300) -> list[list[torch.Tensor]]:
    """[rank][micro-batch] -> labels-masked token rows: even micro-batches 2 label tokens a row, odd ones 20."""
    g = torch.Generator().manual_seed(0)
    ranks = []
    for _ in range(dp):
        batches = []
        for m in range(gas):
            ids = torch.randint(3, vocab, (2, seq), generator=g)  # [B,S]
            labels = ids.clone()
            labels[:, : seq - (3 if m % 2 == 0 else 21)] = IGNORE_INDEX  # a long prompt, a short or long response
            batches.append((ids, labels))
        ranks.append(batches)
    return ranks


def gradients(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_label_tokens_counts_shifted_labels_like_trainer():
    labels = torch.tensor([[5, IGNORE_INDEX, 7, 8], [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 9]])
    assert label_tokens(labels) == 3  # position 0 is never a target: (7, 8) and (9)


def test_scaled_loss_through_deepspeeds_divisions_is_the_global_token_mean():
    torch.manual_seed(0)
    dp, gas = 2, 4
    model = LlamaForCausalLM._from_config(tiny_config(vocab_size=300), attn_implementation="sdpa", dtype=torch.float32)
    ranks = uneven_micro_batches(dp, gas)
    n = sum(label_tokens(labels) for batches in ranks for _, labels in batches)

    # Reference: Trainer's loss for one optimizer step, summed over the micro-batches of all ranks.
    model.zero_grad()
    reference = sum(
        model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(n)).loss
        for batches in ranks
        for ids, labels in batches
    )
    reference.backward()
    ref_grad = gradients(model)

    def engine_step(loss_fn: CausalLMLoss) -> tuple[float, torch.Tensor]:
        """What DeepSpeed does with a loss_fn: backward of loss / gas per micro-batch, gradients and the
        reported loss averaged over dp (here: summed over the simulated ranks, divided by dp)."""
        model.zero_grad()
        reported = 0.0
        for batches in ranks:
            for ids, labels in batches:
                loss = loss_fn(model(input_ids=ids).logits, labels)
                (loss / gas).backward()
                reported += loss.item() / gas
        return reported / dp, gradients(model) / dp

    tokens = CausalLMLoss()
    tokens.scale = gas * dp / n
    loss, grad = engine_step(tokens)
    torch.testing.assert_close(loss, reference.item(), rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-9)

    # The per-micro-batch mean (scale None) is another loss: far outside the tolerance on this data.
    micro, micro_grad = engine_step(CausalLMLoss())
    assert abs(micro - reference.item()) / reference.item() > 100 * 1e-6  # untrained: every token loss near log(V)
    assert (micro_grad - ref_grad).norm() / ref_grad.norm() > 1e-2
    mean_of_means = sum(
        causal_lm_loss(model(input_ids=ids).logits, labels).item() for batches in ranks for ids, labels in batches
    ) / (dp * gas)
    assert abs(micro - mean_of_means) / mean_of_means < 1e-6
