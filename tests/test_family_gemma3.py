"""Gemma 3's text model (gemma3_text) through the stages computes what ``Gemma3ForCausalLM`` computes, in one process:
logits, loss (the chunked one too) and every gradient within 1e-5 (fp32) with sliding and full layers, tied and
untied; packed documents equal each document alone; dropping the embedding's scale or giving the sliding layers the
global RoPE base breaks that tolerance; conversion both ways is bit-identical and loads as ``Gemma3ForCausalLM``;
generation equals ``generate``, LoRA equals ``get_peft_model``; from-scratch norms and the bf16 embedding scale are
Hugging Face's; the bidirectional setting is refused by name; the published sizes' parameter counts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gemma3.modeling_gemma3 import Gemma3ForCausalLM, Gemma3RMSNorm, Gemma3TextScaledWordEmbedding

from models.attention import DOCUMENT_ATTENTION
from models.config_rules import model_config_problems
from models.families import UnsupportedModelError, config_from_dict
from models.files.hf_convert import hf_to_stages, stages_to_hf
from models.llama_pipe import EmbeddingPipe, build_sequential, init_weights_, model_parameters
from models.loss import chunked_causal_lm_loss
from models.tiny import tiny_config
from tests.support.models import assert_preflight_plans, make_hf_dir
from tests.test_convert import assert_bit_identical, hf_tensors
from tests.test_stage_parity import (
    TOL,
    assert_matches_hf,
    assert_packed_equals_alone,
    copy_hf_weights,
    parity_batch,
    run_chain,
)


def gemma(**overrides):
    """Layers 0, 2 sliding (window 8, RoPE base 10k), 1, 3 full (base 1M); scores scaled by 24 ** -0.5."""
    return tiny_config("gemma3_text", **{"vocab_size": 300, "intermediate_size": 96, **overrides})


def reference(config) -> Gemma3ForCausalLM:
    """A random ``Gemma3ForCausalLM`` whose RMSNorm weights are random too (Hugging Face's init sets them 0)."""
    hf = Gemma3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for m in hf.modules():
            if isinstance(m, Gemma3RMSNorm):
                m.weight.normal_(0.0, 0.5)
    return hf


@pytest.mark.parametrize(
    "tied, attention",
    [(True, DOCUMENT_ATTENTION), (False, DOCUMENT_ATTENTION), (True, "sdpa")],
    ids=["tied", "untied", "tied_dense_mask"],
)
def test_stages_match_gemma3_for_causal_lm(tied, attention):
    """Packed rows among the batch's; ``sdpa``: attention=dense_mask, the masks of transformers' mask functions."""
    torch.manual_seed(0)
    config = gemma(tie_word_embeddings=tied)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    batch = parity_batch(config.vocab_size, packed=True)
    worst = assert_matches_hf(config, *batch, attention=attention, hf=reference(config))
    print(f"gemma3_text {'tied' if tied else 'untied'} {attention}: max |stages - Gemma3ForCausalLM| {worst:.1e}")


def test_chunked_loss_of_the_tied_head_equals_the_reference():
    """The chunked loss takes the tied embedding's weight unscaled (the scale is the lookup's alone)."""
    torch.manual_seed(0)
    config = gemma(tie_word_embeddings=True)
    hf = reference(config)
    funcs = build_sequential(config, loss_chunk_tokens=16)
    copy_hf_weights(funcs, config, hf.state_dict())
    input_ids, position_ids, labels = parity_batch(config.vocab_size)
    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False).loss
    loss = chunked_causal_lm_loss(*run_chain(funcs, input_ids, position_ids), labels, 16)
    assert abs(loss.item() - ref.item()) < TOL
    ref.backward()
    loss.backward()
    torch.testing.assert_close(funcs[0].weight.grad, hf.model.embed_tokens.weight.grad, rtol=0, atol=TOL)


def test_packed_documents_equal_each_document_alone():
    """Documents of 13, 20 and 7 tokens, two longer than the window: per document and per window."""
    torch.manual_seed(0)
    config = gemma(tie_word_embeddings=True)
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, reference(config).state_dict())
    assert_packed_equals_alone(funcs, config.vocab_size)


def unscaled(funcs) -> None:
    funcs[0].embed_scale = None


def global_base_everywhere(funcs) -> None:
    for f in funcs[1:-2]:
        f.rotary_args = ("full_attention",)


@pytest.mark.parametrize("wrong", [unscaled, global_base_everywhere], ids=["no_embed_scale", "local_rope_base"])
def test_each_difference_breaks_the_tolerance(wrong):
    """The embedding's sqrt(hidden) and the sliding layers' RoPE base are not no-ops on the test sequences: either
    wrong misses the parity tolerance by orders of magnitude."""
    torch.manual_seed(0)
    config = gemma()
    state = reference(config).state_dict()
    right, broken = build_sequential(config), build_sequential(config)
    copy_hf_weights(right, config, state)
    copy_hf_weights(broken, config, state)
    wrong(broken)
    input_ids, position_ids, _ = parity_batch(config.vocab_size)
    diff = (run_chain(right, input_ids, position_ids) - run_chain(broken, input_ids, position_ids)).abs().max()
    assert diff > 1000 * TOL, diff.item()


@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_round_trip_is_bit_identical_and_loads_as_gemma3(tmp_path, tokenizer_dir):
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", dtype=torch.bfloat16, model_type="gemma3_text")
    hf_to_stages(src, str(tmp_path / "ckpt"))
    stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert_bit_identical(hf_tensors(src), hf_tensors(str(tmp_path / "back")))
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(exported) is type(original) is Gemma3ForCausalLM
    ids = torch.randint(0, original.config.vocab_size, (1, 24))  # 24 > the window
    assert torch.equal(original(ids).logits, exported(ids).logits)


@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_generation_equals_hf_generate():
    from tests.test_generation import SPLITS, assert_equals_hf, pair

    hf, funcs = pair("gemma3_text", sliding_window=4, tie_word_embeddings=True)
    assert_equals_hf(hf, funcs, [SPLITS["norm_with_head"]], None)


def test_from_scratch_weights_and_the_scale_are_hugging_faces():
    """Gemma's RMSNorms (1 + weight) start at 0 as Hugging Face's, and the lookup's factor is rounded to the dtype
    as ``Gemma3TextScaledWordEmbedding`` rounds it (sqrt(3072) is 55.5 in bf16)."""
    config = gemma()
    norms = [m for f in build_sequential(config) for m in f.modules() if isinstance(m, Gemma3RMSNorm)]
    for i, m in enumerate(norms):
        init_weights_(m, config, seed=i)
    assert len(norms) == 4 * 6 + 1 and all(torch.equal(m.weight, torch.zeros_like(m.weight)) for m in norms)
    wide = gemma(hidden_size=3072, vocab_size=4, num_hidden_layers=1)
    ours = EmbeddingPipe(wide).to(torch.bfloat16)
    theirs = Gemma3TextScaledWordEmbedding(4, 3072, 0, embed_scale=3072**0.5).to(torch.bfloat16)
    theirs.weight.data.copy_(ours.weight.data.normal_())
    ids = torch.arange(4)[None]
    assert torch.equal(ours((ids, ids))[0], theirs(ids))


def test_values_the_stages_cannot_compute_are_refused_by_name():
    config = config_from_dict(
        {"model_type": "gemma3_text", "final_logit_softcapping": 30.0, "use_bidirectional_attention": True}
    )
    (line,) = model_config_problems(config, "model.architecture", override=True)  # the cap runs (test_logit_softcap)
    assert "use_bidirectional_attention true" in line
    assert model_config_problems(gemma(), "model.architecture", override=True) == []
    scaled = config_from_dict({"model_type": "gemma3_text", "rope_scaling": {"rope_type": "linear", "factor": 0.5}})
    (line,) = model_config_problems(scaled, "model.architecture", override=True)
    assert line.startswith("model.architecture: rope_parameters.full_attention.factor 0.5 is out of range")
    with pytest.raises(UnsupportedModelError, match="rope_type 'bogus' is not one transformers"):
        config_from_dict({"model_type": "gemma3_text", "rope_scaling": {"rope_type": "bogus", "factor": 2.0}})


# conf/model/gemma-3-*.yaml: the 1B's safetensors total (a text-only release); the others' published totals (their
# Gemma3ForConditionalGeneration safetensors) less the SigLIP vision tower's 416,866,032 parameters and the
# projector's 1152 x hidden + 1152, which is what Gemma3ForCausalLM builds from their text_config
REFERENCE_PARAMS = {
    "gemma-3-1b": 999_885_952,  # google/gemma-3-1b-pt
    "gemma-3-4b": 3_880_263_168,  # google/gemma-3-4b-pt: 4,300,079,472 - 416,866,032 - 2,950,272
    "gemma-3-12b": 11_766_034_176,  # google/gemma-3-12b-pt: 12,187,325,040 - 416,866,032 - 4,424,832
    "gemma-3-27b": 27_009_346_304,  # google/gemma-3-27b-pt: 27,432,406,640 - 416,866,032 - 6,194,304
}


@pytest.mark.parametrize("name", sorted(REFERENCE_PARAMS))
@pytest.mark.slow  # beyond stage parity: conversion, sizes, generation (the full suite)
def test_published_sizes(name, tmp_path, tokenizer_dir):
    """Exact counts through the stage specs, and the planner and preflight on each entry."""
    from training.configuration.model_source import model_group_config

    config = model_group_config(name)
    assert config.model_type == "gemma3_text" and config.tie_word_embeddings
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert model_parameters(config) == REFERENCE_PARAMS[name]
    assert_preflight_plans(name, tokenizer_dir, tmp_path)


@pytest.mark.slow  # importing peft is most of it (test_lora.py's import in the full suite)
def test_lora_stages_equal_get_peft_model():
    """LoRA's targets (q_proj, v_proj, up_proj) are Gemma's names too: the stages with the adapters injected compute
    the logits of ``get_peft_model`` (tests/test_lora.py's check, on this family)."""
    from tests.test_lora import test_stage_forward_equals_get_peft_model as lora_equals_peft

    lora_equals_peft("gemma3_text")
