"""The chunked LM-head loss (``loss_chunk_tokens``, models/loss.py) computes the logits path's loss and gradients with
several times less memory, in one process.

The loss and every gradient equal the logits path's (fp32, 1e-6 relative), through the stage chain too, where both also
equal the family's ``ForCausalLM``; bf16 computes each chunk's loss in fp32; wrong variants (a shift off
by one, a dropped last chunk, the wrong token count) miss the tolerance by far; and the loss side's peak
memory is several times lower (every tensor counted, benchmarks/bench_loss_memory.py).
The 4-rank runs, chunked against unchunked, are in tests/test_sft_parity.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.families import family_of
from models.llama_pipe import LlamaStack, build_sequential, build_specs, expected_state_shapes, spec_layout
from models.loss import (
    IGNORE_INDEX,
    CausalLMLoss,
    ChunkedLMHeadLoss,
    chunked_causal_lm_loss,
    label_tokens,
    shifted_targets,
)
from models.tiny import tiny_config
from tests.support.scripts import load_entry_point
from tests.test_stage_parity import TOL, copy_hf_weights, module_of, parity_batch, run_chain

bench = load_entry_point("benchmarks/bench_loss_memory.py")

REL_TOL = 1e-6  # chunked vs unchunked, fp32: loss and every gradient (relative L2 over the tensor)
LABEL_TOKENS = 96  # of loss_batch
# 32 divides the label tokens, 25 does not (a last, partial chunk), 96 is all of them, 4096 more.
CHUNKS = [1, 25, 32, LABEL_TOKENS, 4096]
# scale None: the per-micro-batch mean; a scale: sum x scale (micro-batches x dp / global label tokens).
SCALES = [None, 4 * 2 / 300]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 difference of ``a`` from the reference ``b``."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def loss_batch(dtype: torch.dtype = torch.float32, hidden: int = 32, vocab: int = 300):
    """(hidden [3,40,H], weight [V,H], labels [3,40]) with padding and a masked prompt: 96 label tokens."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 40, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, vocab, (3, 40), generator=g)
    labels[0, 26:] = IGNORE_INDEX  # padding: 25 label tokens after the shift
    labels[2, :8] = IGNORE_INDEX  # a masked prompt: 32 label tokens; row 1 has 39
    assert label_tokens(labels) == LABEL_TOKENS
    return h, w, labels


def loss_and_grads(loss_fn: CausalLMLoss, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunked: bool):
    """(loss, d/d hidden, d/d weight): through the chunked loss, or through the [B,S,V] logits."""
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = loss_fn((h, w) if chunked else F.linear(h, w), labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("scale", SCALES, ids=["micro_batch", "tokens"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_loss_and_gradients_equal_the_logits_path(chunk, scale):
    h, w, labels = loss_batch()
    reference, chunked = CausalLMLoss(), CausalLMLoss(chunk)
    reference.scale = chunked.scale = scale
    ref_loss, ref_gh, ref_gw = loss_and_grads(reference, h, w, labels, chunked=False)
    loss, gh, gw = loss_and_grads(chunked, h, w, labels, chunked=True)
    assert loss.dtype == torch.float32
    assert rel(loss, ref_loss) < REL_TOL and rel(gh, ref_gh) < REL_TOL and rel(gw, ref_gw) < REL_TOL
    # Ignored positions (and each row's last, which predicts nothing) get no gradient.
    assert gh[0, 25:].abs().max() == 0 and gh[2, :7].abs().max() == 0 and gh[:, -1].abs().max() == 0
    assert gh[0, 24].abs().max() > 0


def test_sum_and_mean_reductions_match_causal_lm_loss_definitions():
    h, w, labels = loss_batch()
    total = chunked_causal_lm_loss(h, w, labels, 25, reduction="sum")
    torch.testing.assert_close(total / LABEL_TOKENS, chunked_causal_lm_loss(h, w, labels, 25), rtol=1e-7, atol=0)
    manual = sum(  # position t predicts label t+1, token by token
        F.cross_entropy(F.linear(h[b, t], w)[None], labels[b, t + 1 : t + 2], reduction="sum")
        for b in range(3)
        for t in range(39)
        if labels[b, t + 1] != IGNORE_INDEX
    )
    assert rel(total, manual) < REL_TOL
    with pytest.raises(ValueError, match="reduction"):
        chunked_causal_lm_loss(h, w, labels, 25, reduction="none")


def test_wrong_variants_miss_the_tolerance_by_far():
    """The tolerance tells right from wrong: a shift off by one, a last partial chunk dropped, the mean
    over every position instead of the label tokens all differ by more than 1000 x REL_TOL."""
    h, w, labels = loss_batch()
    right = chunked_causal_lm_loss(h, w, labels, 25, reduction="sum")
    hidden = h.reshape(-1, h.size(-1))  # [N,H]

    def summed(targets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return ChunkedLMHeadLoss.apply(hidden, w, rows, targets[rows], 25)

    unshifted = labels.reshape(-1)  # position t scored against its own token: off by one
    assert rel(summed(unshifted, (unshifted != IGNORE_INDEX).nonzero().squeeze(1)), right) > 1000 * REL_TOL
    shifted = shifted_targets(labels)
    rows = (shifted != IGNORE_INDEX).nonzero().squeeze(1)
    assert rel(summed(shifted, rows[: LABEL_TOKENS // 25 * 25]), right) > 1000 * REL_TOL  # 21 tokens lost
    assert rel(right / labels.numel(), right / LABEL_TOKENS) > 1000 * REL_TOL


@pytest.mark.parametrize("chunk", [7, 4096])
def test_bf16_loss_is_fp32_per_chunk_and_follows_the_bf16_logits_path(chunk):
    """bf16 hidden states and head: each chunk's logits are computed in bf16 and upcast, as the logits
    path upcasts the whole logits, so the loss agrees to fp32 rounding; the hidden-state gradient is the
    same bf16 matmul; the head's gradient is summed over chunks in bf16 (a rounding per chunk)."""
    h, w, labels = loss_batch(torch.bfloat16)
    ref_loss, ref_gh, ref_gw = loss_and_grads(CausalLMLoss(), h, w, labels, chunked=False)
    loss, gh, gw = loss_and_grads(CausalLMLoss(chunk), h, w, labels, chunked=True)
    assert loss.dtype == ref_loss.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
    assert rel(loss, ref_loss) < 1e-5
    assert rel(gh, ref_gh) < 1e-2 and rel(gw, ref_gw) < 1e-2
    fp32_loss, *_ = loss_and_grads(CausalLMLoss(chunk), h.float(), w.float(), labels, chunked=True)
    assert rel(loss, fp32_loss) > 1e-5  # the bf16 inputs do matter: the comparison above is not vacuous


def hf_and_stages(config, chunk: int):
    """The family's ForCausalLM, and its weights in a stage chain built unchunked and with ``chunk``."""
    hf = family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    plain, chunked = build_sequential(config), build_sequential(config, chunk)
    copy_hf_weights(plain, config, hf.state_dict())
    copy_hf_weights(chunked, config, hf.state_dict())
    return hf, plain, chunked


def stage_grads(funcs, config) -> dict[str, torch.Tensor]:
    """Hugging Face name -> gradient, for every parameter of the chain (a tied one once)."""
    return {
        info.hf_prefix + key: param.grad
        for info in spec_layout(config)
        if info.owns_file
        for key, param in module_of(funcs[info.index]).named_parameters()
    }


@pytest.mark.parametrize("scale", SCALES, ids=["micro_batch", "tokens"])
@pytest.mark.parametrize(
    "model_type, overrides",
    [("llama", {}), ("llama", dict(tie_word_embeddings=True)), ("qwen3", dict(tie_word_embeddings=True))],
    ids=["llama", "llama_tied", "qwen3_tied"],
)
def test_stage_chain_chunked_equals_unchunked_and_hf(model_type, overrides, scale):
    """Stages chained in one process, chunk 25 (not dividing the batch's 103 label tokens): loss and every
    gradient equal the logits path's to 1e-6, and the family's ForCausalLM's to the stage-parity TOL;
    with tied embeddings the shared weight's gradient sums the embedding's and the head's."""
    torch.manual_seed(0)
    config = tiny_config(model_type, vocab_size=300, hidden_size=64, intermediate_size=96, **overrides)
    input_ids, position_ids, labels = parity_batch(config.vocab_size)
    n = label_tokens(labels)
    assert n % 25 != 0
    hf, plain, chunked = hf_and_stages(config, 25)
    plain_out, chunked_out = run_chain(plain, input_ids, position_ids), run_chain(chunked, input_ids, position_ids)
    head_weight = module_of(chunked[0 if config.tie_word_embeddings else -1]).weight
    assert plain_out.shape == (*input_ids.shape, config.vocab_size)  # logits [B,S,V]
    assert chunked_out[0].shape == (*input_ids.shape, config.hidden_size)
    assert chunked_out[1]._base is head_weight  # a view of the head weight (models.llama_pipe.handed_out)

    plain_fn, chunked_fn = CausalLMLoss(), CausalLMLoss(25)
    plain_fn.scale = chunked_fn.scale = None if scale is None else 1 / n  # 1 / n: HF's num_items_in_batch
    plain_loss, chunked_loss = plain_fn(plain_out, labels), chunked_fn(chunked_out, labels)
    ref = hf(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        use_cache=False,
        num_items_in_batch=None if scale is None else torch.tensor(n),
    )
    for loss in (plain_loss, chunked_loss, ref.loss):
        loss.backward()
    assert rel(chunked_loss, plain_loss) < REL_TOL and abs(chunked_loss.item() - ref.loss.item()) < TOL
    plain_grads, chunked_grads = stage_grads(plain, config), stage_grads(chunked, config)
    assert len(chunked_grads) == len(list(hf.parameters()))
    for name, grad in chunked_grads.items():
        assert rel(grad, plain_grads[name]) < REL_TOL, name
        torch.testing.assert_close(grad, hf.get_parameter(name).grad, rtol=0, atol=TOL, msg=name)
    if config.tie_word_embeddings:  # the head's share of the shared weight's gradient is there
        head_rows = torch.ones(config.vocab_size, dtype=torch.bool)
        head_rows[input_ids.unique()] = False  # tokens never input: their gradient comes from the head alone
        assert head_rows.any() and chunked_grads["model.embed_tokens.weight"][head_rows].abs().max() > 0


def test_chunked_head_keeps_the_layer_files_and_refuses_a_mismatched_loss():
    config = tiny_config(vocab_size=300)
    for tied in (False, True):
        config.tie_word_embeddings = tied
        assert [expected_state_shapes(s) for s in build_specs(config, 64)] == [
            expected_state_shapes(s) for s in build_specs(config)
        ]
    h, w, labels = loss_batch()
    with pytest.raises(ValueError, match="same loss_chunk_tokens"):
        CausalLMLoss()((h, w), labels)
    torch.testing.assert_close(CausalLMLoss(64)(F.linear(h, w), labels), CausalLMLoss()(F.linear(h, w), labels))


def test_llama_stack_chunked_equals_unchunked():
    """The data-parallel engine's module (num_stages=1): the same loss and gradients chunked."""
    torch.manual_seed(0)
    config = tiny_config(vocab_size=300, hidden_size=64, intermediate_size=96)
    plain, chunked = LlamaStack(config), LlamaStack(config, loss_chunk_tokens=25)
    chunked.load_state_dict(plain.state_dict())
    input_ids, position_ids, labels = parity_batch(config.vocab_size)
    losses = [CausalLMLoss(c)(m(input_ids, position_ids), labels) for m, c in ((plain, 0), (chunked, 25))]
    for loss in losses:
        loss.backward()
    assert rel(losses[1], losses[0]) < REL_TOL
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        assert rel(q.grad, p.grad) < REL_TOL, name


@pytest.mark.slow  # measures peak memory over chunk sizes
def test_peak_memory_of_the_loss_side_is_several_times_lower():
    """2048 tokens, hidden 64, fp32, forward + backward: the default chunk (1024) holds one [1024,V] buffer at a
    time where the logits path holds about four [2048,V] ones (logits, log-probabilities and their gradients).
    The ratio hardly depends on V (the weight's gradient, [V,64], is small beside them): V 8000 here, a quarter
    of Llama 2's, to keep the fast tier fast (benchmarks/bench_loss_memory.py measures V 32000, BENCHMARKS.md)."""
    tokens, hidden, vocab = 2048, 64, 8000
    unchunked = bench.loss_peak_bytes(tokens, hidden, vocab, chunk=0)
    chunked = bench.loss_peak_bytes(tokens, hidden, vocab, chunk=1024)
    print(f"loss side peak: unchunked {unchunked / 2**20:.0f} MiB, chunk 1024 {chunked / 2**20:.0f} MiB")
    assert unchunked > 3 * tokens * vocab * 4  # the counter sees the logits (a measurement, not zeros)
    assert chunked < 1.5 * 1024 * vocab * 4 + 2 * vocab * hidden * 4  # one chunk, the weight's gradient
    assert unchunked / chunked >= 4
