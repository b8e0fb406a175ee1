"""Llama 4's text model (``llama4_text``, models/families.py) through the stages computes what ``Llama4ForCausalLM``
computes, in one process.

The stages (Hugging Face's own ``Llama4TextDecoderLayer``) chained against ``Llama4ForCausalLM`` (logits, loss, every
gradient, fp32, TOL) with both attention settings, packed and not; the routed layers Hugging Face builds; what the
tolerance would catch (no shared expert, full attention instead of chunked, no temperature tuning); the conversion both
ways. The tiny config (models/tiny.py) makes every difference of Llama 4 visible in 40 tokens: chunks of 8, temperature
tuning from position 7, routed layers 1 and 3 (top 1 of 4 experts and a shared expert), layer 3 without RoPE and with
full attention. The 2-rank training run is in tests/test_llama4_training.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama4.modeling_llama4 import Llama4ForCausalLM, Llama4TextExperts, Llama4TextMoe

from models.families import family_of, load_config, moe_spec
from models.files.hf_convert import hf_to_stages, stages_to_hf
from models.files.pipeline_dir import load_layer_file, read_tag
from models.llama_pipe import (
    ATTENTION_IMPLEMENTATIONS,
    build_sequential,
    init_weights_,
    layer_file_name,
)
from models.loss import causal_lm_loss
from models.tiny import tiny_config
from tests.support.models import make_hf_dir
from tests.test_convert import assert_bit_identical, hf_tensors
from tests.test_stage_parity import (
    TOL,
    assert_matches_hf,
    assert_packed_equals_alone,
    copy_hf_weights,
    parity_batch,
    run_chain,
)

ATTENTION = sorted(ATTENTION_IMPLEMENTATIONS)  # documents (per-document SDPA, chunks cut there), dense_mask


def llama4_config(**overrides):
    return tiny_config("llama4_text", vocab_size=300, **overrides)


def hf_model(config) -> Llama4ForCausalLM:
    return family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def stages_against_hf(config, attention: str, batch, hf=None) -> float:
    """The stages chained with ``attention`` vs ``Llama4ForCausalLM`` with the same weights: logits, loss and every
    gradient within TOL, the router and both kinds of expert learning. Returns the largest difference."""
    return assert_matches_hf(
        config,
        *batch,
        attention=ATTENTION_IMPLEMENTATIONS[attention],
        hf=hf or hf_model(config),
        learns=("feed_forward.router", "feed_forward.experts", "shared_expert"),
    )


def test_routed_layers_are_those_hugging_face_builds():
    for overrides, routed in [
        ({}, (1, 3)),
        ({"interleave_moe_layer_step": 1}, (0, 1, 2, 3)),
        ({"moe_layers": [2]}, (2,)),
    ]:
        config = llama4_config(**overrides)
        with torch.device("meta"):
            hf = Llama4ForCausalLM(config)
        assert tuple(i for i, layer in enumerate(hf.model.layers) if layer.is_moe_layer) == routed
        spec = moe_spec(config)
        assert spec.moe_layers == routed and (spec.num_experts, spec.top_k) == (4, 1)
        funcs = build_sequential(config)
        for i, f in enumerate(funcs[1:-2]):  # the stages' layers are Hugging Face's, routed where its are
            assert isinstance(f.get_submodule("feed_forward"), Llama4TextMoe) == (i in routed)
        for i in routed:
            assert isinstance(funcs[1 + i].get_submodule(spec.experts), Llama4TextExperts)
            assert funcs[1 + i].get_submodule(spec.router).out_features == 4


def test_the_tiny_config_has_every_difference_of_llama4():
    config = llama4_config()
    assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert config.no_rope_layers == [1, 1, 1, 0] and config.use_qk_norm and config.attn_temperature_tuning
    assert config.attention_chunk_size == 8 and config.floor_scale == 8 and config.head_dim == 16
    assert config.num_experts_per_tok == 1 and config.intermediate_size != config.intermediate_size_mlp


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_llama4_stages_match_hf(attention, packed):
    torch.manual_seed(0)
    config = llama4_config()
    worst = stages_against_hf(config, attention, parity_batch(config.vocab_size, packed=packed))
    print(f"llama4_text {attention} {'packed' if packed else 'unpacked'}: max |stages - Llama4ForCausalLM| {worst:.1e}")


def test_llama4_with_a_tied_head_and_every_layer_routed_matches_hf():
    torch.manual_seed(0)
    config = llama4_config(tie_word_embeddings=True, interleave_moe_layer_step=1, num_experts_per_tok=2)
    stages_against_hf(config, "documents", parity_batch(config.vocab_size))


def logits_of(config, hf_state, batch, attention="documents", drop_shared_expert=False) -> torch.Tensor:
    funcs = build_sequential(config, attention=ATTENTION_IMPLEMENTATIONS[attention])
    copy_hf_weights(funcs, config, hf_state)
    if drop_shared_expert:
        with torch.no_grad():
            for f in funcs[1:-2]:
                if f.is_moe_layer:
                    f.feed_forward.shared_expert.down_proj.weight.zero_()
    with torch.no_grad():
        return run_chain(funcs, batch[0], batch[1])


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("variant", ["no_shared_expert", "full_attention", "no_temperature_tuning"])
def test_the_tolerance_catches_each_difference_of_llama4(variant, attention):
    """What a stage that got one of Llama 4's differences wrong would compute misses the parity tolerance by orders of
    magnitude: without the shared expert, full attention on the chunked layers, or no temperature tuning."""
    torch.manual_seed(0)
    config = llama4_config()
    state = hf_model(config).state_dict()
    batch = parity_batch(config.vocab_size)
    logits = logits_of(config, state, batch, attention)
    if variant == "no_shared_expert":
        other = logits_of(config, state, batch, attention, drop_shared_expert=True)
    elif variant == "full_attention":
        other = logits_of(llama4_config(layer_types=["full_attention"] * 4), state, batch, attention)
    else:
        other = logits_of(llama4_config(attn_temperature_tuning=False), state, batch, attention)
    diff = (logits - other).abs().max().item()
    print(f"{variant} ({attention}): max |logits difference| {diff:.2e}")
    assert diff > 100 * TOL


def test_packed_documents_are_chunked_as_each_alone():
    """Chunks count each document's own positions (as transformers' chunked mask does for packed rows): a packed
    row's logits equal each document's alone, documents longer than a chunk and starting off a chunk boundary.
    Temperature tuning is off here: Llama4TextAttention scales by the token's offset in the row, not its position
    (transformers 5.23), so past ``floor_scale`` a packed document is not computed as it is alone, by Hugging Face
    nor by the stages."""
    torch.manual_seed(0)
    config = llama4_config(attn_temperature_tuning=False)
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf_model(config).state_dict())
    assert_packed_equals_alone(funcs, config.vocab_size)


def test_llama4_adds_no_router_loss_even_when_asked():
    """``Llama4ForCausalLM`` computes no load-balancing loss with ``output_router_logits`` (transformers 5.23): its
    loss is the cross entropy alone, so the stages carry no routing statistics and train the same loss."""
    torch.manual_seed(0)
    config = llama4_config(output_router_logits=True, router_aux_loss_coef=0.5)
    assert not moe_spec(config).router_loss
    hf = hf_model(config)
    input_ids, position_ids, labels = parity_batch(config.vocab_size, packed=False)
    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False, output_router_logits=True)
    assert getattr(ref, "aux_loss", None) is None and len(ref.router_logits) == 2
    assert abs(ref.loss.item() - causal_lm_loss(ref.logits, labels).item()) < TOL
    funcs = build_sequential(config)
    assert len(run_chain(funcs[:2], input_ids, position_ids)) == 2  # hidden, positions: no statistics travel
    stages_against_hf(config, "documents", (input_ids, position_ids, labels), hf=hf)


def test_from_scratch_initialisation_draws_the_experts_as_hugging_face():
    """The fused experts (zeros and uninitialised memory as constructed) and the router get N(0, initializer_range),
    as Llama4PreTrainedModel._init_weights draws them."""
    config = llama4_config()
    layer = build_sequential(config)[2]  # decoder layer 1: routed
    init_weights_(layer, config, seed=0)
    for name, p in layer.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(p.std().item() - config.initializer_range) < 0.1 * config.initializer_range, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama4_round_trip_is_bit_identical(tmp_path, tokenizer_dir, dtype):
    """save_pretrained stores the experts fused, as held in memory (``feed_forward.experts.gate_up_proj`` [E,H,2I],
    ``down_proj`` [E,I,H]): the layer files keep those names and shapes, and the export is the original bit for bit
    and loads as Llama4ForCausalLM."""
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", dtype=dtype, model_type="llama4_text")
    on_disk = hf_tensors(src)
    config = load_config(src)
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    assert on_disk["model.layers.1.feed_forward.experts.gate_up_proj"].shape == (e, h, 2 * i)
    assert on_disk["model.layers.3.feed_forward.experts.down_proj"].shape == (e, i, h)
    assert "model.layers.0.feed_forward.gate_proj.weight" in on_disk  # a dense layer
    hf_to_stages(src, str(tmp_path / "ckpt"))
    ckpt = str(tmp_path / "ckpt")
    state = load_layer_file(os.path.join(ckpt, read_tag(ckpt), layer_file_name(2)))  # decoder layer 1
    for key in ("experts.gate_up_proj", "experts.down_proj", "router.weight", "shared_expert.down_proj.weight"):
        assert torch.equal(state[f"feed_forward.{key}"], on_disk[f"model.layers.1.feed_forward.{key}"]), key
    stages_to_hf(ckpt, str(tmp_path / "back"))
    assert_bit_identical(on_disk, hf_tensors(str(tmp_path / "back")))
    assert load_config(str(tmp_path / "back")).to_dict() == config.to_dict()
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(exported) is type(original) is Llama4ForCausalLM
    ids = torch.randint(0, original.config.vocab_size, (1, 24))  # 24 > the chunk of 8
    assert torch.equal(original(ids).logits, exported(ids).logits)
