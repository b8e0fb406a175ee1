"""Mistral, Qwen2/2.5 and Qwen3 run through the same stages as Llama (models/families.py) and compute what their own
``<Family>ForCausalLM`` computes, in one process.

Stage parity with each family's own ``<Family>ForCausalLM`` (logits, loss, every gradient, fp32, 1e-5),
sliding windows with and without packing, conversion both ways, the reference architectures' published
parameter counts, and the refusal of other model types. The 4-rank runs are in test_family_training.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.families import FAMILIES, UnsupportedModelError, config_from_dict, family_of, load_config
from models.files.hf_convert import ConversionError, expected_hf_shapes, hf_to_stages, stages_to_hf
from models.llama_pipe import DECODER_LAYER_CLASSES, NORM_CLASSES, build_sequential, model_parameters
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

WINDOW = 8  # sliding window of the windowed cases: shorter than every test sequence and document
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1e6}
# name: (model_type, config overrides). Each family's differences, each on its own.
CASES = {
    "mistral_window": ("mistral", dict(sliding_window=WINDOW)),
    "mistral_no_window": ("mistral", dict(sliding_window=None)),  # Mistral 7B v0.2 and later
    "qwen2_gqa": ("qwen2", dict(num_key_value_heads=2)),  # q/k/v biases
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),  # Qwen2.5 0.5B-3B
    "qwen2_window_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen2_rope_yarn": ("qwen2", dict(rope_parameters=YARN)),  # Qwen2.5's long-context setting
    "qwen3_gqa": ("qwen3", dict(num_key_value_heads=2)),  # q_norm / k_norm per head
    "qwen3_mqa_tied": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True)),  # Qwen3 0.6B-4B tie
    "qwen3_window_layers": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
}


def case_config(name: str, **extra):
    model_type, overrides = CASES[name]
    return tiny_config(model_type, vocab_size=300, intermediate_size=96, **{**overrides, **extra})


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_family_stages_match_hf(name, packed):
    torch.manual_seed(0)
    config = case_config(name)
    worst = assert_matches_hf(config, *parity_batch(config.vocab_size, packed=packed))
    reference = family_of(config).causal_lm.__name__
    print(f"{name} {'packed' if packed else 'unpacked'}: max |stages - {reference}| {worst:.1e}")


def test_each_family_builds_its_own_modules():
    # each family's stage classes are written out in models/llama_pipe.py: a new family needs its two
    assert DECODER_LAYER_CLASSES.keys() == NORM_CLASSES.keys() == FAMILIES.keys()
    for model_type, family in FAMILIES.items():
        funcs = build_sequential(tiny_config(model_type))
        assert isinstance(funcs[1], family.decoder_layer) and isinstance(funcs[-2], family.rms_norm)
        assert isinstance(funcs[1].rotary_emb, family.rotary_embedding)
    qwen2 = build_sequential(tiny_config("qwen2"))[1].self_attn
    assert qwen2.q_proj.bias is not None and qwen2.o_proj.bias is None
    qwen3 = build_sequential(tiny_config("qwen3"))[1].self_attn
    assert qwen3.q_norm.weight.shape == qwen3.k_norm.weight.shape == (16,)  # per head: head_dim


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window_layers"])
def test_sliding_window_changes_what_the_stages_compute(name):
    """The window is not a no-op on the test sequences: ignoring it would miss the parity tolerance by
    orders of magnitude (so test_family_stages_match_hf would catch a stage that ignores it)."""
    torch.manual_seed(0)
    windowed = case_config(name)
    full = case_config(
        name, **({"sliding_window": None} if name.startswith("mistral") else {"use_sliding_window": False})
    )
    funcs, full_funcs = build_sequential(windowed), build_sequential(full)
    state = family_of(windowed).causal_lm._from_config(windowed, attn_implementation="sdpa").state_dict()
    copy_hf_weights(funcs, windowed, state)
    copy_hf_weights(full_funcs, full, state)
    input_ids, position_ids, _ = parity_batch(windowed.vocab_size)
    diff = (run_chain(funcs, input_ids, position_ids) - run_chain(full_funcs, input_ids, position_ids)).abs().max()
    assert diff > 1000 * TOL, diff.item()


def test_packed_documents_with_a_window_equal_each_document_alone():
    """Packing and the window together: per-token logits of a packed row equal those of each document run
    alone, each longer than the window (the mask is per document *and* per window)."""
    torch.manual_seed(0)
    config = case_config("mistral_window")
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, family_of(config).causal_lm._from_config(config).state_dict())
    assert_packed_equals_alone(funcs, config.vocab_size)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_layer_file_names_are_the_familys_own(model_type, tied):
    """The converter's expected tensors (derived from the stage modules) are exactly the family's own
    ``<Family>ForCausalLM`` state dict, names and shapes (a tied head's ``lm_head.weight`` aside)."""
    config = tiny_config(model_type, tie_word_embeddings=tied)
    with torch.device("meta"):
        hf = family_of(config).causal_lm(config)
    expected = {k: s for shapes in expected_hf_shapes(config).values() for k, s in shapes.items()}
    own = {k: t.shape for k, t in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert expected == own
    assert model_parameters(config) == hf.num_parameters()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["mistral_window", "qwen2_tied", "qwen2_window_layers", "qwen3_gqa"])
@pytest.mark.slow  # beyond stage parity: conversion, sizes (the full suite; llama's in test_convert)
def test_round_trip_is_bit_identical_and_loads_as_the_same_class(tmp_path, tokenizer_dir, name, dtype):
    model_type, overrides = CASES[name]
    src = make_hf_dir(tmp_path, tokenizer_dir, "src", dtype=dtype, model_type=model_type, **overrides)
    hf_to_stages(src, str(tmp_path / "ckpt"))
    stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert_bit_identical(hf_tensors(src), hf_tensors(str(tmp_path / "back")))
    assert load_config(str(tmp_path / "back")).to_dict() == load_config(src).to_dict()
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(exported) is type(original) is FAMILIES[model_type].causal_lm
    ids = torch.randint(0, original.config.vocab_size, (1, 24))  # 24 > WINDOW
    assert torch.equal(original(ids).logits, exported(ids).logits)


def write_config(path, **fields) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(fields, f)
    return str(path)


@pytest.mark.parametrize("model_type", ["gemma", "falcon", None])
def test_other_model_types_are_refused_naming_the_supported_ones(tmp_path, model_type):
    src = write_config(tmp_path / "src", model_type=model_type, hidden_size=64)
    supported = "supported model types: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, llama4_text"
    with pytest.raises(UnsupportedModelError, match=supported):
        load_config(src)
    with pytest.raises(ConversionError, match=f"model_type {model_type!r} is not supported; {supported}"):
        hf_to_stages(src, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(UnsupportedModelError, match=supported):
        config_from_dict({"model_type": model_type})


def test_training_refuses_other_model_types_before_starting(tmp_path):
    """train.py's config check (before any process group) reports it with the other problems."""
    from training.configuration.schema import ConfigError, TrainConfig
    from training.configuration.validate import resolve

    cfg = TrainConfig(model_name_or_path=write_config(tmp_path / "ckpt", model_type="gemma"))
    cfg.output_dir = str(tmp_path / "out")
    with pytest.raises(ConfigError, match="model_type 'gemma' is not supported; supported model types: llama"):
        resolve(cfg, world_size=4)
    cfg = TrainConfig()
    cfg.model.architecture = {"model_type": "falcon", "hidden_size": 64}
    cfg.model.tokenizer, cfg.output_dir = str(tmp_path), str(tmp_path / "out")
    with pytest.raises(
        ConfigError, match=r"model.architecture \(model=checkpoint\): model_type 'falcon' is not supported"
    ):
        resolve(cfg, world_size=4)


# conf/model entries of the other families: published parameter counts (the safetensors index's
# total_size / 2 of the bf16 release), reproduced through the stage specs on the meta device.
REFERENCE_PARAMS = {
    "mistral-7b": 7_241_732_096,  # mistralai/Mistral-7B-v0.1
    "qwen2.5-7b": 7_615_616_512,  # Qwen/Qwen2.5-7B
    "qwen3-8b": 8_190_735_360,  # Qwen/Qwen3-8B
}


@pytest.mark.parametrize("name", sorted(REFERENCE_PARAMS))
@pytest.mark.slow  # beyond stage parity: conversion, sizes (the full suite; llama's in test_convert)
def test_reference_architectures_of_the_families(name, tmp_path, tokenizer_dir):
    """Exact published counts through the stage specs, and the planner and preflight on each entry."""
    from parallel.layout import Layout
    from parallel.partition import splitter
    from training.configuration.model_source import model_group_config

    config = model_group_config(name)
    assert config.model_type == name.split("-")[0].replace("2.5", "2")  # mistral, qwen2, qwen3
    assert model_parameters(config) == REFERENCE_PARAMS[name]
    with torch.device("meta"):
        assert family_of(config).causal_lm(config).num_parameters() == REFERENCE_PARAMS[name]
    params, layers = splitter(config, None)(Layout(stages=4))
    assert sum(params) == REFERENCE_PARAMS[name] and sum(layers) == config.num_hidden_layers
    assert_preflight_plans(name, tokenizer_dir, tmp_path)


def test_tokenizers_without_a_bos_token_make_rows_without_one(tmp_path, tokenizer_dir):
    """Qwen's tokenizers have no BOS token (``bos_token: null``): text and SFT rows start with the text
    itself, end with EOS, and hold no None."""
    from transformers import AutoTokenizer

    from data.records import SourceStats
    from data.render import read_examples

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.bos_token = None
    assert tok.bos_token_id is None
    text = write_rows(tmp_path / "text.jsonl", {"text": "def f(x): return x"})
    sft = write_rows(tmp_path / "sft.jsonl", {"prompt": "What is a list?", "response": "A sequence."})
    (t,) = read_examples(text, "text", tok, 64, 512, False, SourceStats())
    (s,) = read_examples(sft, "sft", tok, 64, 512, False, SourceStats())
    assert t.input_ids == tok("def f(x): return x", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prompt = tok("What is a list?", add_special_tokens=False)["input_ids"]
    assert s.input_ids[: len(prompt)] == prompt and s.input_ids[-1] == tok.eos_token_id
    assert None not in t.input_ids + s.input_ids + s.labels


def write_rows(path, *rows: dict) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
