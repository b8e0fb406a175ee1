"""LoRA through the pipeline (peft.method=lora), against Hugging Face PEFT in one process.

Fast tier: the adapter-key mapping against PEFT's own state dict, a one-process forward against
``get_peft_model``, and the configuration's refusals. Multi-rank: pipe 2 x data 2, 5 fp32 steps started
from a PEFT adapter saved by the reference (peft.init_from), against ``get_peft_model`` + torch AdamW on
the same global batches (untied with the LM head trained fully, and tied with activation checkpointing; the
tied one also as pipe 2 x data 1 with pipeline_schedule=dualpipev and grad_acc 4, the same global batch);
the exported adapter and merged model against the reference's; optimizer states of adapters only; an
exact resume; a resume on another base refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from models.files.hf_convert import hf_to_stages
from models.files.peft_adapter import adapter_key, file_sha256, spec_key
from models.files.pipeline_dir import local_modules
from models.llama_pipe import LlamaStack, spec_layout
from models.lora import apply_lora, lora_config, trainable_state
from models.tiny import save_random_model, tiny_config, write_random_tokens
from tests.support.parity import MICRO, NUM_SAMPLES, REL_TOL, SEQ, STEPS, reference_run, rel, train_args
from tests.support.ranks import run_deepspeed
from tests.support.runs import read_metrics
from tests.support.scripts import load_entry_point
from tests.test_config import problems_of
from training.checkpoints.reshard import SavedOptimizerState
from training.configuration.schema import DataConfig, PeftConfig, TrainConfig
from training.configuration.validate import resolve

LORA = dict(r=4, alpha=8.0)  # the runs' adapters; dropout 0 (the reference draws no masks)
DUALPIPEV_PIPE2 = {"pipeline_schedule": "dualpipev", "gradient_accumulation_steps": 4, "data.pad_to_multiple_of": 0}


def peft_settings(**overrides) -> PeftConfig:
    return PeftConfig(method="lora", **{**LORA, **overrides})


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dora", [False, True])
def test_adapter_keys_are_pefts_own(tied, dora):
    """Every trained tensor of the stages maps to the key PEFT's get_peft_model_state_dict gives it, and
    back (modules_to_save lm_head on the untied model; DoRA's magnitude vectors)."""
    config = tiny_config(tie_word_embeddings=tied)
    settings = peft_settings(use_dora=dora, modules_to_save=[] if tied else ["lm_head"])
    stack = LlamaStack(config)
    apply_lora(local_modules(stack), config, settings, seed=0)
    layout = spec_layout(config)
    ours = {
        adapter_key(layout[i], k): (layout[i].file_index, k)
        for i, m in local_modules(stack)
        for k in trainable_state(m)
    }
    reference = set(get_peft_model_state_dict(get_peft_model(LlamaForCausalLM(config), lora_config(settings))))
    assert set(ours) == reference
    assert all(spec_key(layout, key) == ours[key] for key in reference)
    frozen = [k for _, m in local_modules(stack) for k, p in m.named_parameters() if not p.requires_grad]
    assert frozen and all("lora_" not in k for k in frozen)


def test_initial_adapters_depend_on_the_seed_and_spec_only():
    """Every data-parallel replica draws the same initial adapters: seeded per spec, not per rank or process."""
    config = tiny_config()

    def adapters(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed + 100)  # the process's own generator state must not matter
        stack = LlamaStack(config)
        apply_lora(local_modules(stack), config, peft_settings(), seed=seed)
        return {f"{i}.{k}": t.detach().clone() for i, m in local_modules(stack) for k, t in trainable_state(m).items()}

    a, b, c = adapters(0), adapters(0), adapters(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "lora_A" in k)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_stage_forward_equals_get_peft_model(model_type):
    """For every family, the stages with PEFT's layers injected compute the logits of get_peft_model on
    the same weights (adapters copied over with non-zero B, so the LoRA branch counts: without it the
    logits differ); Qwen2's biased q/k/v projections keep their bias under the adapter."""
    config = tiny_config(model_type, sliding_window=8) if model_type == "mistral" else tiny_config(model_type)
    torch.manual_seed(0)
    reference = get_peft_model(
        _causal_lm(config), lora_config(peft_settings(target_modules=["q_proj", "v_proj", "up_proj"]))
    )
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    stack = LlamaStack(config)
    apply_lora(local_modules(stack), config, peft_settings(target_modules=["q_proj", "v_proj", "up_proj"]), seed=0)
    layout, reference_state = spec_layout(config), reference.state_dict()
    with torch.no_grad():
        for index, module in local_modules(stack):
            for key, t in module.state_dict(keep_vars=True).items():  # both injected by PEFT: the same names
                t.copy_(reference_state["base_model.model." + layout[index].hf_prefix + key])
    ids = torch.randint(3, config.vocab_size, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    ours, theirs = stack(ids, pos), reference(input_ids=ids).logits
    base = reference.get_base_model()
    with reference.disable_adapter():
        plain = base(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    assert (plain - theirs).abs().max() > 1e-3


@pytest.fixture()
def lora_cfg(tmp_path, tiny_ckpt) -> TrainConfig:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    return TrainConfig(
        model_name_or_path=tiny_ckpt,  # LoRA's base is layer files (a Hugging Face directory is refused)
        output_dir=str(tmp_path / "out"),
        num_stages=2,
        ds_config="zero1",
        micro_batch_size=2,
        gradient_accumulation_steps=2,
        data=DataConfig(train_file=str(data)),
        peft=peft_settings(),
    )


def test_lora_config_resolves(lora_cfg):
    assert resolve(lora_cfg, world_size=4).lora


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_name_or_path=""), "adapts a trained base: set model_name_or_path"),
        (dict(peft=peft_settings(target_modules=["q_proj", "qkv"])), "unknown: qkv"),
        (dict(peft=peft_settings(modules_to_save=["norm"])), "peft.modules_to_save ['norm'] unknown"),
        (dict(peft=peft_settings(r=0)), "peft.r 0 < 1"),
        (dict(num_stages=1, ds_config="zero2"), "data-parallel engine, which this version does not adapt"),
        (dict(peft=peft_settings(init_from="/nonexistent")), "peft.init_from /nonexistent: no such directory"),
        # parameters: the 4-layer model's embedding + layer 0 | layers 1-3 | norm + head on three stages
        (dict(num_stages=4, partition_method="uniform"), "hold no decoder layer, hence nothing to train"),
    ],
)
def test_lora_settings_refused_before_start(lora_cfg, change, message):
    for key, value in change.items():
        setattr(lora_cfg, key, value)
    assert message in problems_of(lora_cfg, world_size=4)


def test_init_from_with_other_settings_refused_before_start(lora_cfg, tmp_path):
    adapter = str(tmp_path / "adapter")
    model = LlamaForCausalLM(tiny_config())
    get_peft_model(model, lora_config(peft_settings(r=2, target_modules=["q_proj"]))).save_pretrained(adapter)
    lora_cfg.peft = peft_settings(init_from=adapter)
    message = problems_of(lora_cfg, world_size=4)
    assert "differs from the peft settings: r 2 in" in message and "target_modules ['q_proj'] in" in message
    lora_cfg.peft = peft_settings(r=2, target_modules=["q_proj"], init_from=adapter)
    assert resolve(lora_cfg, world_size=4).lora


def test_qlora_without_bitsandbytes_refused_before_start(lora_cfg, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a)
    )
    lora_cfg.peft = peft_settings(quantize="nf4")
    assert "bitsandbytes, which is not installed" in problems_of(lora_cfg, world_size=4)


def test_tied_model_refuses_modules_to_save(lora_cfg, tiny_tied_hf):
    lora_cfg.model_name_or_path = tiny_tied_hf
    lora_cfg.peft = peft_settings(modules_to_save=["lm_head"])
    assert "with tied embeddings" in problems_of(lora_cfg, world_size=4)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_planner_counts_the_adapters_peft_makes(model_type):
    """The planner's adapter count per decoder layer equals what get_peft_model adds, GQA and Qwen3's
    explicit head_dim included; a LoRA layout's model states are below full fine-tuning's."""
    from parallel.layout import Layout
    from parallel.memory_plan import estimate, model_state_bytes, shape_of

    targets = ["q_proj", "v_proj", "down_proj"]
    config = tiny_config(model_type, head_dim=24) if model_type == "qwen3" else tiny_config(model_type)
    model = get_peft_model(
        LlamaForCausalLM(config) if model_type == "llama" else _causal_lm(config),
        lora_config(peft_settings(r=4, target_modules=targets)),
    )
    adapters = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    shape = shape_of(config)
    assert shape.lora_params_per_layer(4, tuple(targets)) * config.num_hidden_layers == adapters
    full = Layout(stages=2, dp=2, zero=1, dtype="fp32")
    lora = Layout(stages=2, dp=2, zero=1, dtype="fp32", lora_rank=4, lora_targets=tuple(targets))
    psi = [5e6, 5e6]
    e_full, e_lora = estimate(psi, full, shape, [2, 2]), estimate(psi, lora, shape, [2, 2])
    trained = 2 * shape.lora_params_per_layer(4, tuple(targets))
    # The frozen base at 4 bytes (fp32) + the adapters costing what trained parameters cost.
    assert e_lora.model_states == 4 * psi[1] + sum(model_state_bytes(trained, full)[:3])
    assert e_lora.model_states < e_full.model_states / 3
    # QLoRA: the decoder's linear weights (the planner's count is the model's) at NF4_BYTES instead of 4.
    from parallel.memory_plan import NF4_BYTES

    layer = model.get_base_model().model.layers[0]
    weights = [p for n, p in layer.named_parameters() if n.endswith("proj.weight") or n.endswith("base_layer.weight")]
    assert shape.linear_params_per_layer() == sum(p.numel() for p in weights)
    e_nf4 = estimate(psi, dataclasses.replace(lora, nf4=True), shape, [2, 2])
    assert e_nf4.model_states == e_lora.model_states - (4 - NF4_BYTES) * 2 * shape.linear_params_per_layer()


def test_nf4_quantisation_is_transformers_own(tiny_hf):
    """quantize_nf4_ on a decoder layer gives the state (NF4 bytes, absmax, code) and the logits of
    transformers' BitsAndBytesConfig(load_in_4bit=True) loading, bit for bit."""
    from models.lora import quantize_nf4_

    settings = peft_settings(quantize="nf4")
    reference = LlamaForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32, **quantized(settings))
    ours = LlamaForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32)
    state = {}
    for layer in ours.model.layers:
        quantize_nf4_(layer, torch.float32, "cpu")
        layer.register_state_dict_post_hook(lambda m, sd, prefix, meta: state.update(sd))  # after its own hook
    theirs = reference.state_dict()
    ours.state_dict()
    quant_keys = [k for k in theirs if ".weight." in k and "layers." in k]
    assert quant_keys and all(k not in state for k in quant_keys)  # no quantisation state saved
    for name, p in ours.named_parameters():
        assert torch.equal(p.data, theirs[name].data), name
        if hasattr(p, "quant_state"):
            ref = reference.get_parameter(name).quant_state
            assert torch.equal(p.quant_state.absmax, ref.absmax) and torch.equal(p.quant_state.code, ref.code)
    ids = torch.randint(3, 512, (2, 16))
    assert torch.equal(ours(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize("dora", [False, True])
def test_qlora_stage_forward_equals_get_peft_model_on_transformers_4bit(tiny_hf, dora):
    """QLoRA stages (PEFT's bitsandbytes LoRA layers, as get_peft_model makes on a 4-bit model: DoRA's
    weight norm needs the dequantised weight) give the logits of get_peft_model on transformers' 4-bit
    loading, in train and in eval mode."""
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    settings = peft_settings(quantize="nf4", use_dora=dora, target_modules=["q_proj", "down_proj"])
    base = LlamaForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32, **quantized(settings))
    reference = get_peft_model(base, lora_config(settings))
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    config = reference.config
    stack, layout = LlamaStack(config), spec_layout(config)
    plain = LlamaForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).state_dict()
    with torch.no_grad():
        for index, module in local_modules(stack):
            for key, t in module.state_dict().items():
                t.copy_(plain[layout[index].hf_prefix + key])
    apply_lora(local_modules(stack), config, settings, seed=0)
    reference_state = reference.state_dict()
    with torch.no_grad():
        for index, module in local_modules(stack):
            for key, t in module.named_parameters():
                if t.requires_grad:
                    t.copy_(reference_state["base_model.model." + layout[index].hf_prefix + key])
    assert isinstance(local_modules(stack)[1][1].self_attn.q_proj, LoraLinear4bit)
    ids = torch.randint(3, config.vocab_size, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    reference.train()  # bitsandbytes' CPU 4-bit layers repack their weights for a bf16 kernel in eval mode
    expected = reference(input_ids=ids).logits
    assert torch.allclose(stack(ids, pos), expected, atol=1e-5)
    stack.eval()
    with torch.no_grad():  # as train.py's eval runs: ours must not repack (and stay exact in training after)
        assert torch.allclose(stack(ids, pos), expected, atol=1e-5)
    stack.train()
    assert torch.allclose(stack(ids, pos), expected, atol=1e-5)


def _causal_lm(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


# -- multi-rank: pipe 2 x data 2 against get_peft_model + AdamW ------------------------------------------


def reference_adapter(hf_dir: str, settings: PeftConfig, out: str, seed: int = 1):
    """get_peft_model on ``hf_dir`` (fp32), its initial adapter saved to ``out`` (peft.init_from of the run)."""
    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="sdpa", **quantized(settings)
    )
    model = get_peft_model(base, lora_config(settings))
    with torch.no_grad():  # B != 0 from the start, so the first step's gradients reach A too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model.save_pretrained(out)
    return model


def quantized(settings: PeftConfig) -> dict:
    """from_pretrained's arguments for QLoRA: transformers' own 4-bit loading (bitsandbytes, NF4, fp32 compute)."""
    if settings.quantize != "nf4":
        return {}
    from transformers import BitsAndBytesConfig

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    return {"quantization_config": nf4, "device_map": "cpu"}


def overrides(settings: PeftConfig, init_from: str) -> dict:
    return {
        "peft.quantize": settings.quantize,
        "peft.method": "lora",
        "peft.r": settings.r,
        "peft.alpha": settings.alpha,
        "peft.modules_to_save": "[" + ",".join(settings.modules_to_save) + "]",
        "peft.init_from": init_from,
    }


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_hf, tiny_tied_hf, tiny_ckpt, tiny_tied_ckpt):
    root = tmp_path_factory.mktemp("lora")
    data = str(root / "train.jsonl")
    samples = write_random_tokens(data, NUM_SAMPLES, SEQ, vocab_size=512)
    runs = {}
    for name, hf_dir, settings, extra in (
        ("untied", tiny_hf, peft_settings(modules_to_save=["lm_head"]), {"save_steps": 3, "save_async": "true"}),
        ("tied", tiny_tied_hf, peft_settings(), {"activation_checkpoint_interval": 1}),
        ("qlora", tiny_hf, peft_settings(quantize="nf4"), {"save_steps": 0}),
        # DualPipeV on 2 ranks (the same global batch of 8): the tied embedding and LM head one module on rank 0
        ("dualpipev", tiny_tied_hf, peft_settings(), {**DUALPIPEV_PIPE2, "activation_checkpoint_interval": 1}),
    ):
        ckpt = tiny_ckpt if hf_dir == tiny_hf else tiny_tied_ckpt  # the session's conversion, read only
        reference = reference_adapter(hf_dir, settings, str(root / f"init_{name}"))
        layout = {"num_stages": 2, "gradient_accumulation_steps": 2, "ds_config": "zero1", **extra}
        args = train_args(
            ckpt,
            data,
            str(root / name),
            **overrides(settings, str(root / f"init_{name}")),
            **layout,
        )
        # The untied run checks at exit that every rank's frozen base still equals the base's layer files.
        script = "tests/ds_scripts/train_checking_frozen_base.py" if name == "untied" else "train.py"
        proc = run_deepspeed(2 if name == "dualpipev" else 4, script, args, str(root / f"{name}.log"))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        if name == "qlora":
            reference.train()  # bitsandbytes' CPU 4-bit layers repack their weights for a bf16 kernel in eval mode
        losses, _, norms, trained = reference_run(hf_dir, samples, MICRO * 4, model=reference)
        runs[name] = dict(hf=hf_dir, ckpt=ckpt, args=args, losses=losses, norms=norms, model=trained, log=proc.stdout)
    return root, runs


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["untied", "tied", "qlora", "dualpipev"])
def test_lora_pipeline_trains_what_peft_trains(lora_runs, name):
    root, runs = lora_runs
    run = runs[name]
    metrics = read_metrics(str(root / name))
    diffs = [rel(m["loss"], r) for m, r in zip(metrics, run["losses"])]
    norm_diffs = [rel(m["grad_norm"], total) for m, (total, _) in zip(metrics, run["norms"])]
    print(f"{name}: LoRA pipeline vs get_peft_model + AdamW: loss {max(diffs):.2e}, norm {max(norm_diffs):.2e}")
    assert len(metrics) == STEPS and max(diffs) < REL_TOL and max(norm_diffs) < 1e-5
    # The adapters moved far beyond the tolerance below: a run that did not train them would fail it.
    export = str(root / f"{name}_adapter")
    load_entry_point("convert2ckpt.py").main(["--to-hf", "--input", str(root / name), "--output", export])
    ours = load_file(os.path.join(export, "adapter_model.safetensors"))
    initial = load_file(str(root / f"init_{name}" / "adapter_model.safetensors"))
    reference = get_peft_model_state_dict(run["model"])
    assert set(ours) == set(reference) == set(initial)
    assert max((ours[k] - reference[k]).abs().max().item() for k in ours) < 1e-5
    assert max((reference[k] - initial[k]).abs().max().item() for k in ours) > 1e-3
    assert f"peft: {'QLoRA' if name == 'qlora' else 'LoRA'} r=4 alpha=8" in run["log"] and "base frozen" in run["log"]


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["untied", "tied", "dualpipev"])
def test_exported_adapter_loads_in_peft_and_merges(lora_runs, name):
    """PeftModel.from_pretrained(<base>, exported adapter) and the --merge export give the reference's logits."""
    root, runs = lora_runs
    run = runs[name]
    adapter, merged = str(root / f"{name}_rt_adapter"), str(root / f"{name}_merged")
    convert = load_entry_point("convert2ckpt.py").main
    assert convert(["--to-hf", "--input", str(root / name), "--output", adapter, "--base-model", run["hf"]]) == 0
    assert convert(["--to-hf", "--merge", "--input", str(root / name), "--output", merged]) == 0
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == run["hf"]
    ids = torch.randint(3, 512, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = run["model"](input_ids=ids).logits
        loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(run["hf"], dtype=torch.float32), adapter)
        merged_logits = LlamaForCausalLM.from_pretrained(merged, dtype=torch.float32)(input_ids=ids).logits
        base_logits = LlamaForCausalLM.from_pretrained(run["hf"], dtype=torch.float32)(input_ids=ids).logits
        assert (loaded(input_ids=ids).logits - expected).abs().max() < 1e-4
    assert (merged_logits - expected).abs().max() < 1e-4
    assert (base_logits - expected).abs().max() > 1e-2  # the adapters change the model


@pytest.mark.multirank
def test_exports_use_the_base_the_adapters_were_trained_on(lora_runs, tmp_path, capsys):
    """Merge and adapter export take the recorded base tag, check its SHA-256s, and check a --base-model
    directory tensor by tensor: a base trained on since, a changed or moved base, another model."""
    root, runs = lora_runs
    run_dir, convert = str(root / "untied"), load_entry_point("convert2ckpt.py").main
    base = tmp_path / "base"
    shutil.copytree(runs["untied"]["ckpt"], base)
    shutil.copytree(base / "global_step0", base / "global_step3")  # the base trained on after the LoRA run began
    embedding = base / "global_step3" / "layer_00-model_states.pt"
    torch.save({k: t + 1e-2 for k, t in torch.load(embedding).items()}, embedding)
    (base / "latest").write_text("global_step3")

    def export(name: str, *extra: str) -> tuple[int, str]:
        capsys.readouterr()
        rc = convert(["--to-hf", "--input", run_dir, "--output", str(tmp_path / name), *extra])
        return rc, capsys.readouterr().err

    assert export("merged_recorded", "--merge")[0] == 0
    assert export("merged_moved", "--merge", "--base-checkpoint", str(base))[0] == 0
    a = load_file(str(tmp_path / "merged_recorded" / "model.safetensors"))
    b = load_file(str(tmp_path / "merged_moved" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # global_step0, not 'latest'

    recorded = base / "global_step0" / "layer_00-model_states.pt"
    torch.save({k: t + 1e-2 for k, t in torch.load(recorded).items()}, recorded)
    rc, err = export("changed", "--merge", "--base-checkpoint", str(base))
    assert rc == 1 and f"{recorded} differs in content (SHA-256)" in err and "--base-checkpoint DIR" in err
    rc, err = export("gone", "--base-checkpoint", str(tmp_path / "nowhere"))
    assert rc == 1 and f"--base-checkpoint {tmp_path / 'nowhere'} does not exist" in err

    other = tmp_path / "other_hf"
    save_random_model(tiny_config(), str(other), seed=7, dtype=torch.float32)
    rc, err = export("other", "--base-model", str(other))
    assert rc == 1 and "is not the base the adapters were trained on" in err and "embed_tokens.weight differs" in err
    assert export("default")[0] == 0  # no --base-model: the Hugging Face directory the base was converted from
    with open(tmp_path / "default" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.realpath(runs["untied"]["hf"])


@pytest.mark.multirank
def test_base_weights_are_bit_identical_after_training(lora_runs):
    """Every rank's frozen base weights at the end of the untied run (5 steps, AdamW with weight decay on
    its groups) equal the base checkpoint's layer files bit for bit."""
    _, runs = lora_runs
    lines = [line for line in runs["untied"]["log"].splitlines() if line.startswith("FROZEN_BASE")]
    print("\n".join(lines))
    assert len(lines) == 4 and all(" 0 differ" in line for line in lines)
    assert all(int(line.split(": ")[1].split()[0]) > 0 for line in lines)


@pytest.mark.multirank
def test_checkpoint_holds_adapters_and_their_optimizer_states_only(lora_runs, tiny_hf):
    """The layer files hold the trained tensors only, the optimizer states exist for exactly those, and
    the base on disk is untouched (its files' SHA-256 as recorded when the run loaded it)."""
    root, runs = lora_runs
    tag_dir = root / "untied" / "global_step5"
    config = tiny_config()
    stack = LlamaStack(config)
    apply_lora(local_modules(stack), config, peft_settings(modules_to_save=["lm_head"]), seed=0)
    trained = {(i, k) for i, m in local_modules(stack) for k in trainable_state(m)}
    saved = {(int(f[6:8]), k) for f in os.listdir(tag_dir) if f.startswith("layer_") for k in torch.load(tag_dir / f)}
    optimizer = SavedOptimizerState(str(tag_dir))
    assert not optimizer.problems
    assert saved == trained == set(optimizer.keys())
    frozen = sum(p.numel() for _, m in local_modules(stack) for p in m.parameters() if not p.requires_grad)
    assert sum(optimizer.numel(k) for k in optimizer.keys()) < frozen / 4
    with open(tag_dir / "trainer_state_rank00000.json") as f:
        record = json.load(f)["peft_base"]
    base = Path(runs["untied"]["ckpt"]) / "global_step0"
    assert record["sha256"] and all(file_sha256(str(base / f)) == h for f, h in record["sha256"].items())


@pytest.mark.multirank
def test_resume_is_exact_and_refuses_another_base(lora_runs, tmp_path):
    root, runs = lora_runs
    out = tmp_path / "resumed"
    shutil.copytree(root / "untied", out)
    shutil.rmtree(out / "global_step5")
    (out / "latest").write_text("global_step3")
    args = [a if not a.startswith("output_dir=") else f"output_dir={out}" for a in runs["untied"]["args"]]
    proc = run_deepspeed(4, "train.py", args, str(tmp_path / "resume.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    straight = {m["step"]: m["loss"] for m in read_metrics(str(root / "untied"))}
    resumed = [m for m in read_metrics(str(out)) if m["step"] > 3]
    assert [m["step"] for m in resumed[-2:]] == [4, 5]
    assert all(m["loss"] == straight[m["step"]] for m in resumed[-2:])
    a = load_file_tensors(out / "global_step5")
    b = load_file_tensors(root / "untied" / "global_step5")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Another base under the same settings: refused, naming the files that differ.
    other = tmp_path / "other_hf"
    save_random_model(tiny_config(), str(other), seed=7, dtype=torch.float32)
    hf_to_stages(str(other), str(tmp_path / "other_ckpt"))
    args = [
        a if not a.startswith("model_name_or_path=") else f"model_name_or_path={tmp_path / 'other_ckpt'}" for a in args
    ]
    proc = run_deepspeed(4, "train.py", [*args, "max_steps=6", "resume_allow_changes=[model]"], str(tmp_path / "b.log"))
    assert proc.returncode != 0
    assert "its adapters were trained on the base in" in proc.stderr and "differ(s) in content" in proc.stderr


@pytest.mark.multirank
def test_resume_on_another_layout_continues_the_run(lora_runs, tmp_path):
    """The untied run's step-3 checkpoint (pipe 2 x data 2, ZeRO-1) resumed on pipe 1 x data 2 directly,
    and on pipe 2 x data 1 (ZeRO-0, twice the accumulation: the same global batch) from convert2ckpt.py
    --reshard's portable form: steps 4-5 as the uninterrupted run's, within the parity tolerance (the
    reductions run in another order)."""
    root, runs = lora_runs
    straight = {m["step"]: m for m in read_metrics(str(root / "untied"))}
    source = tmp_path / "step3"
    shutil.copytree(root / "untied", source)
    shutil.rmtree(source / "global_step5")
    (source / "latest").write_text("global_step3")
    portable = tmp_path / "portable"
    assert (
        load_entry_point("convert2ckpt.py").main(["--reshard", "--input", str(source), "--output", str(portable)]) == 0
    )
    for out, layout in (
        (source, {"num_stages": 1, "ds_config": "zero1", "gradient_accumulation_steps": 2}),
        (portable, {"num_stages": 2, "ds_config": "zero0", "gradient_accumulation_steps": 4}),
    ):
        replaced = ("output_dir=", "num_stages=", "ds_config=", "gradient_accumulation_steps=")
        args = [a for a in runs["untied"]["args"] if not a.startswith(replaced)]
        args += [f"output_dir={out}", *(f"{k}={v}" for k, v in layout.items())]
        proc = run_deepspeed(2, "train.py", args, str(tmp_path / f"{out.name}.log"))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        assert "was saved on another layout" in proc.stdout and "from global_step3" in proc.stdout
        resumed = [m for m in read_metrics(str(out)) if m["step"] > 3]
        assert [m["step"] for m in resumed[-2:]] == [4, 5]
        assert all(m["tokens"] == straight[m["step"]]["tokens"] for m in resumed[-2:])  # the same global batch
        diffs = [rel(m["loss"], straight[m["step"]]["loss"]) for m in resumed[-2:]]
        print(f"LoRA resumed on {layout}: loss {max(diffs):.2e}")
        assert max(diffs) < REL_TOL
    # On another layout too (pipe 1 x data 2 from the pipe 2 x data 1 run's step 5), another base under
    # the same settings is refused.
    save_random_model(tiny_config(), str(tmp_path / "other_hf"), seed=7, dtype=torch.float32)
    hf_to_stages(str(tmp_path / "other_hf"), str(tmp_path / "other_ckpt"))
    replaced = ("model_name_or_path=", "num_stages=", "gradient_accumulation_steps=")
    args = [a for a in args if not a.startswith(replaced)]
    args += [f"model_name_or_path={tmp_path / 'other_ckpt'}", "num_stages=1", "gradient_accumulation_steps=2"]
    proc = run_deepspeed(2, "train.py", [*args, "max_steps=6", "resume_allow_changes=[model]"], str(tmp_path / "b.log"))
    assert proc.returncode != 0 and "was saved on another layout" in proc.stdout
    assert "its adapters were trained on the base in" in proc.stderr and "differ(s) in content" in proc.stderr


def load_file_tensors(tag_dir) -> dict[str, torch.Tensor]:
    return {
        f"{f}:{k}": t
        for f in sorted(os.listdir(tag_dir))
        if f.startswith("layer_")
        for k, t in torch.load(tag_dir / f).items()
    }
