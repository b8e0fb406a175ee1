"""Each family of 2026 (gemma3_text, gemma4_text, qwen3_5_text, qwen3_5_moe_text, gpt_oss, deepseek_v3) with each
setting that takes a path of its own either is refused before start, naming the family and the reason, or runs with
a parity test: the matrix of docs/models.md ("What each family runs with"), :data:`MATRIX` here.

Fast: train.py's configuration check (``resolve``) of each (family, setting) adds, beyond the lines Llama gets with the
same setting, the family's refusal where the matrix says refused and nothing where it names a test; the docs' table is
the matrix. Slow (one process, fp32): activation checkpointing (DeepSpeed's checkpoint function, as the stage chooses
it, and the one-stage engine's call for the dense ones) recomputes the gradients of the stages without it, bit for bit,
for every family that runs it, and counts DeepSeek-V3's expert loads once; the DPO loss and its gradients through the
stages equal those of the family's ``ForCausalLM`` (Gemma 3, Gemma 4, Qwen3.5); Gemma 3's QLoRA stages give the logits
of ``get_peft_model`` on transformers' 4-bit loading; Gemma 3's stages captured by torch.compile compute what they
compute eagerly.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from models.families import family_of
from models.llama_pipe import NormPipe, build_sequential, init_weights_, spec_layout
from models.loss import IGNORE_INDEX, PreferenceLoss, causal_lm_loss
from models.tiny import tiny_config
from tests.support import REPO
from tests.test_stage_parity import TOL, copy_hf_weights, module_of, parity_batch, run_chain
from training.configuration.schema import ConfigError, TrainConfig
from training.configuration.validate import resolve

FAMILIES = ("gemma3_text", "gemma4_text", "qwen3_5_text", "qwen3_5_moe_text", "gpt_oss", "deepseek_v3")
# The docs' column -> the settings train.py is given (TrainConfig names; num_stages=2, ZeRO-1 besides).
SETTINGS = {
    "tensor_parallel=2": {"tensor_parallel": 2},
    "sequence_parallel=2": {"sequence_parallel": 2},
    "pipeline_schedule=dualpipev": {"pipeline_schedule": "dualpipev", "gradient_accumulation_steps": 4},
    "peft.method=lora": {"peft.method": "lora"},
    "QLoRA (peft.quantize=nf4)": {"peft.method": "lora", "peft.quantize": "nf4"},
    "compile=true": {"compile": True},
    "activation_checkpoint_interval=1": {"activation_checkpoint_interval": 1},
    "train_objective=dpo": {"train_objective": "dpo", "data.format": "dpo"},
    "train_objective=grpo": {"train_objective": "grpo", "data.format": "grpo"},
    "kernels=liger": {"kernels": "liger"},
    "attention=dense_mask": {"attention": "dense_mask"},
}

# the refused cells' reasons, each explained under the docs' table
MOE, DELTANET, GEMMA4, LIGER = "refused: MoE", "refused: DeltaNet", "refused: Gemma 4's wire", "refused: not in Liger"


def refused(cell: str, line: str) -> tuple[str, str]:
    """A refused cell: the docs' text and a piece of the line train.py refuses it with."""
    return cell, line


def parity_in(module: str) -> tuple[str, None]:
    """A cell that runs: the docs' text naming the module of its parity test."""
    return f"test {module}", None


def _moe(setting: str, model_type: str) -> tuple[str, str]:
    return refused(MOE, f"{setting} with a Mixture-of-Experts model ({model_type}) is not supported yet")


def _gemma4(setting: str) -> tuple[str, str]:
    return refused(GEMMA4, f"{setting} with Gemma 4 (gemma4_text)")


def _deltanet(setting: str, model_type: str) -> tuple[str, str]:
    return refused(DELTANET, f"{setting} with model_type {model_type} (Qwen3.5: Gated DeltaNet")


LIGER_LINE = "kernels=liger covers the dense families llama, mistral, qwen2, qwen3, not model_type"
COMPILE_MOE = "compile=true with the Mixture-of-Experts model_type"


def _moe_row(model_type: str, family_tests: str) -> dict:
    """A Mixture-of-Experts family's row: the axes, PEFT and DPO refused by expert parallelism's rules, compile by
    training/compile.py's; GRPO's generation and attention=dense_mask tested in ``family_tests``."""
    return {
        "tensor_parallel=2": _moe("tensor_parallel", model_type),
        "sequence_parallel=2": _moe("sequence_parallel", model_type),
        "pipeline_schedule=dualpipev": _moe("pipeline_schedule=dualpipev", model_type),
        "peft.method=lora": _moe("peft.method=lora", model_type),
        "QLoRA (peft.quantize=nf4)": _moe("peft.method=lora", model_type),
        "compile=true": refused(MOE, COMPILE_MOE),
        "activation_checkpoint_interval=1": parity_in("test_family_axes"),
        "train_objective=dpo": _moe("train_objective=dpo", model_type),
        "train_objective=grpo": parity_in(family_tests),
        "kernels=liger": refused(LIGER, LIGER_LINE),
        "attention=dense_mask": parity_in(family_tests),
    }


# family -> setting -> (the docs' cell, a piece of the refusal's line; None where it runs)
MATRIX: dict[str, dict[str, tuple[str, str | None]]] = {
    "gemma3_text": {
        "tensor_parallel=2": parity_in("test_sequence_parallel"),  # tensor 2 x sequence 2
        "sequence_parallel=2": parity_in("test_sequence_parallel"),
        "pipeline_schedule=dualpipev": parity_in("test_dualpipev"),
        "peft.method=lora": parity_in("test_family_gemma3"),
        "QLoRA (peft.quantize=nf4)": parity_in("test_family_axes"),
        "compile=true": parity_in("test_family_axes"),
        "activation_checkpoint_interval=1": parity_in("test_dualpipev"),
        "train_objective=dpo": parity_in("test_family_axes"),
        "train_objective=grpo": parity_in("test_family_gemma3"),  # generation equals generate
        "kernels=liger": refused(LIGER, LIGER_LINE),
        "attention=dense_mask": parity_in("test_family_gemma3"),
    },
    "gemma4_text": {
        "tensor_parallel=2": _gemma4("tensor_parallel=2"),
        "sequence_parallel=2": _gemma4("sequence_parallel=2"),
        "pipeline_schedule=dualpipev": _gemma4("pipeline_schedule=dualpipev"),
        "peft.method=lora": _gemma4("peft.method=lora"),
        "QLoRA (peft.quantize=nf4)": _gemma4("peft.method=lora"),
        "compile=true": _gemma4("compile=True"),
        "activation_checkpoint_interval=1": _gemma4("activation_checkpoint_interval=1"),
        "train_objective=dpo": parity_in("test_family_axes"),
        "train_objective=grpo": _gemma4("train_objective=grpo"),
        "kernels=liger": refused(LIGER, LIGER_LINE),
        "attention=dense_mask": parity_in("test_family_gemma4"),
    },
    "qwen3_5_text": {
        "tensor_parallel=2": _deltanet("tensor_parallel 2", "qwen3_5_text"),
        "sequence_parallel=2": _deltanet("sequence_parallel 2", "qwen3_5_text"),
        "pipeline_schedule=dualpipev": parity_in("test_dualpipev"),
        "peft.method=lora": _deltanet("peft.method=lora", "qwen3_5_text"),
        "QLoRA (peft.quantize=nf4)": _deltanet("peft.method=lora", "qwen3_5_text"),
        "compile=true": _deltanet("compile=true", "qwen3_5_text"),
        "activation_checkpoint_interval=1": parity_in("test_family_axes"),
        "train_objective=dpo": parity_in("test_family_axes"),
        "train_objective=grpo": _deltanet("train_objective=grpo", "qwen3_5_text"),
        "kernels=liger": refused(LIGER, LIGER_LINE),
        "attention=dense_mask": parity_in("test_family_qwen3_5"),
    },
    "qwen3_5_moe_text": {
        **_moe_row("qwen3_5_moe_text", "test_family_qwen3_5"),
        "compile=true": _deltanet("compile=true", "qwen3_5_moe_text"),
        "train_objective=grpo": _deltanet("train_objective=grpo", "qwen3_5_moe_text"),
    },
    "gpt_oss": _moe_row("gpt_oss", "test_family_gpt_oss"),
    "deepseek_v3": _moe_row("deepseek_v3", "test_family_deepseek_v3"),
}
# deepseek_v3's tiny config has 3 decoder layers: 4, so that DualPipeV's 4 pieces are refused for the family alone
ARCHITECTURE = {"deepseek_v3": {"num_hidden_layers": 4}}


@functools.cache
def architecture(model_type: str) -> dict:
    """``model.architecture`` of the family's tiny config."""
    config = tiny_config(model_type, **ARCHITECTURE.get(model_type, {})).to_diff_dict()
    return {k: v for k, v in config.items() if k not in ("transformers_version", "architectures")}


@functools.cache
def added_lines(model_type: str, setting: str) -> tuple[str, ...]:
    """What train.py's configuration check refuses for ``model_type`` with ``setting``: every line, in order (no
    tokenizer and no data are given, the same lines for every family; no disk check)."""
    cfg = TrainConfig(num_stages=2, ds_config="zero1", output_dir="/nonexistent/out", min_free_disk_gb=0)
    cfg.model.architecture, cfg.model.tokenizer = dict(architecture(model_type)), "/nonexistent"
    for key, value in SETTINGS[setting].items():
        section, _, name = key.rpartition(".")
        setattr(getattr(cfg, section) if section else cfg, name, value)
    world_size = cfg.num_stages * cfg.tensor_parallel * cfg.sequence_parallel
    try:
        resolve(cfg, world_size)
    except ConfigError as e:
        return tuple(line.strip() for line in str(e).splitlines()[1:])
    return ()


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_setting_is_refused_for_the_family_or_runs(model_type, setting):
    """The lines beyond Llama's with the same setting: the family's refusal (each naming its model_type), or none."""
    cell, refusal = MATRIX[model_type][setting]
    llama = set(added_lines("llama", setting))
    ours = [line for line in added_lines(model_type, setting) if line not in llama]
    if refusal is None:
        assert ours == [], ours
    else:
        assert any(refusal in line for line in ours), ours
        assert all(model_type in line for line in ours), ours


def test_the_docs_table_is_the_matrix():
    """docs/models.md's "What each family runs with": a row per family, a column per setting, the cells of
    :data:`MATRIX`."""
    with open(os.path.join(REPO, "docs", "models.md")) as f:
        text = f.read()
    section = text.split("### What each family runs with", 1)[1].split("\n#", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| `")]
    header = next(line for line in section.splitlines() if line.startswith("| family"))
    assert [c.strip().replace("`", "") for c in header.strip("|").split("|")][1:] == list(SETTINGS)
    table = {cells[0].strip().strip("`"): [c.strip().replace("`", "") for c in cells[1:]] for cells in rows}
    assert table == {f: [MATRIX[f][s][0] for s in SETTINGS] for f in FAMILIES}


# -- one process: what the cells that run are tested with ----------------------------------------------------


def stage_gradients(funcs) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{k}": p.grad
        for i, f in enumerate(funcs)
        if module_of(f) is not None
        for k, p in module_of(f).named_parameters()
        if p.grad is not None
    }


@pytest.mark.slow  # importing DeepSpeed's checkpointing; 0.1 s a family
@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_5_text", "qwen3_5_moe_text", "gpt_oss", "deepseek_v3"])
def test_activation_checkpointing_recomputes_the_stages_gradients(model_type):
    """Each decoder layer run through the checkpoint function the stage gets (parallel/stage.py's
    checkpoint_function, DeepSpeed's reentrant one otherwise), as DeepSpeed's pipeline runs a chunk of one layer, and
    for a dense family the one-stage engine's checkpointed call (``LlamaStack``, num_stages=1 with ZeRO 2/3): the
    loss and every gradient equal those without it, and DeepSeek-V3's expert loads are counted once (its
    recomputation inside the backward is not a training forward)."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint

    from models.families import moe_spec
    from models.family_deepseek_v3 import ExpertLoads
    from models.llama_pipe import DecoderLayerPipe, LlamaStack
    from parallel.stage import checkpoint_function

    # gpt-oss with the router loss: routing statistics on the wire, the non-reentrant checkpoint
    config = tiny_config(model_type, **({"output_router_logits": True} if model_type == "gpt_oss" else {}))
    recompute = checkpoint_function(config).get("activation_checkpoint_func", checkpoint)
    assert (recompute is checkpoint) == (model_type != "gpt_oss")
    torch.manual_seed(0)
    input_ids, position_ids, labels = parity_batch(config.vocab_size)
    results = []
    # the one-stage engine runs dense models only (a MoE model needs the pipeline engine)
    for mode in ("none", "pipeline", "one_stage") if moe_spec(config) is None else ("none", "pipeline"):
        stack = LlamaStack(config, activation_checkpointing=True)
        funcs = stack.forward_funcs
        for f in funcs:
            if isinstance(f, torch.nn.Module):
                init_weights_(f, config, seed=1)
            if isinstance(f, NormPipe):
                f.router_sink = lambda *stats: None  # the router loss's statistics reach the norm: not compared here
        loads = ExpertLoads(stack)
        x = (input_ids, position_ids)
        if mode == "one_stage":
            x = stack(*x)
        for f in funcs if mode != "one_stage" else ():
            if mode == "pipeline" and isinstance(f, DecoderLayerPipe):
                x = recompute(lambda *inputs, f=f: f(inputs), *x)
            else:
                x = f(x)
        loss = causal_lm_loss(x, labels)
        loss.backward()
        results.append((loss.detach(), stage_gradients(funcs), loads.take()))
    (loss, grads, loads), *checkpointed = results
    for ckpt_loss, ckpt_grads, ckpt_loads in checkpointed:
        assert torch.equal(loss, ckpt_loss) and grads.keys() == ckpt_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(ckpt_grads[name], grad, rtol=0, atol=0, msg=name)
        assert all(torch.equal(loads[name], ckpt_loads[name]) for name in loads)
    assert len(results) == (3 if model_type in ("gemma3_text", "qwen3_5_text") else 2)
    assert bool(loads) == (model_type == "deepseek_v3") and all(n.sum() > 0 for n in loads.values())


@pytest.mark.slow  # 0.1-0.2 s a family
@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma4_text", "qwen3_5_text"])
def test_dpo_through_the_stages_equals_the_familys_causal_lm(model_type):
    """DPO's loss (models/loss.py's PreferenceLoss, per-sequence log-probabilities from the chunked head) on two pairs
    of right-padded rows with masked prompts, through the stages and from the family's ``ForCausalLM`` logits with the
    same weights: the loss and every gradient within the stage tolerance."""
    torch.manual_seed(0)
    config = tiny_config(model_type)
    hf = family_of(config).causal_lm._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    funcs = build_sequential(config, loss_chunk_tokens=16)
    copy_hf_weights(funcs, config, hf.state_dict())
    input_ids = torch.randint(3, config.vocab_size, (4, 24))  # chosen rows 0-1, rejected 2-3
    labels = input_ids.clone()
    labels[:, :6] = IGNORE_INDEX  # the prompts
    for row, end in ((1, 18), (2, 20)):  # right padding
        input_ids[row, end:], labels[row, end:] = 0, IGNORE_INDEX
    reference = torch.tensor([-40.0, -41.0, -42.0, -39.0], dtype=torch.float64)
    target = (labels, torch.arange(2), reference)
    ours = PreferenceLoss(16, 0.1, "sigmoid")(run_chain(funcs, input_ids, torch.arange(24).expand(4, 24)), target)
    theirs = PreferenceLoss(0, 0.1, "sigmoid")(hf(input_ids=input_ids, use_cache=False).logits, target)
    assert abs(ours.item() - theirs.item()) < TOL
    ours.backward()
    theirs.backward()
    checked = 0
    for info in spec_layout(config):
        if info.owns_file:
            for key, p in module_of(funcs[info.index]).named_parameters():
                expected = hf.get_parameter(info.hf_prefix + key).grad
                torch.testing.assert_close(p.grad, expected, rtol=0, atol=TOL, msg=info.hf_prefix + key)
                checked += 1
    assert checked == len(list(hf.parameters()))


@pytest.mark.slow  # importing peft and bitsandbytes
def test_gemma3_qlora_stages_equal_get_peft_model_on_transformers_4bit(tmp_path):
    """tests/test_lora.py's QLoRA check on Gemma 3: PEFT's bitsandbytes LoRA layers in the stages, on the NF4 base,
    give the logits of ``get_peft_model`` on transformers' own 4-bit loading of the same model (adapters with a
    non-zero B, so they count)."""
    from peft import get_peft_model
    from peft.tuners.lora.bnb import Linear4bit
    from transformers import AutoModelForCausalLM

    from models.files.pipeline_dir import local_modules
    from models.llama_pipe import LlamaStack
    from models.lora import apply_lora, lora_config
    from models.tiny import save_random_model
    from tests.test_lora import peft_settings, quantized

    save_random_model(tiny_config("gemma3_text"), str(tmp_path), seed=0, dtype=torch.float32)
    settings = peft_settings(quantize="nf4", target_modules=["q_proj", "down_proj"])
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, **quantized(settings)),
        lora_config(settings),
    )
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    config, state = reference.config, reference.state_dict()
    stack, layout = LlamaStack(config), spec_layout(config)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).state_dict()
    with torch.no_grad():
        for index, module in local_modules(stack):
            for key, t in module.state_dict().items():
                t.copy_(plain[layout[index].hf_prefix + key])
    apply_lora(local_modules(stack), config, settings, seed=0)
    with torch.no_grad():
        for index, module in local_modules(stack):
            for key, t in module.named_parameters():
                if t.requires_grad:
                    t.copy_(state["base_model.model." + layout[index].hf_prefix + key])
    assert isinstance(local_modules(stack)[1][1].self_attn.q_proj, Linear4bit)
    input_ids = torch.randint(3, config.vocab_size, (2, 16))
    reference.train()  # bitsandbytes' CPU 4-bit layers repack their weights for a bf16 kernel in eval mode
    expected = reference(input_ids=input_ids).logits
    torch.testing.assert_close(stack(input_ids, torch.arange(16).expand(2, 16)), expected, rtol=0, atol=TOL)
    with reference.disable_adapter():
        assert (reference(input_ids=input_ids).logits - expected).abs().max() > 100 * TOL


@pytest.mark.slow  # dynamo's capture of the stages
def test_gemma3_stages_compiled_compute_what_they_compute_eagerly(dynamo_without_guard_timing):
    """Every Gemma 3 stage module compiled as DeepSpeed's engine.compile() compiles it (``nn.Module.compile``; dynamo's
    capture, backend eager) on a sliding and a full layer, the scaled embedding and the tied head: logits and every
    gradient those of the eager stages."""
    torch.manual_seed(0)
    config = tiny_config("gemma3_text", num_hidden_layers=2, tie_word_embeddings=True)
    eager, compiled = build_sequential(config), build_sequential(config)
    for a, b in zip(eager, compiled):
        if isinstance(a, torch.nn.Module):
            init_weights_(a, config, seed=1)
            b.load_state_dict(a.state_dict())
            b.compile(backend="eager")
    torch._dynamo.reset()
    input_ids, position_ids, labels = parity_batch(config.vocab_size, packed=False)
    outputs = []
    for funcs in (compiled, eager):
        logits = run_chain(funcs, input_ids, position_ids)
        causal_lm_loss(logits, labels).backward()
        outputs.append((logits, stage_gradients(funcs)))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
