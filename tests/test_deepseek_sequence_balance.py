"""DeepSeek-V3's sequence-wise balance loss in training (moe.sequence_balance_coef) equals the report's formula written
out in plain torch, per packed document: the function on a tiny model's routing, and the stages' loss and every
gradient against DeepseekV3ForCausalLM + the written-out loss in one process (knob 0: the cross entropy alone); the
loss per row or of the unnormalised scores misses by far more than the tolerance; the knob's rules.

Each sequence of the report (arXiv 2412.19437, 2.1.2) is a packed row's document, not the row: a row packs several
training samples and the loss balances each on its own. Per layer the loss is the mean over the micro-batch's
documents (DeepSeek-V2's released ``seq_aux`` code takes the mean over its rows), summed over the MoE layers."""

from __future__ import annotations

import pytest
import torch

from models.family_deepseek_v3 import (
    SequenceBalanceLoss,
    document_balance_terms,
    document_index,
    sequence_balance_loss,
)
from models.llama_pipe import build_sequential
from models.loss import CausalLMLoss
from models.tiny import tiny_config
from tests.test_family_deepseek_v3 import deepseek
from tests.test_stage_parity import TOL, assert_layer_grads_equal, copy_hf_weights, parity_batch, run_chain
from training.configuration.schema import MoEConfig
from training.moe_balance import balance_loss_problems

COEF = 0.5  # large, so that a wrong balance loss shows in the loss (the report's alpha: 0.0001)


def routing(hf) -> dict[int, tuple]:
    """Hooks keeping each routed layer's router output of ``hf``'s last forward: layer -> (logits [T,E], choices
    [T,k])."""
    kept = {}

    def keep(layer):
        def hook(module, args, output):
            kept[layer] = (output[0], output[2])

        return hook

    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(keep(i))
    return kept


def spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """Every document's (start, end) token offsets in the flattened [B*S] micro-batch: a row's first token, or a
    position that does not follow the previous one, starts one."""
    out = []
    for b, row in enumerate(position_ids.tolist()):
        starts = [t for t in range(len(row)) if t == 0 or row[t] != row[t - 1] + 1] + [len(row)]
        out += [(b * len(row) + s, b * len(row) + e) for s, e in zip(starts[:-1], starts[1:])]
    return out


def written_out(logits, choices, documents, normalised: bool = True) -> torch.Tensor:
    """The report's L_Bal / alpha of one layer, a sequence per (start, end) of ``documents``, averaged over them:
    sum_i f_i P_i, f_i = N_r / (K_r T) x (tokens choosing i), P_i = 1/T sum_t s'_{i,t}, s' = s / sum_j s_{j,t}
    (``normalised`` False: s itself, a wrong variant)."""
    experts, k = logits.shape[1], choices.shape[1]
    losses = []
    for start, end in documents:
        t = end - start
        s = logits[start:end].sigmoid()
        s = s / s.sum(1, keepdim=True) if normalised else s
        picks = choices[start:end].tolist()
        f = torch.tensor([experts / (k * t) * sum(i in token for token in picks) for i in range(experts)])
        losses.append((f * s.mean(0)).sum())
    return torch.stack(losses).mean()


def packed_batch(vocab_size: int):
    """parity_batch's rows (padding, a masked prompt, a second document mid-row 1) and a third document in row 2."""
    input_ids, position_ids, labels = parity_batch(vocab_size)
    position_ids[2, 12:] = torch.arange(position_ids.shape[1] - 12)
    return input_ids, position_ids, labels


def test_the_function_is_the_reports_formula_per_document():
    """Each routed layer of a tiny DeepseekV3ForCausalLM on a packed batch (3 rows, 5 documents): the per-expert terms
    sum to the formula written out per document, and equal sequence_balance_loss of each document averaged."""
    config, hf = deepseek()
    kept = routing(hf)
    input_ids, position_ids, _ = packed_batch(config.vocab_size)
    with torch.no_grad():
        hf(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    documents = spans(position_ids)
    assert len(documents) == 5 and document_index(position_ids).max().item() == 4
    assert sorted(kept) == [1, 2]
    for layer, (logits, choices) in kept.items():
        ours = document_balance_terms(logits.sigmoid(), choices, document_index(position_ids)).sum()
        expected = written_out(logits, choices, documents)
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0, msg=f"layer {layer}")
        each = [sequence_balance_loss(logits[s:e].sigmoid(), choices[s:e], COEF) for s, e in documents]
        torch.testing.assert_close(COEF * ours, torch.stack(each).mean(), rtol=1e-6, atol=0)
        assert ours.item() > 0.9  # sum_i f_i P_i >= ~1: balanced f and uniform P give 1


def chained(config, hf, input_ids, position_ids, labels, coef: float = COEF):
    """The stages in one process (coef > 0: built with the balance loss on the wire) with ``hf``'s weights, the loss
    as the pipeline's last stage computes it; (loss, its SequenceBalanceLoss or None, the stages)."""
    funcs = build_sequential(config, sequence_balance=coef > 0)
    copy_hf_weights(funcs, config, hf.state_dict())
    loss_fn = CausalLMLoss()
    if coef:
        loss_fn.router = SequenceBalanceLoss(config.n_routed_experts, config.num_experts_per_tok, coef)
        funcs[-2].router_sink = loss_fn.router.receive  # the norm spec
    return loss_fn(run_chain(funcs, input_ids, position_ids), labels), loss_fn.router, funcs


def test_the_stages_loss_and_gradients_equal_deepseek_v3_with_the_loss_written_out():
    """CE + coef x sum over the MoE layers of the per-document balance loss and every gradient (routers included)
    within TOL of DeepseekV3ForCausalLM's cross entropy + the written-out loss on its routing; per row instead of per
    document, or s instead of s', misses the loss by far more than TOL; knob 0: the cross entropy alone, no wire."""
    config, hf = deepseek()
    kept = routing(hf)
    input_ids, position_ids, labels = packed_batch(config.vocab_size)
    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)
    documents, rows = spans(position_ids), spans(torch.zeros_like(position_ids))
    balance = sum(written_out(logits, choices, documents) for logits, choices in kept.values())
    reference = ref.loss + COEF * balance
    loss, router, funcs = chained(config, hf, input_ids, position_ids, labels)
    assert abs(router.loss_sum - balance.item()) < TOL
    worst = abs(loss.item() - reference.item())
    assert worst < TOL
    misses = {
        "per row": sum(written_out(lo, ch, rows) for lo, ch in kept.values()),
        "s, not s'": sum(written_out(lo, ch, documents, normalised=False) for lo, ch in kept.values()),
    }
    for name, wrong in misses.items():
        miss = abs((ref.loss + COEF * wrong).item() - loss.item())
        print(f"sequence balance loss {name}: {miss:.2e} from the stages' loss (TOL {TOL:g})")
        assert miss > 100 * TOL, name
    reference.backward()
    loss.backward()
    grads = assert_layer_grads_equal(funcs, hf)
    worst = max([worst] + [diff for _, diff in grads])
    assert sum(key == "mlp.gate.weight" for key, _ in grads) == 2
    print(f"deepseek_v3 + sequence balance loss: max |stages - reference| {worst:.1e} (loss {loss.item():.6f})")
    hf.zero_grad()
    off, none, funcs = chained(config, hf, input_ids, position_ids, labels, coef=0.0)
    assert none is None and len(run_chain(funcs[:2], input_ids, position_ids)) == 2  # nothing on the wire
    assert abs(off.item() - ref.loss.item()) < TOL


def test_the_knob_is_refused_where_no_loss_adds_it():
    from parallel.layout import Layout

    def problems(coef, model_type, layout, objective="sft"):
        return balance_loss_problems(MoEConfig(sequence_balance_coef=coef), tiny_config(model_type), layout, objective)

    pipeline, zero3 = Layout(stages=2, dp=1).engine, Layout(stages=1, dp=2, zero=3).engine
    assert problems(0.0001, "deepseek_v3", pipeline) == problems(0.0, "qwen3_moe", zero3, "dpo") == []
    (line,) = problems(-1.0, "deepseek_v3", pipeline)
    assert line.startswith("moe.sequence_balance_coef -1 < 0: set it >= 0")
    lines = problems(0.01, "qwen3_moe", zero3, "dpo")
    assert len(lines) == 3 and all(line.startswith("moe.sequence_balance_coef 0.01") for line in lines)
    assert "qwen3_moe has no DeepSeek-V3 sigmoid router" in lines[0] and "train_objective=dpo" in lines[1]
    assert "num_stages=1" in lines[2] and lines[0].endswith("set moe.sequence_balance_coef=0")


@pytest.mark.slow
def test_the_pipeline_module_adds_it_and_logs_it(tmp_path, monkeypatch):
    """build_pipeline_model with moe.sequence_balance_coef on one rank, activation checkpointing on (the non-reentrant
    checkpoint: two float tensors leave each stage): the loss and the router gradients of the one-process check, the
    metric sequence_balance_loss the mean of the micro-batches', an eval forward the cross entropy alone."""
    import deepspeed
    import torch.distributed as dist

    from parallel.layout import Layout
    from parallel.stage import build_pipeline_model, pipeline_topology
    from training.step import router_metrics

    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        config, hf = deepseek()
        input_ids, position_ids, labels = packed_batch(config.vocab_size)
        expected, router, funcs = chained(config, hf, input_ids, position_ids, labels)
        expected.backward()
        layout = Layout(stages=1, dp=1)
        model = build_pipeline_model(
            config, pipeline_topology(layout), layout, activation_checkpoint_interval=1, sequence_balance_coef=COEF
        )
        copy_hf_weights(model.forward_funcs, config, hf.state_dict())
        model._precompute_checkpointable_values()  # as DeepSpeed's pipeline engine does before the first step
        assert isinstance(model.loss_fn.router, SequenceBalanceLoss) and model.loss_fn.router.coef == COEF
        model.train()
        losses = [model.loss_fn(model((input_ids, position_ids)), labels) for _ in range(2)]
        assert all(abs(loss.item() - expected.item()) < TOL for loss in losses)
        losses[0].backward()
        for i, f in ((2, funcs[2]), (3, funcs[3])):
            torch.testing.assert_close(
                model.forward_funcs[i].mlp.gate.weight.grad, f.mlp.gate.weight.grad, rtol=0, atol=TOL
            )
        metrics = router_metrics(model.loss_fn, True)
        assert abs(metrics["sequence_balance_loss"] - router.loss_sum) < TOL and metrics["expert_load_max"] >= 1.0
        model.eval()
        with torch.no_grad():
            ce = model.loss_fn(model((input_ids, position_ids)), labels)
        assert abs(ce.item() - (expected.item() - COEF * router.loss_sum)) < TOL
    finally:
        dist.destroy_process_group()
