"""kernels=liger (models/kernels.py) where no GPU is: refused before start with the reasons, and the wiring of
apply_kernels checked with stand-ins for Liger's helpers that compute what Hugging Face's modules compute and count
their calls (the real kernels' numbers are tests/test_gpu_parity.py's, on a GPU)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from transformers.models.llama import modeling_llama

from models.kernels import apply_kernels, kernel_problems
from models.llama_pipe import DecoderLayerPipe, build_sequential
from models.tiny import tiny_config
from tests.test_config import problems_of
from tests.test_stage_parity import module_of, run_chain
from training.config import DataConfig, TrainConfig


def test_liger_is_refused_without_cuda_or_the_package_and_for_families_it_does_not_cover():
    llama = tiny_config()
    assert kernel_problems("none", llama, cuda=False, importable=False) == []
    assert kernel_problems("liger", llama, cuda=True, importable=True) == []
    cpu = kernel_problems("liger", llama, cuda=False, importable=False)
    assert len(cpu) == 2 and "CUDA GPU" in cpu[0] and "pip install liger-kernel==" in cpu[1]
    (moe,) = kernel_problems("liger", tiny_config("qwen3_moe"), cuda=True, importable=True)
    assert "not model_type 'qwen3_moe'" in moe and "set kernels=none" in moe
    (gelu,) = kernel_problems("liger", tiny_config(hidden_act="gelu"), cuda=True, importable=True)
    assert "hidden_act is 'gelu'" in gelu


def test_train_config_with_kernels_liger_is_refused_on_this_machine(tmp_path, tiny_hf):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    cfg = TrainConfig(model_name_or_path=tiny_hf, kernels="liger", data=DataConfig(train_file=str(data)))
    assert "kernels=liger runs Liger's Triton kernels, which need a CUDA GPU" in problems_of(cfg, world_size=1)


@pytest.fixture()
def stand_in_liger(monkeypatch):
    """liger_kernel.transformers.monkey_patch with its names computing Hugging Face's results; ``calls`` counts
    the rotary calls and lists the modules each helper patched."""
    calls = {"rope": 0, "rms_norm": [], "swiglu": []}

    def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        calls["rope"] += 1
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    class SwiGLU:
        pass

    fake = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake.LigerSwiGLUMLP = SwiGLU
    fake.liger_rotary_pos_emb = rope
    fake._patch_rms_norm_module = lambda module: calls["rms_norm"].append(module)
    fake._patch_swiglu_module = lambda module, cls: calls["swiglu"].append((module, cls))
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    return calls


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_apply_kernels_patches_every_decoder_layer_and_rope_for_those_layers_only(model_type, stand_in_liger):
    calls = stand_in_liger
    torch.manual_seed(0)
    config = tiny_config(model_type)
    plain = build_sequential(config)
    fused = build_sequential(config)
    fused_modules = [module_of(f) for f in fused]
    for a, b in zip(plain, fused_modules):
        module_of(a).load_state_dict(b.state_dict())
    assert apply_kernels(fused_modules, "none") == 0 and calls["rope"] == 0
    layers = [m for m in fused_modules if isinstance(m, DecoderLayerPipe)]
    assert apply_kernels(fused_modules, "liger") == len(layers) == config.num_hidden_layers

    # Liger's helpers got each layer's MLP and every RMSNorm in it (Qwen3's q/k norms too), nothing else
    assert [m for m, _ in calls["swiglu"]] == [layer.mlp for layer in layers]
    norms_per_layer = 4 if model_type == "qwen3" else 2
    assert len(calls["rms_norm"]) == norms_per_layer * len(layers)
    assert {id(n) for n in calls["rms_norm"]} <= {id(m) for layer in layers for m in layer.modules()}

    ids = torch.randint(0, config.vocab_size, (2, 16))
    positions = torch.arange(16).repeat(2, 1)
    expected = run_chain(plain, ids, positions)
    assert calls["rope"] == 0  # the stages without kernels keep Hugging Face's RoPE
    torch.testing.assert_close(run_chain(fused, ids, positions), expected, rtol=0, atol=0)
    assert calls["rope"] == len(layers)  # one call per decoder layer

    hf = modeling_llama.LlamaForCausalLM(tiny_config())  # a model beside the stages in the process
    hf(input_ids=ids, use_cache=False)
    assert calls["rope"] == len(layers)


def test_rebound_rope_survives_torch_compile_across_layers():
    """compile=true with kernels=liger: every layer's attention shares one rebound forward, so the graph torch.compile
    caches for that code (installed in the compiling frame's globals) is found by the next layer; with a copy of the
    globals per layer the second layer failed (NameError: __compiled_fn_... is not defined, seen on an H200)."""
    from models.kernels import rebind_global

    config = tiny_config("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    calls = []

    def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        calls.append(1)
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    layers = [modeling_llama.LlamaAttention(config, i) for i in range(2)]
    x = torch.randn(1, 8, 64)  # [B,S,H]
    position = modeling_llama.LlamaRotaryEmbedding(config)(x, torch.arange(8)[None])
    eager = [layer(x, position, None)[0] for layer in layers]
    for layer in layers:
        rebind_global(layer, "apply_rotary_pos_emb", rope)
        layer.compile(backend="eager")  # dynamo's graph cache, without inductor's compile time
    compiled = [layer(x, position, None)[0] for layer in layers]
    assert calls and all(torch.equal(a, b) for a, b in zip(eager, compiled))
