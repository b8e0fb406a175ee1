"""Liger's kernels and loss (kernels=liger, loss_impl=liger) and adamw_impl where no GPU is: refusals and wiring.

kernels=liger (models/kernels.py) is refused before start with the reasons, and the wiring of apply_kernels checked with
stand-ins for Liger's helpers that compute what Hugging Face's modules compute and count their calls (the real kernels'
numbers are tests/test_gpu_parity.py's, on a GPU). The same for loss_impl=liger (Liger's fused linear cross entropy on
the last stage, models/loss.py), with a stand-in for Liger's function that checks what it is handed, and for adamw_impl
(training/optim.py: which AdamW DeepSpeed builds)."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama

from models.kernels import apply_kernels, kernel_problems, loss_impl_problems
from models.llama_pipe import DecoderLayerPipe, build_sequential
from models.loss import IGNORE_INDEX, CausalLMLoss, LossSplit, PreferenceLoss, sequence_logps, shifted_targets
from models.tiny import tiny_config
from parallel.engines import DataParallelEngine
from parallel.layout import Layout
from parallel.tensor_parallel import TensorParallelPlan
from tests.test_config import problems_of
from tests.test_stage_parity import module_of, run_chain
from training.configuration.schema import DataConfig, TrainConfig


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


@pytest.mark.slow  # compiles
def test_rebound_rope_survives_torch_compile_across_layers(dynamo_without_guard_timing):
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


# ---------------------------------------------------------------- loss_impl=liger: Liger's fused linear cross entropy


def test_loss_impl_liger_is_refused_where_it_cannot_run_every_reason_at_once():
    data_parallel = Layout(stages=1, dp=2, zero=2).engine
    assert isinstance(data_parallel, DataParallelEngine)
    assert loss_impl_problems("chunked", 0, data_parallel, cuda=False, importable=False) == []
    assert loss_impl_problems("liger", 1024, cuda=True, importable=True) == []
    assert loss_impl_problems("liger", 1024, Layout(stages=2, dp=1).engine, cuda=True, importable=True) == []
    found = loss_impl_problems("liger", 0, data_parallel, cuda=False, importable=False)
    assert len(found) == 4 and all(p.startswith("loss_impl=liger") for p in found)
    assert "need a CUDA GPU" in found[0] and "pip install liger-kernel==" in found[1]
    assert "set loss_impl=chunked" in found[0] and "set loss_impl=chunked" in found[1]
    assert "loss_chunk_tokens=0: set loss_chunk_tokens > 0" in found[2]
    assert "ZeRO 2/3 (DeepSpeed's data-parallel engine)" in found[3]
    # a head split by vocabulary: tensor parallelism's own rule
    tp2 = Layout(stages=2, dp=1, tp=2, loss_chunk=1024)
    assert TensorParallelPlan.problems(TrainConfig(loss_impl="liger", loss_chunk_tokens=1024), None, tp2) == [
        "loss_impl=liger with tensor_parallel 2: the LM head is split by vocabulary, and Liger's fused linear cross "
        "entropy needs each row's logits over the whole vocabulary on one rank (the chunked loss all-reduces them per "
        "chunk): set loss_impl=chunked (the chunked loss, the same numbers), or tensor_parallel=1"
    ]
    assert TensorParallelPlan.problems(TrainConfig(loss_chunk_tokens=1024), None, tp2) == []


def test_train_config_with_loss_impl_liger_is_refused_on_this_machine(tmp_path, tiny_hf):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    cfg = TrainConfig(model_name_or_path=tiny_hf, loss_impl="liger", data=DataConfig(train_file=str(data)))
    found = problems_of(cfg, world_size=1)
    assert "loss_impl=liger runs Liger's Triton kernels, which need a CUDA GPU" in found
    assert "loss_impl=liger needs the liger_kernel package" in found
    assert Layout.of(cfg, 1, {}).loss_impl == "liger" and Layout.of(TrainConfig(), 1, {}).loss_impl == "chunked"


@pytest.fixture()
def stand_in_flce(monkeypatch):
    """liger_kernel.transformers.functional.liger_fused_linear_cross_entropy computing what Liger's computes
    (cross entropy of input @ weight^T, ignore_index, mean or sum or none) with torch, each call's arguments listed."""
    calls = []

    def flce(input, weight, target, bias=None, ignore_index=-100, reduction="mean", **rest):
        calls.append(dict(input=input, weight=weight, target=target, bias=bias, ignore_index=ignore_index, **rest))
        calls[-1]["reduction"] = reduction
        logits = F.linear(input, weight).float()  # [M,V]
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    fake = types.ModuleType("liger_kernel.transformers.functional")
    fake.liger_fused_linear_cross_entropy = flce
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    return calls


def head_batch(vocab: int = 300, hidden: int = 32):
    """(hidden [3,40,H], weight [V,H], labels [3,40]): padding in row 0, a masked prompt in row 2: 96 label tokens."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 40, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    labels = torch.randint(0, vocab, (3, 40), generator=g)
    labels[0, 26:] = IGNORE_INDEX
    labels[2, :8] = IGNORE_INDEX
    return h, w, labels


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-6) -> None:
    """Relative L2 difference of ``a`` from ``b`` within ``tol`` (fp32 sums in another order differ per element)."""
    assert ((a.double() - b.double()).norm() / b.double().norm()).item() <= tol


def loss_grads(loss_fn, h, w, labels, logits: bool = False):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = loss_fn(F.linear(h, w) if logits else (h, w.view_as(w)), labels)  # the head hands out a view
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("scale", [None, 4 * 2 / 300], ids=["micro_batch_mean", "scaled_sum"])
def test_loss_impl_liger_hands_liger_the_label_rows_and_sums_as_the_chunked_loss(stand_in_flce, scale):
    """What the last stage's loss gives Liger (the stand-in): only the rows with a label, their targets (none ignored),
    the head weight itself, reduction sum; the loss and both gradients are the chunked loss's and the logits path's
    (micro-batch mean, and the scaled sum of loss_normalization=tokens). The real kernel's numbers:
    tests/test_gpu_parity.py."""
    h, w, labels = head_batch()
    losses = {}
    for name, loss_fn, logits in (
        ("liger", CausalLMLoss(16, impl="liger"), False),
        ("chunked", CausalLMLoss(16), False),
        ("logits", CausalLMLoss(0), True),
    ):
        loss_fn.scale = scale
        losses[name] = loss_grads(loss_fn, h, w, labels, logits)
    (call,) = stand_in_flce
    targets = shifted_targets(labels)
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    assert call["reduction"] == "sum" and call["ignore_index"] == IGNORE_INDEX and call["bias"] is None
    assert torch.equal(call["target"], targets[rows]) and call["input"].shape == (96, 32)
    torch.testing.assert_close(call["input"], h.reshape(-1, 32)[rows], rtol=0, atol=0)
    assert call["weight"].shape == w.shape
    for other in ("chunked", "logits"):
        for a, b in zip(losses["liger"], losses[other]):
            assert_rel_close(a, b)


def test_loss_impl_liger_without_label_tokens_and_with_a_sequence_slice(stand_in_flce):
    """A micro-batch with no label token never reaches Liger (an exact 0 sum, nan mean, zero gradients, as the chunked
    loss); with sequence parallelism each rank's slice gets its own targets, and the slices' sums add up to the
    whole's."""
    h, w, labels = head_batch()
    none = torch.full_like(labels, IGNORE_INDEX)
    for scale in (None, 0.5):
        fused, chunked = CausalLMLoss(16, impl="liger"), CausalLMLoss(16)
        fused.scale = chunked.scale = scale
        for a, b in zip(loss_grads(fused, h, w, none), loss_grads(chunked, h, w, none)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert stand_in_flce == []
    whole = CausalLMLoss(16, impl="liger")
    whole.scale = 1.0
    total = whole((h, w), labels)
    parts = 0.0
    for rank in range(2):
        part = CausalLMLoss(16, impl="liger")
        part.split_over(LossSplit(seq_slice=(rank, 2)))
        part.scale = 1.0
        parts = parts + part((h[:, rank * 20 : (rank + 1) * 20], w), labels)
        targets = shifted_targets(labels, (rank, 2))  # [B*S/2]
        assert torch.equal(stand_in_flce[-1]["target"], targets[targets != IGNORE_INDEX])
    assert_rel_close(parts, total)


def test_dpo_log_probabilities_through_liger_are_the_chunked_ones(stand_in_flce):
    """DPO's per-sequence sums (sequence_logps) take Liger's per-token losses (reduction none): the same sums and
    gradients as the chunked loss's."""
    h, w, labels = head_batch()
    out = {}
    for impl in ("liger", "chunked"):
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        logps = sequence_logps((hh, ww), labels, chunk_tokens=16, impl=impl)  # [3] fp64
        (logps * torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)).sum().backward()
        out[impl] = (logps.detach(), hh.grad, ww.grad)
    assert [c["reduction"] for c in stand_in_flce] == ["none"]
    for a, b in zip(out["liger"], out["chunked"]):
        assert_rel_close(a, b)
    loss = PreferenceLoss(16, beta=0.1, loss_type="sigmoid", impl="liger")
    assert loss.impl == "liger"


def test_loss_impl_needs_the_chunked_head_and_a_known_name():
    with pytest.raises(ValueError, match="loss_chunk_tokens > 0"):
        CausalLMLoss(0, impl="liger")
    with pytest.raises(ValueError, match="choose from"):
        CausalLMLoss(16).compute_head_with("fused")


def test_the_stage_build_gives_the_loss_the_layouts_loss_impl(tmp_path, stand_in_flce, monkeypatch):
    """parallel/stage.py's build (train.py's, with the loss training/build.py made from loss_chunk_tokens alone) sets
    the layout's loss_impl on the loss; the stage's loss then calls Liger (the stand-in) on the head's output."""
    import deepspeed
    import torch.distributed as dist

    from parallel.stage import build_pipeline_model, pipeline_topology

    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        layout = Layout(stages=1, dp=1, loss_chunk=16, loss_impl="liger")
        loss = CausalLMLoss(16)  # as training/build.py builds it
        model = build_pipeline_model(tiny_config(), pipeline_topology(layout), layout, loss)
    finally:
        dist.destroy_process_group()
    assert model.loss_fn is loss and loss.impl == "liger"
    ids = torch.randint(0, 100, (2, 12))
    out = model((ids, torch.arange(12).repeat(2, 1)))  # (hidden, weight): the chunked head's hand-over
    loss(out, ids).backward()
    assert len(stand_in_flce) == 1 and stand_in_flce[0]["input"].shape[0] == 2 * 11


# ------------------------------------------------------------ adamw_impl: torch's fused AdamW or DeepSpeed's FusedAdam


def test_adamw_impl_picks_the_optimizer_deepspeed_builds(monkeypatch, tmp_path, tiny_hf):
    from training import optim
    from training.configuration.validate import resolve

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    params = {}
    for impl in ("torch_fused", "deepspeed"):
        cfg = TrainConfig(model_name_or_path=tiny_hf, adamw_impl=impl, data=DataConfig(train_file=str(data)))
        params[impl] = optim.fill_ds_config(resolve(cfg, 1))["optimizer"]["params"]
    assert params["torch_fused"]["torch_adam"] is True and params["torch_fused"]["fused"] is True
    assert params["deepspeed"]["torch_adam"] is False and "fused" not in params["deepspeed"]  # FusedAdam's kwargs
    assert {k: v for k, v in params["deepspeed"].items() if k not in ("torch_adam",)} == {
        k: v for k, v in params["torch_fused"].items() if k not in ("torch_adam", "fused")
    }

    assert optim.adamw_problems("torch_fused", "cuda") == [] and optim.adamw_problems("deepspeed", "cpu") == []
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "CUDA_HOME", None)
    monkeypatch.setitem(optim.installed_ops, "fused_adam", False)
    (problem,) = optim.adamw_problems("deepspeed", "cuda")
    assert "needs the CUDA toolkit (nvcc)" in problem and "set adamw_impl=torch_fused" in problem
    monkeypatch.setattr(cpp, "CUDA_HOME", "/usr/local/cuda")
    assert optim.adamw_problems("deepspeed", "cuda") == []


@pytest.mark.parametrize(
    "value, readable",
    [
        ("9.0a", "9.0"),  # the H200 image's: DeepSpeed 0.19.8's builder raised ValueError: invalid literal ... '0a'
        ("8.0 9.0a 10.0f+PTX", "8.0;9.0;10.0+PTX"),
        ("9.0;9.0a", "9.0"),
        ("8.0;9.0+PTX", None),  # readable as it is
        ("", None),
        (None, None),
    ],
)
def test_arch_list_suffixes_deepspeed_cannot_read_are_dropped(value, readable):
    from training import optim

    assert optim.deepspeed_arch_list(value) == readable
    if readable:  # what DeepSpeed's builder does with it (op_builder/builder.py, compute_capability_args)
        for cc in readable.split(";"):
            tuple(int(part.split("+")[0]) for part in cc.split("."))


def test_the_arch_list_is_made_readable_only_while_the_engine_is_built(monkeypatch, capsys):
    from training import optim

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(optim, "accelerator_name", lambda: "cuda")
    with optim.readable_arch_list("torch_fused"):
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"  # torch's AdamW builds nothing
    with optim.readable_arch_list("deepspeed"):
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"
    assert "TORCH_CUDA_ARCH_LIST='9.0a' read as '9.0'" in capsys.readouterr().out
    monkeypatch.setattr(optim, "accelerator_name", lambda: "cpu")
    with optim.readable_arch_list("deepspeed"):  # DeepSpeed's C++ FusedAdam: no CUDA architectures
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"
