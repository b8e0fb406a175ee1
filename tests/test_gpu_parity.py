"""Stage parity on a CUDA GPU in fp32 and bf16, Liger's kernels included (scripts/gpu_check.sh runs these; skipped
where there is none).

The stage modules chained in one process compute the family's ForCausalLM logits, loss and gradients on the GPU, in
fp32 (TF32 off) and in bf16 (compared with the same model in bf16, so only the kernels' summation order
differs): Llama untied and tied, and each other family with its difference (tests/test_families.py); the same
stages with Liger's kernels (kernels=liger, models/kernels.py) against them and the reference, each kernel alone and
all three, and the loss with Liger's fused linear cross entropy (loss_impl=liger, models/loss.py) against the chunked
loss and the reference, where liger-kernel is installed (scripts/gpu_check.sh installs it from .whl/); ZeRO-1/2's
gradient norm from one foreach norm against DeepSpeed's per-parameter loop, and its inf/NaN check from one fp64 foreach
norm against DeepSpeed's per-gradient check (training/optim.py)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from models.families import family_of
from models.kernels import LIGER_PARTS, apply_kernels
from models.llama_pipe import DecoderLayerPipe, build_sequential, spec_layout
from models.loss import IGNORE_INDEX, CausalLMLoss, LossSplit, causal_lm_loss, label_tokens, sequence_logps
from models.tiny import tiny_config
from tests.test_config import assert_grad_norm_in_one_kernel_is_the_loop
from tests.test_families import CASES
from tests.test_stage_parity import copy_hf_weights, module_of, run_chain
from tests.test_zero_step import assert_overflow_check_is_deepspeeds

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (max abs logits difference, loss difference, max gradient difference relative to the gradient's scale)
TOLERANCES = {torch.float32: (1e-4, 1e-5, 1e-4), torch.bfloat16: (0.1, 2e-2, 5e-2)}


MODELS = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    **{name: CASES[name] for name in ("mistral_window", "qwen2_tied", "qwen2_window_layers", "qwen3_gqa")},
}


def packed_batch(config, batch: int = 3, seq: int = 40):
    """Random tokens [B,S] on the GPU, a label span ignored in row 0, row 1 two packed documents."""
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    labels = input_ids.clone()
    labels[0, 30:] = IGNORE_INDEX
    position_ids = torch.arange(seq, device="cuda").repeat(batch, 1)
    position_ids[1, 25:] = torch.arange(seq - 25, device="cuda")  # a packed second document
    return input_ids, labels, position_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_chained_stages_match_hf_on_the_gpu(dtype, name):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model_type, overrides = MODELS[name]
    config = tiny_config(model_type, vocab_size=300, hidden_size=64, intermediate_size=96, **overrides)
    hf = family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf.state_dict())
    hf = hf.to("cuda", dtype)
    for f in funcs:
        module_of(f).to("cuda", dtype)

    input_ids, labels, position_ids = packed_batch(config)

    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)
    logits = run_chain(funcs, input_ids, position_ids)
    loss = causal_lm_loss(logits, labels)
    logit_tol, loss_tol, grad_tol = TOLERANCES[dtype]
    torch.testing.assert_close(logits.float(), ref.logits.float(), rtol=0, atol=logit_tol)
    assert abs(loss.item() - ref.loss.item()) < loss_tol
    ref.loss.backward()
    loss.backward()
    for info in spec_layout(config):
        if info.owns_file:
            for key, param in module_of(funcs[info.index]).named_parameters():
                ref_grad = hf.get_parameter(info.hf_prefix + key).grad.float()
                scale = ref_grad.abs().max().item() or 1.0
                torch.testing.assert_close(
                    param.grad.float(), ref_grad, rtol=0, atol=grad_tol * scale, msg=info.hf_prefix + key
                )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 64], ids=["llama", "mistral_window_64"])
def test_document_attention_matches_the_dense_mask_on_the_gpu(dtype, window, monkeypatch):
    """attention=documents against attention=dense_mask on one GPU, same weights and dtype, packed rows of 512
    tokens: in bf16 through torch's variable-length flash attention (asserted used), in fp32 per document."""
    from models import attention

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model_type, overrides = ("mistral", dict(sliding_window=window)) if window else ("llama", {})
    config = tiny_config(model_type, vocab_size=300, hidden_size=64, intermediate_size=96, **overrides)
    weights = family_of(config).causal_lm._from_config(config, dtype=torch.float32).state_dict()
    seq = 512
    input_ids = torch.randint(3, config.vocab_size, (2, seq), device="cuda")
    position_ids = torch.arange(seq, device="cuda").repeat(2, 1)
    for start, end in ((100, 300), (300, 301), (301, seq)):  # row 1: four documents, one of a single token
        position_ids[1, start:end] = torch.arange(end - start, device="cuda")
    used = []
    varlen = attention._varlen
    monkeypatch.setattr(attention, "_varlen", lambda w: used.append(varlen(w)) or varlen(w))

    def run(name: str):
        funcs = build_sequential(config, attention=name)
        copy_hf_weights(funcs, config, weights)
        for f in funcs:
            module_of(f).to("cuda", dtype)
        logits = run_chain(funcs, input_ids, position_ids)
        causal_lm_loss(logits, input_ids).backward()
        grads = {f"{i}.{n}": p.grad.float() for i, f in enumerate(funcs) for n, p in module_of(f).named_parameters()}
        return logits.float(), grads

    dense, documents = run("sdpa"), run("sdpa_documents")
    if dtype == torch.bfloat16:
        assert used and used[0] is not None, "torch's varlen flash attention is not available here"
    logit_tol, _, grad_tol = TOLERANCES[dtype]
    torch.testing.assert_close(documents[0], dense[0], rtol=0, atol=logit_tol)
    for name, grad in dense[1].items():
        scale = grad.abs().max().item() or 1.0
        torch.testing.assert_close(documents[1][name], grad, rtol=0, atol=grad_tol * scale, msg=name)


# kernels=liger (models/kernels.py): each of Liger's kernels alone on Llama, all three on every family it covers
LIGER_MODELS = {name: MODELS[name] for name in ("llama", "llama_tied", "mistral_window", "qwen2_tied", "qwen3_gqa")}
LIGER_RUNS = [("llama", part) for part in (*LIGER_PARTS, "all")]
LIGER_RUNS += [(name, "all") for name in sorted(LIGER_MODELS) if name != "llama"]
needs_liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")


def chain_grads(funcs, config, input_ids, position_ids, labels):
    """Logits (fp32), loss and every owned parameter's gradient (fp32, by Hugging Face name) of a stage chain."""
    logits = run_chain(funcs, input_ids, position_ids)
    loss = causal_lm_loss(logits, labels)
    loss.backward()
    grads = {
        info.hf_prefix + key: param.grad.float()
        for info in spec_layout(config)
        if info.owns_file
        for key, param in module_of(funcs[info.index]).named_parameters()
    }
    return logits.float(), loss.item(), grads


def assert_liger_forwards(funcs, parts):
    """The kernels asked for, and only those, are Liger's in every decoder layer."""
    from liger_kernel.transformers.monkey_patch import LigerRMSNorm, LigerSwiGLUMLP, liger_rotary_pos_emb

    layers = [module_of(f) for f in funcs if isinstance(module_of(f), DecoderLayerPipe)]
    assert layers
    for layer in layers:
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(layer.self_attn, n) for n in ("q_norm", "k_norm") if hasattr(layer.self_attn, n)]
        assert all((n.forward.__func__ is LigerRMSNorm.forward) == ("rms_norm" in parts) for n in norms)
        assert (getattr(layer.mlp.forward, "__func__", None) is LigerSwiGLUMLP.forward) == ("swiglu" in parts)
        rope = getattr(layer.self_attn.forward, "__func__", type(layer.self_attn).forward).__globals__
        assert (rope["apply_rotary_pos_emb"] is liger_rotary_pos_emb) == ("rope" in parts)


@needs_liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,part", LIGER_RUNS, ids=[f"{n}-{p}" for n, p in LIGER_RUNS])
def test_liger_kernels_match_the_stages_without_them_and_hf(dtype, name, part):
    """The stages with kernels=liger against the same stages without (same weights, same dtype) and against the
    family's ForCausalLM: in fp32 within the file's fp32 tolerances; in bf16 within its bf16 tolerances of the bf16
    model, and no further from the fp32 model than the stages without Liger are (at most 1.5 x their error, or 1% of
    the tensor's scale): a kernel computing anything else breaks both."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model_type, overrides = LIGER_MODELS[name]
    config = tiny_config(model_type, vocab_size=300, hidden_size=64, intermediate_size=96, **overrides)
    hf = family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    plain, fused = build_sequential(config), build_sequential(config)
    for funcs in (plain, fused):
        copy_hf_weights(funcs, config, hf.state_dict())
    parts = LIGER_PARTS if part == "all" else (part,)
    assert apply_kernels([module_of(f) for f in fused], "liger", parts) == config.num_hidden_layers
    assert_liger_forwards(fused, parts)
    for funcs in (plain, fused):
        for f in funcs:
            module_of(f).to("cuda", dtype)

    input_ids, labels, position_ids = packed_batch(config)

    def reference(model):
        out = model(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)
        out.loss.backward()
        return out.logits.float(), out.loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}

    hf_same = copy.deepcopy(hf).to("cuda", dtype) if dtype == torch.bfloat16 else None
    truth = reference(hf.to("cuda"))  # fp32
    same = reference(hf_same) if hf_same is not None else truth
    with_liger = chain_grads(fused, config, input_ids, position_ids, labels)
    without = chain_grads(plain, config, input_ids, position_ids, labels)
    logit_tol, loss_tol, grad_tol = TOLERANCES[dtype]
    for other in (same, without):
        torch.testing.assert_close(with_liger[0], other[0], rtol=0, atol=logit_tol)
        assert abs(with_liger[1] - other[1]) < loss_tol
        for key, grad in with_liger[2].items():  # Hugging Face names (a tied head's is the embedding's)
            scale = other[2][key].abs().max().item() or 1.0
            torch.testing.assert_close(grad, other[2][key], rtol=0, atol=grad_tol * scale, msg=key)
    if dtype == torch.bfloat16:  # about as exact as Hugging Face's own modules in bf16, against the fp32 model
        pairs = [("logits", with_liger[0], without[0], truth[0])]
        pairs += [(k, g, without[2][k], truth[2][k]) for k, g in with_liger[2].items()]
        for key, liger_value, plain_value, true_value in pairs:
            # relative L2 over the tensor (a largest element alone swings 1.7x between two bf16 summation orders)
            error = ((liger_value - true_value).norm() / true_value.norm()).item()
            plain = ((plain_value - true_value).norm() / true_value.norm()).item()
            assert error <= max(2 * plain, 1e-3), (key, error, plain)


# loss_impl=liger (models/loss.py): Liger's fused linear cross entropy on the last stage's (hidden, head weight)
LIGER_LOSS_RUNS = [("llama", "micro_batch"), ("llama", "tokens"), ("llama_tied", "tokens"), ("qwen3_gqa", "tokens")]
LOSS_CHUNK = 16  # the chunked loss's chunk: not a divisor of packed_batch's label tokens


def owned_grads(funcs, config) -> dict[str, torch.Tensor]:
    """Every owned parameter's gradient (fp32) of a stage chain, by Hugging Face name (a tied head's is the
    embedding's)."""
    return {
        info.hf_prefix + key: param.grad.float()
        for info in spec_layout(config)
        if info.owns_file
        for key, param in module_of(funcs[info.index]).named_parameters()
    }


@needs_liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,normalization", LIGER_LOSS_RUNS, ids=[f"{n}-{m}" for n, m in LIGER_LOSS_RUNS])
def test_liger_loss_matches_the_chunked_loss_and_hf(dtype, name, normalization):
    """The stages chained with the chunked head (loss_chunk_tokens 16; rows with an ignored span and a packed row),
    the loss computed by loss_impl=liger against the same stages with loss_impl=chunked (same weights and dtype) and
    against the family's ForCausalLM: the loss and every gradient within the file's tolerances, for the micro-batch
    mean and for loss_normalization=tokens' scaled sum (scale 1 / label tokens, Hugging Face's num_items_in_batch:
    Liger's backward must multiply its gradients by it). In bf16 also no further from the fp32 model than the chunked
    loss (relative L2 error at most 2 x the chunked loss's, or 1e-3)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model_type, overrides = MODELS[name]
    config = tiny_config(model_type, vocab_size=300, hidden_size=64, intermediate_size=96, **overrides)
    hf = family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    input_ids, labels, position_ids = packed_batch(config)
    n = label_tokens(labels)
    assert n % LOSS_CHUNK
    scale = None if normalization == "micro_batch" else 1 / n

    def stages(impl: str):
        funcs = build_sequential(config, LOSS_CHUNK)
        copy_hf_weights(funcs, config, hf.state_dict())
        for f in funcs:
            module_of(f).to("cuda", dtype)
        loss_fn = CausalLMLoss(LOSS_CHUNK, impl=impl)
        loss_fn.scale = scale
        loss = loss_fn(run_chain(funcs, input_ids, position_ids), labels)
        loss.backward()
        return loss.item(), owned_grads(funcs, config)

    def reference(model):
        items = None if scale is None else torch.tensor(n, device="cuda")
        out = model(
            input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False, num_items_in_batch=items
        )
        out.loss.backward()
        return out.loss.item(), {k: p.grad.float() for k, p in model.named_parameters()}

    hf_same = copy.deepcopy(hf).to("cuda", dtype) if dtype == torch.bfloat16 else None
    truth = reference(hf.to("cuda"))  # fp32
    same = reference(hf_same) if hf_same is not None else truth
    liger, chunked = stages("liger"), stages("chunked")
    _, loss_tol, grad_tol = TOLERANCES[dtype]
    assert set(liger[1]) == set(same[1])
    for other in (chunked, same):
        assert abs(liger[0] - other[0]) < loss_tol
        for key, grad in liger[1].items():
            scale_of = other[1][key].abs().max().item() or 1.0
            torch.testing.assert_close(grad, other[1][key], rtol=0, atol=grad_tol * scale_of, msg=key)
    if dtype == torch.bfloat16:
        for key, grad in liger[1].items():
            true = truth[1][key]
            error = ((grad - true).norm() / true.norm()).item()
            plain = ((chunked[1][key] - true).norm() / true.norm()).item()
            assert error <= max(2 * plain, 1e-3), (key, error, plain)


@needs_liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_liger_loss_per_token_sequence_slices_and_a_frozen_input_match_the_chunked_loss(dtype):
    """The loss side alone, on the GPU, Liger against the chunked loss (the file's tolerances): DPO's per-sequence
    log-probabilities (Liger's per-token losses, gradients recomputed in its backward) and their gradients; each
    sequence-parallel rank's slice (the targets shifted across the slice boundary), whose sums add up to the whole
    row's; and a head weight trained behind hidden states that need no gradient (Liger computes the weight's gradient
    only for an input that asks for one: models.loss.liger_head_losses makes it ask)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4, 48, 64, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(300, 64, device="cuda", generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, 300, (4, 48), device="cuda", generator=g)
    labels[0, 30:] = IGNORE_INDEX
    labels[3, :10] = IGNORE_INDEX
    _, loss_tol, grad_tol = TOLERANCES[dtype]

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        torch.testing.assert_close(
            a.float(), b.float(), rtol=0, atol=grad_tol * (b.abs().max().item() or 1.0), msg=what
        )

    def run(impl: str, kind: str):
        h = hidden.detach().requires_grad_(kind != "frozen")
        w = weight.detach().requires_grad_()
        if kind == "dpo":
            out = sequence_logps((h, w), labels, LOSS_CHUNK, impl=impl)  # [4] fp64
            (out * torch.tensor([1.0, -2.0, 0.5, 3.0], device="cuda", dtype=torch.float64)).sum().backward()
        elif kind == "slices":
            out = torch.zeros((), device="cuda")
            for rank in range(2):
                loss_fn = CausalLMLoss(LOSS_CHUNK, impl=impl)
                loss_fn.split_over(LossSplit(seq_slice=(rank, 2)))
                loss_fn.scale = 0.5
                out = out + loss_fn((h[:, rank * 24 : (rank + 1) * 24], w), labels)
            out.backward()
        else:
            loss_fn = CausalLMLoss(LOSS_CHUNK, impl=impl)
            out = loss_fn((h, w), labels)
            out.backward()
        return out.detach(), h.grad, w.grad

    for kind in ("dpo", "slices", "frozen"):
        liger, chunked = run("liger", kind), run("chunked", kind)
        close(liger[0], chunked[0], f"{kind} loss")
        assert (liger[1] is None) == (kind == "frozen") == (chunked[1] is None)
        for a, b, what in zip(liger[1:], chunked[1:], ("hidden", "weight")):
            if b is not None:
                close(a, b, f"{kind} {what} gradient")
    whole = CausalLMLoss(LOSS_CHUNK, impl="liger")
    whole.scale = 0.5  # a sum over 150 label tokens: compared relative to it
    total, sliced = whole((hidden, weight), labels).item(), run("liger", "slices")[0].item()
    assert abs(total - sliced) / abs(total) < loss_tol


def test_the_overflow_check_in_one_kernel_is_deepspeeds_on_the_gpu():
    """The fp64 foreach norm finds a NaN or an infinity on the GPU as DeepSpeed's per-gradient max and min do."""
    assert_overflow_check_is_deepspeeds("cuda")


def test_zero_grad_norm_in_one_kernel_equals_deepspeeds_loop_on_the_gpu(tmp_path, monkeypatch):
    """The fused foreach norm sums in another order than one norm per gradient: equal to fp32's last bits."""
    assert_grad_norm_in_one_kernel_is_the_loop("cuda", tmp_path, monkeypatch, rtol=1e-6)
