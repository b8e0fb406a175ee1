"""Gemma's final_logit_softcapping (cap x tanh(logits / cap)) in every loss and sample: with the cap at 2, the stages'
loss and gradients equal ``Gemma3ForCausalLM``'s and ``Gemma4ForCausalLM``'s within 1e-6 (the loss relative) on whole
logits, the chunked loss and DPO's sequence log-probabilities, and miss by far more without it; the chunked loss's
hand-written backward, GRPO's tempered log-probabilities and entropies equal autograd through the cap; sampling equals
``generate``'s; loss_impl=liger with a cap is refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.families import family_of
from models.grpo import GRPOLoss
from models.kernels import loss_impl_problems
from models.llama_pipe import build_sequential
from models.loss import (
    IGNORE_INDEX,
    CausalLMLoss,
    chunked_causal_lm_loss,
    liger_head_losses,
    logit_softcap,
    sequence_logps,
    soft_capped,
)
from models.tiny import tiny_config
from tests.test_stage_parity import copy_hf_weights, module_of, parity_batch, run_chain

TOL = 1e-6
CAP = 2.0  # the tiny models' logits reach ~4-8: tanh bends them (at 30, the releases' cap, it would be ~identity)
CHUNK = 16


def capped_model(model_type: str, tied: bool):
    """(the family's ForCausalLM, fp32, with random norms so no layer is an identity; its config) at cap ``CAP``."""
    config = tiny_config(
        model_type,
        vocab_size=300,
        intermediate_size=96,
        initializer_range=0.2,
        final_logit_softcapping=CAP,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    hf = family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return hf, config


def stage_grads(funcs, config) -> dict[str, torch.Tensor]:
    """Each stage parameter's gradient under its Hugging Face name (a tied head's counted once, at spec 0)."""
    from models.specs import spec_layout

    return {
        info.hf_prefix + key: p.grad
        for info in spec_layout(config)
        if info.owns_file
        for key, p in module_of(funcs[info.index]).named_parameters()
    }


def worst_grad(funcs, config, hf) -> float:
    grads = stage_grads(funcs, config)
    assert len(grads) == len(list(hf.parameters()))
    return max((g - hf.get_parameter(name).grad).abs().max().item() for name, g in grads.items())


def hf_sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TRL's per-row summed log-probabilities of the label tokens from Hugging Face's (capped) logits."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    picked = logp.gather(2, targets.clamp(min=0)[..., None]).squeeze(2)
    return (picked * mask).double().sum(dim=1)


def run_path(hf, config, path: str, softcap) -> tuple[float, float]:
    """(|loss - Hugging Face's| / |Hugging Face's|, largest |gradient - Hugging Face's|) of ``path`` with the loss
    capped at ``softcap``: ``full`` (whole logits), ``chunked`` (loss_chunk_tokens 16) or ``dpo`` (sequence_logps,
    chunked: a signed weighting of the rows' log-probabilities, as the DPO loss takes differences of them). The loss
    relative: one of ~5 has fp32 steps of 5e-7, and the two sum its tokens in another order."""
    torch.manual_seed(1)
    input_ids, position_ids, labels = parity_batch(config.vocab_size, packed=False)
    hf.zero_grad()
    out = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)
    # attention=dense_mask (transformers' masks and sdpa, as Hugging Face's): the layers' outputs bit-equal, so what
    # differs is the loss's alone (the per-document kernel's fp32 rounding alone reaches ~4e-6 on Gemma 4's gradients)
    funcs = build_sequential(config, loss_chunk_tokens=0 if path == "full" else CHUNK, attention="sdpa")
    copy_hf_weights(funcs, config, hf.state_dict())
    outputs = run_chain(funcs, input_ids, position_ids)
    if path == "dpo":
        # per row, over the batch's label tokens: sums of ~35 log-probabilities at the scale of a mean (fp32 sums)
        weights = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64) / (labels[:, 1:] != IGNORE_INDEX).sum()
        ref = (hf_sequence_logps(out.logits, labels) * weights).sum()
        loss = (sequence_logps(outputs, labels, CHUNK, softcap=softcap) * weights).sum()
    else:
        ref = out.loss
        loss = CausalLMLoss(0 if path == "full" else CHUNK, softcap=softcap)(outputs, labels)
    ref.backward()
    loss.backward()
    return abs(loss.item() - ref.item()) / abs(ref.item()), worst_grad(funcs, config, hf)


@pytest.mark.slow  # a tiny model through the stages and Hugging Face, three paths twice (~0.25 s each)
@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma4_text"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_capped_losses_equal_hugging_faces(model_type, tied):
    hf, config = capped_model(model_type, tied)
    assert logit_softcap(config) == CAP
    with torch.no_grad():
        raw = hf.lm_head(hf.model(torch.arange(40)[None]).last_hidden_state)
    assert raw.abs().max() > 2 * CAP  # the cap bites: tanh is far from the identity on these logits
    for path in ("full", "chunked", "dpo"):
        loss_diff, grad_diff = run_path(hf, config, path, CAP)
        miss_loss, miss_grad = run_path(hf, config, path, None)
        print(
            f"{model_type} {'tied' if tied else 'untied'} {path}: |loss - HF| / |HF| {loss_diff:.1e}, "
            f"grads {grad_diff:.1e}; uncapped: {miss_loss:.1e}, {miss_grad:.1e}"
        )
        assert loss_diff < TOL and grad_diff < TOL, (path, loss_diff, grad_diff)
        assert miss_loss > 1000 * TOL and miss_grad > 100 * TOL, (path, miss_loss, miss_grad)


def test_chunked_backward_and_grpo_equal_autograd_through_the_cap():
    """ChunkedLMHeadLoss's hand-written backward (with a tail chunk), GRPO's tempered log-probabilities (the cap
    before the temperature, as TRL tempers Gemma's capped logits) and entropies, against autograd on capped logits."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :3] = IGNORE_INDEX
    logits = hidden @ weight.t()
    assert logits.abs().max() > 4 * CAP
    ref = F.cross_entropy(soft_capped(logits[:, :-1], CAP).reshape(-1, 50), labels[:, 1:].reshape(-1))
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    loss = chunked_causal_lm_loss(hidden, weight, labels, 5, softcap=CAP)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert abs(loss.item() - ref.item()) < TOL
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=TOL)
    uncapped = torch.autograd.grad(chunked_causal_lm_loss(hidden, weight, labels, 5), (hidden, weight))
    assert (uncapped[0] - ref_grads[0]).abs().max() > 0.1

    temperature = 0.7
    grpo = GRPOLoss(5, temperature=temperature, softcap=CAP)
    logps, rows, positions, entropies = grpo.token_logps((hidden, weight), labels, entropy=True)
    tempered = F.log_softmax(soft_capped(logits, CAP) / temperature, dim=-1)  # [2,9,50]
    want = tempered[rows, positions - 1].gather(1, labels[rows, positions][:, None]).squeeze(1)
    torch.testing.assert_close(logps, want, rtol=0, atol=TOL)
    want_entropy = -(tempered.exp() * tempered).sum(-1)[rows, positions - 1]
    torch.testing.assert_close(entropies, want_entropy, rtol=0, atol=TOL)


def test_liger_with_a_cap_and_the_cap_of_other_families_are_named():
    """loss_impl=liger is refused with a cap (before start and in the loss); a llama config carrying the key is
    uncapped, as LlamaForCausalLM ignores it."""
    (line,) = loss_impl_problems("liger", 1024, None, cuda=True, importable=True, softcap=30.0)
    assert line.startswith("loss_impl=liger with final_logit_softcapping 30 ") and line.endswith("chunk by chunk)")
    assert loss_impl_problems("chunked", 1024, None, softcap=30.0) == []
    with pytest.raises(ValueError, match="loss_impl=liger with final_logit_softcapping 2 "):
        liger_head_losses(
            torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(1, dtype=torch.long), torch.zeros(1), "sum", 2.0
        )
    llama = tiny_config("llama")
    llama.final_logit_softcapping = 30.0
    assert logit_softcap(llama) is None


@pytest.mark.slow  # DeepSpeed's pipeline module in one process (~0.5 s)
def test_the_stage_build_hands_the_cap_to_the_loss_and_refuses_a_loss_without_it(tmp_path, monkeypatch):
    """parallel/stage.py's build: its own loss takes the config's cap, and the model's loss equals Hugging Face's; a
    given loss of another cap (training/build.py's build_loss passes the config's) is refused by name."""
    import deepspeed
    import torch.distributed as dist

    from parallel.layout import Layout
    from parallel.stage import build_pipeline_model, pipeline_topology

    hf, config = capped_model("gemma3_text", tied=True)
    input_ids, position_ids, labels = parity_batch(config.vocab_size, packed=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        layout = Layout(stages=1, dp=1, loss_chunk=CHUNK)
        model = build_pipeline_model(config, pipeline_topology(layout), layout, attention="sdpa")
        with pytest.raises(ValueError, match="loss_fn caps the logits at None, the model config's final_logit_soft"):
            build_pipeline_model(config, pipeline_topology(layout), layout, CausalLMLoss(CHUNK))
    finally:
        dist.destroy_process_group()
    assert model.loss_fn.softcap == CAP
    copy_hf_weights(model.forward_funcs, config, hf.state_dict())
    loss = model.loss_fn(model((input_ids, position_ids)), labels)
    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False).loss
    assert abs(loss.item() - ref.item()) < TOL * ref.item()


@pytest.mark.slow  # generation through the stages and generate (~0.2 s each)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_sampling_equals_generate_with_the_cap(tied):
    """Greedy tokens are the cap's too (tanh is monotone); sampled ones change with it: without it they differ."""
    from tests.test_generation import (
        PROMPTS,
        SAMPLING,
        SPLITS,
        assert_equals_hf,
        eos_for_some_rows,
        hf_generate,
        ours,
        pair,
        stages_of,
    )

    hf, funcs = pair("gemma3_text", final_logit_softcapping=CAP, tie_word_embeddings=tied)
    ref = assert_equals_hf(hf, funcs, [SPLITS["norm_with_head"], SPLITS["head_alone"]], 0)
    eos = eos_for_some_rows(hf_generate(hf, PROMPTS, 2, 0, **SAMPLING))  # assert_equals_hf's
    head = funcs[-1].args[0] if tied else funcs[-1]
    head.logit_softcap = None
    assert ours(stages_of(funcs, SPLITS["head_alone"]), PROMPTS, eos, 0, **SAMPLING) != ref
