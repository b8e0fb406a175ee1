"""``fp8`` (torchao's float8 training, models/fp8.py): its validation lines, which linears its filter converts, and
a tiny Llama's stages converted with a recipe computing what torchao's conversion of ``LlamaForCausalLM`` computes.

The parity runs in fp32 on CPU, where torchao emulates the float8 matmuls exactly: the stages chained in one process
(and compiled with aot_eager), and pipe 2 x data 2 for 5 steps (its step-3 checkpoint resumed without fp8, and a run
without fp8 resumed from step 3 with it) against the converted model's AdamW loop; a filter that also converts the
LM head, or a stage left unconverted, misses by far more than the tolerance. The 4-rank run feeds rows of one document
each and the loss unchunked: there every float8 cast sees bit-identical inputs; packed rows or the chunked loss differ
from Hugging Face's by fp32 rounding, which flips e4m3 roundings that AdamW amplifies (docs/speed.md gives the figures).
train_objective=dpo in one process: the reference pass through the same converted stages and 3 steps of the DPO loss
against the converted model's loop with its own reference log-probabilities (a head converted too, a reference without
fp8, or no fp8 miss by far); train_objective=grpo refused, in train.py's validation and scripts/estimate_memory.py.
"""

from __future__ import annotations

import copy
import shutil
import time

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from models.fp8 import (
    RECIPES,
    convert_stage_to_float8_,
    convert_to_float8_,
    float8_filter,
    fp8_objective_problems,
    fp8_problems,
    skipped_projections,
)
from models.llama_pipe import build_sequential
from models.loss import IGNORE_INDEX, PreferenceLoss, causal_lm_loss, sequence_logps
from models.tiny import tiny_config
from parallel.layout import Layout
from tests.test_stage_parity import copy_hf_weights, module_of, parity_batch, run_chain, through_checkpointed_layers
from training.configuration.schema import ConfigError, DataConfig, PeftConfig, TrainConfig
from training.configuration.validate import fp8_setting_problems, resolve

REL_TOL = 1e-5  # loss and every gradient, relative to the reference's largest magnitude
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_fp8_problems_all_at_once():
    assert fp8_problems(None, "fp16", "lora", "mixtral", True) == []  # off: nothing asked
    bad = fp8_problems("e4m3", "bf16", "none", "llama", False)
    assert bad == [f"fp8=e4m3 is not a torchao recipe: set fp8 to one of {', '.join(RECIPES)}, or null (off)"]
    lines = fp8_problems("rowwise", "fp16", "qlora", "mixtral", True, "liger")
    assert [line.split(":")[0] for line in lines] == [
        "fp8=rowwise with precision=fp16",
        "fp8=rowwise with peft.method=qlora",
        "fp8=rowwise with the Mixture-of-Experts model_type mixtral",
        "fp8=rowwise with kernels=liger",
    ]
    assert all("fp8=null" in line for line in lines)  # each names the knob to change
    assert fp8_problems("tensorwise", "fp32", "none", "llama", False) == []  # CPU: runs (emulated)


def test_fp8_with_grpo_refused_in_one_line():
    (line,) = fp8_objective_problems("rowwise", "grpo")
    assert line.startswith("fp8=rowwise with train_objective=grpo: the completions generated through the stages' ")
    assert "not checked against TRL's GRPOTrainer" in line and line.endswith("leave fp8 off (fp8=null)")
    assert fp8_objective_problems("tensorwise", "dpo") == fp8_objective_problems("rowwise", "sft") == []
    assert fp8_objective_problems(None, "grpo") == fp8_objective_problems("e4m3", "grpo") == []  # off, or no recipe


def test_estimate_memory_fits_no_grpo_layout_with_fp8(capsys):
    """train.py's line in the script's flags, for one layout and for the fit search alike."""
    from tests.support.scripts import load_entry_point

    script = load_entry_point("scripts/estimate_memory.py")
    flags = ["--model", "llama3-8b", "--seq-len", "1536", "--grpo-completion-length", "1024", "--fp8", "rowwise"]
    for layout in (["--stages", "2", "--dp", "4"], ["--gpus", "8", "--gpu-mem", "80"]):
        with pytest.raises(SystemExit):
            script.main([*flags, *layout])
        assert capsys.readouterr().err == (
            "estimate_memory.py: error: --fp8 rowwise with --grpo-completion-length: the completions generated "
            "through the stages' Float8Linears and the old and reference log-probabilities are not checked against "
            "TRL's GRPOTrainer with a torchao-converted model: leave fp8 off (no --fp8)\n"
        )


def test_fp8_refused_on_a_gpu_without_float8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    (line,) = fp8_problems("rowwise", "bf16", "none", "llama", False)
    assert line.startswith("fp8=rowwise on NVIDIA A100-SXM4-80GB (compute capability 8.0)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert fp8_problems("rowwise", "bf16", "none", "llama", False) == []


def test_fp8_axes_and_engine_refused_together():
    cfg = TrainConfig(fp8="rowwise", precision="fp16", peft=PeftConfig(method="lora"))
    layout = Layout(stages=2, dp=1, tp=2, sp=2, schedule="dualpipev")
    heads = [line.split(":")[0] for line in fp8_setting_problems(cfg, tiny_config(), layout)]
    assert heads == [
        "fp8=rowwise with precision=fp16",
        "fp8=rowwise with peft.method=lora",
        "fp8=rowwise with tensor_parallel 2",
        "fp8=rowwise with sequence_parallel 2",
        "fp8=rowwise with pipeline_schedule=dualpipev",
    ]
    data_parallel_engine = Layout(stages=1, dp=2, zero=3)
    (line,) = fp8_setting_problems(TrainConfig(fp8="rowwise", ds_config="zero3"), tiny_config(), data_parallel_engine)
    assert line.startswith("fp8=rowwise runs on the pipeline engine; num_stages=1 with ds=zero3 (ZeRO 3)")
    assert fp8_setting_problems(TrainConfig(fp8="rowwise"), tiny_config(), Layout(stages=2, dp=2, zero=1)) == []
    assert len(fp8_setting_problems(TrainConfig(fp8="fp8"), tiny_config(), layout)) == 1  # the name alone


def test_train_config_refuses_before_start(tmp_path, tiny_hf):
    data = tmp_path / "train.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    cfg = TrainConfig(model_name_or_path=tiny_hf, data=DataConfig(train_file=str(data)), num_stages=2)
    cfg.fp8, cfg.tensor_parallel, cfg.optim.lr, cfg.train_objective = "rowwise", 2, -1.0, "grpo"
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world_size=4)
    lines = str(err.value).splitlines()
    assert any(line.startswith("  fp8=rowwise with tensor_parallel 2:") for line in lines)
    assert any(line.startswith("  optim.lr -1 < 0") for line in lines)  # with the other problems
    assert any(line.startswith("  fp8=rowwise with train_objective=grpo:") for line in lines)
    cfg.fp8, cfg.tensor_parallel, cfg.optim.lr, cfg.train_objective = "tensorwise", 1, 1e-4, "sft"
    assert resolve(cfg, world_size=2).cfg.fp8 == "tensorwise"


def tiny_stage(**overrides) -> nn.ModuleList:
    """A tiny Llama's specs as one stage (hidden 64, intermediate 176: multiples of 16)."""
    return nn.ModuleList(module_of(f) for f in build_sequential(tiny_config(num_hidden_layers=2, **overrides)))


def test_filter_chooses_decoder_projections_only():
    stage = tiny_stage()
    chosen = [fqn for fqn, module in stage.named_modules() if float8_filter(module, fqn)]
    assert chosen == [
        f"{i}.{part}.{name}" for i in (1, 2) for part, name in zip(["self_attn"] * 4 + ["mlp"] * 3, PROJECTIONS)
    ]  # not the embedding (0), the final norm (3) nor the head (4), an nn.Linear subclass
    assert float8_filter(nn.Linear(64, 64), "mlp.gate") is False  # a MoE router
    assert float8_filter(nn.Linear(64, 512), "lm_head") is False
    assert skipped_projections(stage) == []
    assert skipped_projections(tiny_stage(intermediate_size=40)) == [
        f"{i}.mlp.{name} ({sizes}, not multiples of 16)"
        for i in (1, 2)
        for name, sizes in [("gate_proj", "64 -> 40"), ("up_proj", "64 -> 40"), ("down_proj", "40 -> 64")]
    ]


@pytest.mark.slow
def test_conversion_keeps_the_state_dict_names():
    from torchao.float8.float8_linear import Float8Linear

    stage = tiny_stage(intermediate_size=40)
    keys = list(stage.state_dict())
    converted, skipped = convert_stage_to_float8_(stage, "rowwise")
    assert [c.rsplit(".", 1)[-1] for c in converted] == PROJECTIONS[:4] * 2 and len(skipped) == 6
    assert all(isinstance(stage.get_submodule(c), Float8Linear) for c in converted)
    assert type(stage[-1]).__name__ == "LMHeadPipe"  # the head stays
    assert list(stage.state_dict()) == keys  # layer files, resume and export read the same names


def relative_miss(funcs, hf, batch) -> float:
    """The largest miss of the chained ``funcs`` against ``hf`` over the loss and every gradient, each relative to
    the reference's largest magnitude (backward run on both)."""
    input_ids, position_ids, labels = batch
    for p in [*hf.parameters(), *(p for f in funcs for p in module_of(f).parameters())]:
        p.grad = None
    ref = hf(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False).loss
    loss = causal_lm_loss(run_chain(funcs, input_ids, position_ids), labels)
    ref.backward()
    loss.backward()
    worst = abs(loss.item() - ref.item()) / abs(ref.item())
    config = hf.config
    from models.specs import spec_layout

    for info in spec_layout(config):
        if info.owns_file:
            for key, param in module_of(funcs[info.index]).named_parameters():
                ref_grad = hf.get_parameter(info.hf_prefix + key).grad
                worst = max(worst, ((param.grad - ref_grad).abs().max() / ref_grad.abs().max()).item())
    return worst


def fp8_pair(recipe: str = "rowwise", hf_filter=float8_filter, unconverted_stage: int | None = None, seed: int = 0):
    """A tiny Llama and its stages (two, as a pipe-2 split cuts them) with the same weights, both converted with
    ``recipe``: the stages by convert_stage_to_float8_ each, the model by torchao with ``hf_filter``."""
    torch.manual_seed(seed)
    config = tiny_config(num_hidden_layers=4, hidden_size=64, intermediate_size=176, vocab_size=320)
    hf = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    funcs = build_sequential(config)
    copy_hf_weights(funcs, config, hf.state_dict())
    stages = [nn.ModuleList(module_of(f) for f in funcs[:3]), nn.ModuleList(module_of(f) for f in funcs[3:])]
    for i, stage in enumerate(stages):
        if i != unconverted_stage:
            convert_stage_to_float8_(stage, recipe)
    convert_to_float8_(hf, recipe, hf_filter)
    return funcs, hf, parity_batch(config.vocab_size, packed=False)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_stages_equal_torchao_converted_hf(recipe):
    funcs, hf, batch = fp8_pair(recipe)
    assert relative_miss(funcs, hf, batch) < REL_TOL


@pytest.mark.slow
def test_a_wrong_conversion_misses_by_far():
    head_too = lambda module, fqn: float8_filter(module, fqn) or fqn == "lm_head"  # noqa: E731
    assert relative_miss(*fp8_pair(hf_filter=head_too)) > 100 * REL_TOL
    assert relative_miss(*fp8_pair(unconverted_stage=1)) > 100 * REL_TOL
    unconverted_hf = fp8_pair(hf_filter=lambda module, fqn: False)
    assert relative_miss(*unconverted_hf) > 100 * REL_TOL  # fp8 changes the numbers: the test can see it


@pytest.mark.slow
def test_state_dict_round_trip_across_fp8():
    """A converted stage loads an unconverted one's state dict and the other way: fp8 resumes either way."""
    plain, converted = tiny_stage(), tiny_stage()
    convert_stage_to_float8_(converted, "rowwise")
    converted.load_state_dict(plain.state_dict(), strict=True)
    plain.load_state_dict(converted.state_dict(), strict=True)
    for (name, a), (_, b) in zip(plain.state_dict().items(), converted.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def loss_and_grads(funcs, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    input_ids, position_ids, labels = batch
    params = [p for f in funcs for p in module_of(f).parameters()]
    for p in params:
        p.grad = None
    loss = causal_lm_loss(run_chain(funcs, input_ids, position_ids), labels)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_activation_checkpointing_recomputes_the_fp8_layers_exactly(recipe):
    """activation_checkpoint_interval=1 with fp8: DeepSpeed's checkpointing of each converted layer (as the pipeline
    runs it) recomputes the same float8 casts and scales in the backward: the loss and every gradient equal the
    uncheckpointed stages' to the bit, and a wrong conversion still misses."""
    funcs, _, batch = fp8_pair(recipe)
    input_ids, position_ids, labels = batch
    loss, grads = loss_and_grads(funcs, batch)
    params = [p for f in funcs for p in module_of(f).parameters()]
    for p in params:
        p.grad = None
    checkpointed = causal_lm_loss(
        funcs[-1](funcs[-2](through_checkpointed_layers(funcs, input_ids, position_ids))), labels
    )
    checkpointed.backward()
    assert torch.equal(checkpointed.detach(), loss)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    plain, _, _ = fp8_pair(recipe, unconverted_stage=1)
    assert not torch.equal(loss_and_grads(plain, batch)[0], loss)  # fp8 shows in the loss: the test can see a miss


@pytest.mark.slow
def test_compiled_fp8_stages_equal_the_uncompiled(dynamo_without_guard_timing):
    """compile=true with fp8: each layer of the converted stages compiled in place as DeepSpeed's
    PipelineModule.compile does (training/compile.py), with aot_eager: dynamo's capture and AOTAutograd's joint graph
    through torchao's float8 casts and scaled matmuls, no codegen (inductor, train.py's CPU backend, is the same
    graphs lowered). Loss and every gradient equal the uncompiled converted stages'."""
    from torch._dynamo.utils import counters  # seconds to import: not at collection
    from torchao.float8.float8_linear import Float8Linear

    funcs, hf, batch = fp8_pair()
    compiled = copy.deepcopy(funcs)
    for layer in compiled:
        layer.compile(backend="aot_eager")  # every spec of an untied Llama is a module
    torch._dynamo.reset()
    counters.clear()
    loss, grads = loss_and_grads(funcs, batch)
    compiled_loss, compiled_grads = loss_and_grads(compiled, batch)
    worst = max(
        [abs(compiled_loss.item() - loss.item()) / abs(loss.item())]
        + [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(compiled_grads, grads, strict=True)]
    )
    assert worst < REL_TOL, worst
    assert counters["stats"]["unique_graphs"] > 0  # it did compile
    assert sum(isinstance(m, Float8Linear) for f in compiled for m in module_of(f).modules()) == 28
    assert relative_miss(compiled, hf, batch) < REL_TOL  # and equals torchao's converted LlamaForCausalLM


def step_seconds(funcs, batch, repeats: int = 3) -> float:
    input_ids, position_ids, labels = batch
    start = time.perf_counter()
    for _ in range(repeats):
        causal_lm_loss(run_chain(funcs, input_ids, position_ids), labels).backward()
    return (time.perf_counter() - start) / repeats


@pytest.mark.slow
def test_cpu_cost_of_the_emulation(capsys):
    """Not a bound: the seconds of one forward and backward of the tiny model with and without fp8 (the note's)."""
    funcs, _, batch = fp8_pair()
    plain_stage = build_sequential(
        tiny_config(num_hidden_layers=4, hidden_size=64, intermediate_size=176, vocab_size=320)
    )
    step_seconds(funcs, batch, 1), step_seconds(plain_stage, batch, 1)  # warm-up
    with capsys.disabled():
        fp8, fp32 = step_seconds(funcs, batch), step_seconds(plain_stage, batch)
        print(f"\n[fp8] tiny Llama fwd+bwd: fp8 rowwise {fp8:.4f} s, fp32 {fp32:.4f} s ({fp8 / fp32:.1f}x)")


# -- pipe 2 x data 2 against one process ------------------------------------------------------------------

SEQ, GAS, DP = 128, 2, 2  # whole rows (data.pad_to_multiple_of=0): float8's scales span a micro-batch's tokens


WRONG_FILTERS = {
    "head converted too": lambda module, fqn: float8_filter(module, fqn) or fqn == "lm_head",
    "layers 2-3 (stage 1) unconverted": lambda module, fqn: (
        float8_filter(module, fqn) and (".layers.0." in fqn or ".layers.1." in fqn)
    ),
    "no fp8": lambda module, fqn: False,
}


def unconvert_(model: nn.Module) -> None:
    """Each Float8Linear of ``model`` back to an nn.Linear holding the same parameters (the optimizer's)."""
    from torchao.float8.float8_linear import Float8Linear

    for fqn, module in list(model.named_modules()):
        if isinstance(module, Float8Linear):
            parent, _, name = fqn.rpartition(".")
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            plain.weight, plain.bias = module.weight, module.bias
            setattr(model.get_submodule(parent), name, plain)


def fp8_reference_run(
    hf_dir: str,
    steps: list[list],
    recipe: str,
    hf_filter=float8_filter,
    plain_from: int | None = None,
    fp8_from: int = 0,
) -> tuple[list[float], nn.Module]:
    """sft_reference_run's loop (tests/support/parity.py) over ``LlamaForCausalLM`` converted by torchao with
    ``recipe`` and ``hf_filter`` before step ``fp8_from`` + 1 (a resume with fp8 on when > 0); from step
    ``plain_from`` + 1 on without fp8 (a resume with fp8=null). The optimizer holds the same parameters throughout."""
    from transformers import AutoModelForCausalLM

    from models.loss import label_tokens
    from tests.support.parity import SFT_OPTIM, STEPS, hf_loss
    from training.configuration.schema import OptimConfig
    from training.optim import lr_lambda, param_groups

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    cfg = TrainConfig(optim=OptimConfig(**SFT_OPTIM))
    opt = torch.optim.AdamW(
        param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, STEPS))
    losses = []
    for step, micro_batches in enumerate(steps):
        if step == fp8_from:
            convert_to_float8_(model, recipe, hf_filter)  # torchao's Float8Linear takes the nn.Linear's parameters
        if step == plain_from:
            unconvert_(model)
        n = sum(label_tokens(labels) for _, labels in micro_batches)
        loss = sum(hf_loss(model, mb, torch.tensor(n)) for mb in micro_batches)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.multirank
def test_pipe2_data2_fp8_equals_the_converted_hugging_face_loop(tmp_path, tokenizer_dir):
    from models.families import load_config
    from models.files.hf_convert import hf_to_stages
    from models.tiny import write_uneven_sft
    from tests.support.models import make_hf_dir
    from tests.support.parity import (
        MICRO,
        SFT_OPTIM,
        STEPS,
        cached_rows,
        global_batches,
        max_rel_weight_diff,
        parity_args,
        rel,
        trained_weights,
    )
    from tests.support.ranks import train_run
    from tests.support.runs import read_metrics

    data = str(tmp_path / "train.jsonl")
    write_uneven_sft(data, 200, seed=0)
    hf_dir = make_hf_dir(tmp_path, tokenizer_dir, "hf")
    hf_to_stages(hf_dir, str(tmp_path / "ckpt"))
    overrides = dict(num_stages=2, gradient_accumulation_steps=GAS, ds_config="zero1", save_steps=3)
    rows = ["data.format=sft", "data.packing=false", "data.pad_to_multiple_of=0", "loss_chunk_tokens=0"]

    def launch(name: str, fp8: str):
        args = parity_args(
            str(tmp_path / "ckpt"), data, str(tmp_path / name), SEQ, MICRO, STEPS, SFT_OPTIM, **overrides
        )
        return train_run(tmp_path, name, 4, [*args, *rows, f"fp8={fp8}"])

    start = time.perf_counter()
    proc = launch("run", "rowwise")
    seconds = time.perf_counter() - start

    def from_step_3(run: str, name: str, fp8: str):
        """``run``'s step-3 checkpoint resumed with ``fp8``, as a crash right after saving it would leave the run."""
        shutil.copytree(tmp_path / run, tmp_path / name)
        shutil.rmtree(tmp_path / name / f"global_step{STEPS}")
        (tmp_path / name / "latest").write_text("global_step3")
        return launch(name, fp8)

    resumed_log = from_step_3("run", "resumed", "null").stdout
    # The other way: a run without fp8 (all 5 steps: its cosine schedule over 3 would move steps 2-3) resumed with it.
    launch("plain", "null")
    fp8_resumed = from_step_3("plain", "fp8_resumed", "rowwise")
    fp8_resumed_log = fp8_resumed.stdout + fp8_resumed.stderr
    assert (
        "fp8=rowwise: 56 linear layers in torchao's Float8Linear (14, 14, 14, 14 per rank)" in proc.stdout + proc.stderr
    )
    steps, *_ = global_batches(cached_rows(str(tmp_path / "cache"), data), dp=DP, gas=GAS, steps=STEPS)
    losses, model = fp8_reference_run(hf_dir, steps, "rowwise")
    metrics = read_metrics(str(tmp_path / "run"))
    loss_diff = max(rel(m["loss"], r) for m, r in zip(metrics, losses, strict=True))
    trained = trained_weights(str(tmp_path / "run"), load_config(hf_dir))
    weight_diff = max_rel_weight_diff(trained, model)
    misses, wrong_models = {}, {}
    for name, hf_filter in WRONG_FILTERS.items():
        wrong, wrong_models[name] = fp8_reference_run(hf_dir, steps, "rowwise", hf_filter)
        loss_miss = max(rel(m["loss"], r) for m, r in zip(metrics, wrong, strict=True))
        misses[name] = (loss_miss, max_rel_weight_diff(trained, wrong_models[name]))
    print(
        f"\n[fp8] pipe 2 x data 2, {STEPS} steps in {seconds:.1f} s: loss {loss_diff:.2e}, weights {weight_diff:.2e}; "
        + ", ".join(f"{name}: loss {loss:.1e}, weights {weights:.1e}" for name, (loss, weights) in misses.items())
    )
    assert loss_diff < REL_TOL and weight_diff < REL_TOL
    assert all(loss > 10 * REL_TOL and weights > 100 * REL_TOL for loss, weights in misses.values()), misses
    assert losses[-1] < losses[0] - 0.05  # it learns

    assert f"steps 4..{STEPS} (resumed from global_step3)" in resumed_log and "Float8Linear" not in resumed_log
    plain_losses, plain_model = fp8_reference_run(hf_dir, steps, "rowwise", plain_from=3)
    resumed = [m["loss"] for m in read_metrics(str(tmp_path / "resumed")) if m["step"] > 3]  # after the copied ones
    resumed_diff = max(rel(loss, r) for loss, r in zip(resumed, plain_losses[3:], strict=True))
    resumed_trained = trained_weights(str(tmp_path / "resumed"), load_config(hf_dir))
    resumed_weights = max_rel_weight_diff(resumed_trained, plain_model)
    print(f"[fp8] resumed at step 3 without fp8: loss {resumed_diff:.2e}, weights {resumed_weights:.2e}")
    assert resumed_diff < REL_TOL and resumed_weights < REL_TOL
    assert max_rel_weight_diff(resumed_trained, model) > 10 * REL_TOL  # steps 4-5 really ran without fp8

    assert f"steps 4..{STEPS} (resumed from global_step3)" in fp8_resumed_log
    assert "fp8=rowwise: 56 linear layers in torchao's Float8Linear" in fp8_resumed_log
    fp8_losses, fp8_model = fp8_reference_run(hf_dir, steps, "rowwise", fp8_from=3)
    fp8_resumed = [m["loss"] for m in read_metrics(str(tmp_path / "fp8_resumed")) if m["step"] > 3]
    fp8_resumed_diff = max(rel(loss, r) for loss, r in zip(fp8_resumed, fp8_losses[3:], strict=True))
    fp8_trained = trained_weights(str(tmp_path / "fp8_resumed"), load_config(hf_dir))
    fp8_resumed_weights = max_rel_weight_diff(fp8_trained, fp8_model)
    plain_miss = max_rel_weight_diff(fp8_trained, wrong_models["no fp8"])
    print(
        f"[fp8] resumed at step 3 with fp8 (run without): loss {fp8_resumed_diff:.2e}, weights "
        f"{fp8_resumed_weights:.2e}; against no fp8 at all: weights {plain_miss:.1e}"
    )
    assert fp8_resumed_diff < REL_TOL and fp8_resumed_weights < REL_TOL
    assert plain_miss > 10 * REL_TOL  # steps 4-5 really ran in fp8


# -- train_objective=dpo: the reference pass through the same converted stages --------------------------------

DPO_BETA, DPO_LR, DPO_STEPS, PAIRS, PROMPT = 0.1, 5e-3, 3, 4, 12


def dpo_batches(vocab_size: int, seq: int = 48, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """Each step's pairs as collate_pairs lays them out: (input_ids, position_ids, labels) [2B,S], the B chosen rows
    then the B rejected ones, each pair's prompt shared and masked in the labels, padding at the end."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(DPO_STEPS):
        ids = torch.randint(0, vocab_size, (2 * PAIRS, seq), generator=g)
        ids[PAIRS:, :PROMPT] = ids[:PAIRS, :PROMPT]
        labels = ids.clone()
        labels[:, :PROMPT] = IGNORE_INDEX
        padding = torch.arange(seq) >= torch.randint(seq // 2, seq + 1, (2 * PAIRS, 1), generator=g)
        ids[padding], labels[padding] = 0, IGNORE_INDEX
        batches.append((ids, torch.arange(seq).repeat(2 * PAIRS, 1), labels))
    return batches


def stage_dpo_run(funcs, batches) -> list[float]:
    """train.py's DPO on the chained stages: the reference pass first (training/dpo.py's compute_reference: forward
    only through the same stages, eval mode, the loss recording each pair's log-probabilities), then AdamW steps of
    PreferenceLoss. Returns each step's loss."""
    loss_fn = PreferenceLoss(0, DPO_BETA, "sigmoid")
    modules = [module_of(f) for f in funcs]
    unknown = torch.full((2 * PAIRS,), float("nan"), dtype=torch.float64)
    loss_fn.recording = []
    with torch.no_grad():
        for m in modules:
            m.eval()
        for step, (ids, pos, labels) in enumerate(batches):
            loss_fn(run_chain(funcs, ids, pos), (labels, torch.arange(PAIRS) + step * PAIRS, unknown))
        for m in modules:
            m.train()
    references, loss_fn.recording = [logps.double() for _, logps in loss_fn.recording], None
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=DPO_LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for step, ((ids, pos, labels), reference) in enumerate(zip(batches, references, strict=True)):
        loss = loss_fn(run_chain(funcs, ids, pos), (labels, torch.arange(PAIRS) + step * PAIRS, reference))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def completion_logps(model, ids, pos, labels) -> torch.Tensor:
    """Each row's completion log-probability [2B] from the model's logits, as the reference table holds it (float64).
    sequence_logps, the loss's own (TRL's sum, tests/test_dpo.py): another fp32 summation order would round the
    gradients reaching the float8 casts differently, and AdamW amplifies each flipped e4m3 rounding."""
    return sequence_logps(model(input_ids=ids, position_ids=pos, use_cache=False).logits, labels).double()


def hf_dpo_run(hf, batches, reference=None) -> list[float]:
    """DPOTrainer's loop on ``hf`` (the torchao-converted model) with precompute_ref_log_probs: every pair's reference
    log-probabilities first, by ``hf`` itself under no_grad (or by ``reference``), then TRL's sigmoid loss and AdamW.
    Returns each step's loss."""
    from tests.test_dpo import dpo_formula

    with torch.no_grad():
        references = [completion_logps(hf if reference is None else reference, *batch) for batch in batches]
    opt = torch.optim.AdamW(hf.parameters(), lr=DPO_LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for batch, ref in zip(batches, references, strict=True):
        loss = dpo_formula(*completion_logps(hf, *batch).chunk(2), *ref.chunk(2), DPO_BETA, "sigmoid")
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def weights_miss(funcs, hf) -> float:
    """The largest difference of a stage's weight from ``hf``'s, relative to that tensor's largest magnitude."""
    from models.specs import spec_layout

    worst = 0.0
    for info in spec_layout(hf.config):
        if info.owns_file:
            for key, param in module_of(funcs[info.index]).named_parameters():
                ref = hf.get_parameter(info.hf_prefix + key)
                worst = max(worst, ((param - ref).abs().max() / ref.abs().max()).item())
    return worst


def dpo_miss(hf_filter=float8_filter, plain_reference: bool = False) -> tuple[float, float]:
    """(loss, weights) of train.py's DPO on converted stages against the Hugging Face loop on the model torchao
    converts with ``hf_filter`` (``plain_reference``: its reference an unconverted copy, DPOTrainer's default when
    handed a converted policy: it loads the reference from the model's path), after DPO_STEPS steps."""
    funcs, hf, _ = fp8_pair(hf_filter=hf_filter)
    reference = None
    if plain_reference:
        reference = copy.deepcopy(hf)
        unconvert_(reference)
    batches = dpo_batches(hf.config.vocab_size)
    ours, theirs = stage_dpo_run(funcs, batches), hf_dpo_run(hf, batches, reference)
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True)), weights_miss(funcs, hf)


def test_the_dpo_reference_is_stored_per_fp8_recipe(tmp_path):
    """A run with fp8 never reads a reference table computed without it (or with another recipe): the key names it."""
    from training.dpo import reference_key

    (tmp_path / "model.safetensors").write_bytes(b"0")
    keys = [reference_key(TrainConfig(model_name_or_path=str(tmp_path), fp8=fp8), None) for fp8 in (None, *RECIPES)]
    assert len(set(keys)) == 1 + len(RECIPES)


@pytest.mark.slow
def test_dpo_with_fp8_equals_the_converted_hugging_face_loop(capsys):
    """fp8=rowwise with train_objective=dpo: the reference log-probabilities from the same converted stages (the
    reference pass), then 3 steps, against DPOTrainer's loop on torchao's converted model: loss and weights within
    REL_TOL; the head converted too, the reference without fp8 or no fp8 at all miss by far."""
    loss, weights = dpo_miss()
    misses = {
        "head converted too": dpo_miss(lambda module, fqn: float8_filter(module, fqn) or fqn == "lm_head"),
        "reference without fp8": dpo_miss(plain_reference=True),
        "no fp8": dpo_miss(lambda module, fqn: False),
    }
    with capsys.disabled():
        print(
            f"\n[fp8] DPO, {DPO_STEPS} steps: loss {loss:.2e}, weights {weights:.2e}; "
            + ", ".join(f"{name}: loss {a:.1e}, weights {b:.1e}" for name, (a, b) in misses.items())
        )
    assert loss < REL_TOL and weights < REL_TOL
    assert all(max(miss) > 100 * REL_TOL for miss in misses.values()), misses
