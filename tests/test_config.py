"""Config validation: every problem reported at once, with numbers and the knob, before any process group."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess

import pytest
import torch

from parallel.engines import DataParallelEngine, PipelineEngine
from tests.support import REPO
from tests.support.ranks import child_env
from tests.support.scripts import run_script
from training import optim
from training.configuration import ds_json
from training.configuration.schema import (
    ConfigError,
    DataConfig,
    ModelConfig,
    MonitorConfig,
    OptimConfig,
    PeftConfig,
    TrainConfig,
)
from training.configuration.validate import resolve
from training.optim import fill_ds_config, zero1_settings


@pytest.fixture()
def good(tmp_path, tiny_hf) -> TrainConfig:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    return TrainConfig(
        model_name_or_path=tiny_hf,
        num_stages=2,
        ds_config="zero1",
        micro_batch_size=2,
        gradient_accumulation_steps=4,
        data=DataConfig(train_file=str(data)),
    )


def problems_of(cfg: TrainConfig, world_size: int) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world_size)
    return str(err.value)


def test_valid_config_resolves_and_fills_deepspeed_json(good, monkeypatch):
    monkeypatch.setattr(optim, "accelerator_name", lambda: "cuda")  # the JSON as a GPU run gets it
    resolved = resolve(good, world_size=4)
    assert resolved.dp == 2 and resolved.warnings == []
    ds = fill_ds_config(resolved)
    assert ds["train_batch_size"] == 2 * 4 * 2
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 1.0 and ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["zero_optimization"] == {"stage": 1}


def test_zero1_on_cpu_or_one_rank_skips_reduce_scatter_and_contiguous_gradients_unless_set():
    off = {"stage": 1, "reduce_scatter": False, "contiguous_gradients": False}
    for accelerator, data_axis in (("cpu", 2), ("cuda", 1)):
        ds = {"zero_optimization": {"stage": 1}}
        zero1_settings(ds, accelerator, data_axis)
        assert ds["zero_optimization"] == off, (accelerator, data_axis)
    own = {"zero_optimization": {"stage": 1, "reduce_scatter": True}}
    zero1_settings(own, "cpu", 2)
    assert own["zero_optimization"] == {"stage": 1, "reduce_scatter": True, "contiguous_gradients": False}
    for ds, accelerator in (
        ({"zero_optimization": {"stage": 1}}, "cuda"),
        ({"zero_optimization": {"stage": 2}}, "cpu"),
        ({"zero_optimization": {"stage": 0}}, "cpu"),
    ):
        before = {k: dict(v) for k, v in ds.items()}
        zero1_settings(ds, accelerator, 2)
        assert ds == before, accelerator


def test_zero_grad_norm_in_one_kernel_equals_deepspeeds_loop(tmp_path, monkeypatch):
    """training/optim.py's ``grad_norm_in_one_kernel``: ZeRO-1/2's 2-norm of a group's gradients from one foreach norm
    is DeepSpeed's per-parameter loop's, bit for bit on the CPU (tests/test_gpu_parity.py: on a GPU)."""
    assert_grad_norm_in_one_kernel_is_the_loop("cpu", tmp_path, monkeypatch, rtol=0.0)


def assert_grad_norm_in_one_kernel_is_the_loop(device: str, tmp_path, monkeypatch, rtol: float) -> None:
    """fp32 and bf16 gradients on ``device``, ZeRO's padding and a parameter the pipeline replicates left out, a NaN
    gives DeepSpeed's -1; the inf-norm goes to the loop."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from training.optim import grad_norm_in_one_kernel

    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        optimizer = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)  # what the norm reads of it, no more
        optimizer.model_parallel_rank, optimizer.model_parallel_group = 0, None
        optimizer.dp_process_group, optimizer.device = None, device
        loop = functools.partial(DeepSpeedZeroOptimizer.get_grad_norm_direct, optimizer)
        grad_norm_in_one_kernel(optimizer)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in (1000, 37, 64, 5)]
        params[2].ds_pipe_replicated = True  # counted by another stage
        grads = [torch.randn(1000), torch.randn(37).bfloat16(), 100 * torch.randn(64), torch.randn(5)]
        grads = [g.to(device) for g in grads]
        padding = torch.randn(3, device=device)
        padding._zero_padding = True
        gradients = [grads[0], padding, *grads[1:]]

        norm = optimizer.get_grad_norm_direct(gradients, params)
        assert norm.dtype == torch.float32
        torch.testing.assert_close(norm, loop(gradients, params), rtol=rtol, atol=0)
        counted = torch.cat([grads[0].double(), grads[1].double(), grads[3].double()])
        torch.testing.assert_close(norm, counted.norm().float(), rtol=1e-6, atol=0)  # 100 x grads[2] left out
        inf = float("inf")
        torch.testing.assert_close(
            optimizer.get_grad_norm_direct(gradients, params, inf), loop(gradients, params, inf), rtol=0, atol=0
        )
        many = [torch.randn(64, device=device).bfloat16() for _ in range(40)]
        many_params = [torch.nn.Parameter(torch.zeros(64, device=device)) for _ in many]
        ours_few = ops_of(optimizer.get_grad_norm_direct, grads, params)
        ours_many = ops_of(optimizer.get_grad_norm_direct, many, many_params)
        loop_many = ops_of(loop, many, many_params)
        assert len(ours_many) == len(ours_few) < 16, ours_many  # kernels per step: not one or more per gradient
        assert len(loop_many) >= 3 * len(many), len(loop_many)  # detach, copy, norm: per gradient
        assert not [op for op in ours_many if op[0] == "aten._to_copy.default" and op[1] > 1]  # no gradient copied
        copied = sum(n for op, n, _ in loop_many if op == "aten._to_copy.default" and n > 1)
        assert copied == 40 * 64  # the loop copies each gradient (to fp64 on a GPU)
        grads[3][0] = float("nan")
        assert optimizer.get_grad_norm_direct(gradients, params).item() == loop(gradients, params).item() == -1
    finally:
        dist.destroy_process_group()


def ops_of(norm, gradients, params) -> list[tuple[str, int, torch.dtype]]:
    """The ops ``norm(gradients, params)`` dispatches (on a GPU each a kernel launch or a no-op): name, elements out,
    dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, (list, tuple)) and out else out
            numel = first.numel() if isinstance(first, torch.Tensor) else 0
            self.seen.append((str(func), numel, getattr(first, "dtype", None)))
            return out

    with Ops() as ops:
        norm(gradients, params)
    return ops.seen


def test_no_clipping_is_written_explicitly(good):
    good.optim = OptimConfig(max_grad_norm=0.0)
    # DeepSpeed clips at 1.0 when the key is absent: 0 must be written for "off".
    assert fill_ds_config(resolve(good, 4))["gradient_clipping"] == 0.0


def test_zero3_reduce_bucket_capped_at_the_model_unless_set(good, tmp_path):
    """DeepSpeed allocates its 5e8-element default bucket whole; train.py caps it at the model's size."""
    from models.llama_pipe import model_parameters

    good.num_stages, good.ds_config = 1, "zero3"
    resolved = resolve(good, 4)
    assert fill_ds_config(resolved)["zero_optimization"]["reduce_bucket_size"] == model_parameters(
        resolved.model_config
    )
    own = tmp_path / "own.json"
    own.write_text('{"zero_optimization": {"stage": 3, "reduce_bucket_size": 12345}}')
    good.ds_config = str(own)
    assert fill_ds_config(resolve(good, 4))["zero_optimization"]["reduce_bucket_size"] == 12345


def test_all_problems_reported_together(good):
    good.num_stages = 3
    good.micro_batch_size = 0
    good.data.train_file = "/nonexistent.jsonl"
    message = problems_of(good, world_size=4)
    assert "world size 4 is not divisible by num_stages 3" in message
    assert "micro_batch_size 0 is out of range: set micro_batch_size >= 1" in message
    assert "data.train_file /nonexistent.jsonl does not exist" in message


def test_typed_choices_are_checked_by_hydra_with_the_valid_values():
    """Precision, schedules, formats, policies are Enums: OmegaConf refuses another value and lists them."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    schema = OmegaConf.structured(TrainConfig)
    for override, valid in (
        ("precision=fp8", "[fp32, bf16, fp16]"),
        ("optim.scheduler=step", "[constant, linear, cosine]"),
        ("loss_normalization=sample", "[tokens, micro_batch]"),
        ("data.format=csv", "[tokens, text, sft, dpo, grpo]"),
        ("pipeline_schedule=gpipe", "[1f1b, dualpipev]"),
        ("partition_method=profile", "[parameters, compute, memory, uniform, type:DecoderLayerPipe]"),
    ):
        with pytest.raises(ValidationError, match=re.escape(f"expected one of {valid}")):
            OmegaConf.merge(schema, OmegaConf.from_dotlist([override]))


def test_more_stages_than_layers(good):
    good.num_stages = 8
    assert "num_stages 8 > 4 decoder layers" in problems_of(good, world_size=8)


def test_unknown_ds_config_lists_available(good):
    good.ds_config = "zero9"
    message = problems_of(good, 4)
    assert "ds_config 'zero9' not found" in message and "'zero0', 'zero1'" in message


def test_deepspeed_json_that_contradicts_hydra(good, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64, "gradient_clipping": 0.5, "zero_optimization": {"stage": 2}}))
    good.ds_config = str(path)
    good.micro_batch_size, good.gradient_accumulation_steps = 2, 8
    message = problems_of(good, 4)
    assert "train_batch 64 != micro 2 x grad_acc 8 x dp 2 (=32): set gradient_accumulation_steps=16" in message
    assert "gradient_clipping=0.5 but optim.max_grad_norm=1.0" in message
    assert "ZeRO stage 2 with num_stages=2" in message and "set num_stages=1 or ds_config=zero1" in message


# Each contradiction between the DeepSpeed JSON and the Hydra config, in both directions, and the line
# that names the JSON key and the knob. Before these checks, {"bf16": {"enabled": false}} trained in bf16.
JSON_CONTRADICTIONS = [
    ({"bf16": {"enabled": False}}, {}, "ds_config sets bf16.enabled=false but precision=bf16: remove bf16.enabled"),
    ({"bf16": {"enabled": True}}, {"precision": "fp32"}, "ds_config sets bf16.enabled=true but precision=fp32"),
    (
        {"fp16": {"enabled": True}},
        {},
        "ds_config sets fp16.enabled=true but precision=bf16: remove fp16.enabled "
        "from the JSON (precision decides it) or set precision=fp16",
    ),
    ({"amp": {"enabled": True}}, {}, "ds_config enables amp but precision=bf16"),
    ({"train_micro_batch_size_per_gpu": 4}, {}, "train_micro_batch_size_per_gpu=4 but micro_batch_size=2"),
    ({"gradient_accumulation_steps": 2}, {}, "gradient_accumulation_steps=2 but gradient_accumulation_steps=4"),
    ({"gradient_clipping": 0}, {}, "gradient_clipping=0 but optim.max_grad_norm=1.0"),
    (
        {"train_batch_size": 8},
        {},
        "train_batch 8 != micro 2 x grad_acc 4 x dp 2 (=16): set gradient_accumulation_steps=2",
    ),
    ({"optimizer": {"type": "Adam"}}, {}, "ds_config has an 'optimizer' section: remove it, optim.* configures it"),
    ({"scheduler": {"type": "WarmupLR"}}, {}, "ds_config has an 'scheduler' section"),
    (
        {"tensorboard": {"enabled": True}},
        {},
        "'tensorboard' section ({\"enabled\": true}) but monitor.tensorboard=false",
    ),
    (
        {"csv_monitor": {"enabled": True, "output_path": "x"}},
        {"monitor": MonitorConfig(csv=True)},
        '\'csv_monitor\' section ({"enabled": true, "output_path": "x"}) but monitor.csv=true',
    ),
]


@pytest.mark.parametrize("json_part, hydra, message", JSON_CONTRADICTIONS, ids=lambda x: None)
def test_every_deepspeed_json_contradiction_is_refused(good, tmp_path, json_part, hydra, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, **json_part}))
    good.ds_config = str(path)
    for key, value in hydra.items():
        setattr(good, key, value)
    assert message in problems_of(good, 4)


def test_deepspeed_json_that_agrees_or_says_auto_is_accepted(good, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 1},
                "bf16": {"enabled": True},
                "fp16": {"enabled": False},
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": 1.0,
                "tensorboard": {"enabled": False},
            }
        )
    )
    good.ds_config = str(path)
    resolve(good, 4)


@pytest.mark.e2e
def test_a_contradiction_stops_train_py_before_any_process_group(good, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": False}}))
    proc = run_train_py(
        f"model_name_or_path={good.model_name_or_path}",
        f"data.train_file={good.data.train_file}",
        f"ds_config={path}",
        f"output_dir={tmp_path / 'out'}",
    )
    assert proc.returncode == 1
    assert (
        "train.py: error: invalid configuration" in proc.stderr
        and "bf16.enabled=false but precision=bf16" in proc.stderr
    )
    assert "init_distributed" not in proc.stdout + proc.stderr and not (tmp_path / "out").exists()


def test_invalid_json_names_line_and_column(good, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "zero_optimization": {"stage": 1},\n}\n')
    good.ds_config = str(path)
    assert "is not valid JSON" in problems_of(good, 4) and "line 3 column 1" in problems_of(good, 4)


def test_few_micro_batches_warn_about_the_bubble(good):
    good.gradient_accumulation_steps = 1
    (warning,) = resolve(good, world_size=4).warnings
    assert "gradient_accumulation_steps 1 < num_stages 2" in warning


def run_train_py(*args: str) -> subprocess.CompletedProcess:
    env = {**child_env(), "WORLD_SIZE": "4"}
    env.pop("RANK", None)
    return run_script(["train.py", *args], env=env, timeout=120)


@pytest.mark.e2e
def test_cli_accepts_the_launchers_local_rank_and_prints_the_config():
    proc = run_train_py("--local_rank=3", "num_stages=2", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "num_stages: 2" in proc.stdout and "max_grad_norm: 1.0" in proc.stdout


@pytest.mark.e2e
def test_cli_refuses_unknown_keys_and_bad_configs_before_starting(tiny_hf):
    typo = run_train_py("num_stage=2")
    assert typo.returncode != 0 and "num_stage" in typo.stderr
    bad = run_train_py(f"model_name_or_path={tiny_hf}", "num_stages=3", "data.train_file=/nope.jsonl")
    assert bad.returncode == 1
    assert "world size 4 is not divisible by num_stages 3" in bad.stderr
    assert "data.train_file /nope.jsonl does not exist" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_data_settings_are_checked_together(good, tmp_path):
    (tmp_path / "no_tokenizer").mkdir()
    (tmp_path / "no_tokenizer" / "config.json").write_text(
        open(os.path.join(good.model_name_or_path, "config.json")).read()
    )
    good.model_name_or_path = str(tmp_path / "no_tokenizer")
    good.data = DataConfig(
        train_file=good.data.train_file,
        format="text",
        eval_file=good.data.train_file,
        eval_fraction=0.1,
        order_check_steps=-1,
    )
    message = problems_of(good, 4)
    assert "data.format=text tokenizes with the model's tokenizer, but" in message
    assert "data.eval_file and data.eval_fraction are both set" in message
    assert "data.order_check_steps -1 < 0" in message


def test_packing_defaults_to_text_only():
    from data.checks import default_packing

    assert default_packing(DataConfig(format="text")) and not default_packing(DataConfig(format="sft"))
    assert default_packing(DataConfig(format="sft", packing=True)) and not default_packing(
        DataConfig(format="text", packing=False)
    )


# ---------- schedules, architectures, initialisation ----------


@pytest.mark.parametrize(
    "scheduler, expected",
    [
        # warm-up 4 steps to lr 1.0, then to min_lr 0.1 at the last step (index 13 of 14)
        ("constant", {0: 0.25, 3: 1.0, 4: 1.0, 13: 1.0}),
        ("linear", {0: 0.25, 3: 1.0, 4: 1.0, 8.5: None, 13: 0.1}),
        ("cosine", {0: 0.25, 3: 1.0, 4: 1.0, 13: 0.1}),
    ],
)
def test_schedules_give_the_expected_lr(scheduler, expected):
    from training.optim import lr_lambda

    cfg = TrainConfig(optim=OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, scheduler=scheduler))
    f = lr_lambda(cfg, total_steps=14)
    for step, lr in expected.items():
        if lr is not None:
            assert f(step) == pytest.approx(lr), (scheduler, step)
    if scheduler == "linear":
        assert f(8) == pytest.approx(1.0 - 0.9 * 4 / 9)  # 4 of the 9 decay steps done
    if scheduler == "cosine":
        assert f(8) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
        assert all(f(s) >= f(s + 1) for s in range(3, 13))  # monotone after warm-up


REFERENCE_PARAMS = {  # parameter counts of the published models (from their config.json shapes)
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "tiny": None,
}


@pytest.mark.parametrize("name", sorted(REFERENCE_PARAMS))
def test_reference_architectures_build_through_the_same_specs(name):
    """Each conf/model entry is a valid config of its family whose stage specs hold the published
    parameter count (built on the meta device: no memory); the other families' entries are checked
    with the planner and preflight in tests/test_families.py."""
    import yaml

    from models.families import config_from_dict
    from models.llama_pipe import build_specs, expected_state_shapes, spec_layout

    with open(os.path.join(REPO, "conf", "model", f"{name}.yaml")) as f:
        entry = yaml.safe_load(f)
    assert entry["name"] == name
    config = config_from_dict(entry["architecture"])
    specs = build_specs(config)
    total = sum(
        math.prod(s)
        for info in spec_layout(config)
        if info.owns_file
        for s in expected_state_shapes(specs[info.index]).values()
    )
    if REFERENCE_PARAMS[name] is not None:
        assert total == REFERENCE_PARAMS[name]


def test_every_ds_json_has_a_ds_group_entry():
    from training.configuration.ds_json import available_ds_configs

    entries = sorted(f[:-5] for f in os.listdir(os.path.join(REPO, "conf", "ds")) if f.endswith(".yaml"))
    assert entries == available_ds_configs()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_from_scratch_init_is_seeded_per_spec_and_follows_hf(model_type):
    from models.llama_pipe import decoder_layer_class, init_weights_
    from models.tiny import tiny_config

    config = tiny_config(
        model_type, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4
    )
    a, b = decoder_layer_class(config)(config, 0), decoder_layer_class(config)(config, 0)
    init_weights_(a, config, seed=5)
    init_weights_(b, config, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.mlp.up_proj.weight.std().item() == pytest.approx(config.initializer_range, rel=0.05)
    assert torch.equal(a.input_layernorm.weight, torch.ones(256))
    if model_type == "qwen2":  # q/k/v biases start at 0, as Hugging Face's init sets them
        assert a.self_attn.q_proj.bias.abs().sum() == 0
    if model_type == "qwen3":  # the per-head q/k norms start at 1
        assert torch.equal(a.self_attn.q_norm.weight, torch.ones(64))
    init_weights_(b, config, seed=6)
    assert not torch.equal(a.self_attn.q_proj.weight, b.self_attn.q_proj.weight)


# ---------- model source and resume rules ----------


def test_training_from_scratch_needs_an_architecture_and_a_tokenizer(good):
    good.model_name_or_path = ""
    assert "no model: set model_name_or_path=CKPT_DIR" in problems_of(good, 4)
    good.model = ModelConfig(name="tiny", architecture={"hidden_size": 64, "num_hidden_layers": 4}, tokenizer="/nope")
    assert "model.tokenizer '/nope' holds no tokenizer" in problems_of(good, 4)


def test_checkpoint_and_a_different_architecture_conflict(good):
    good.model = ModelConfig(
        name="llama2-7b",
        architecture={
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "intermediate_size": 11008,
            "num_attention_heads": 32,
        },
    )
    message = problems_of(good, 4)
    assert "model=llama2-7b has hidden_size=4096 but" in message and "config.json has 64" in message


def test_resume_rules(good, tmp_path, tokenizer_dir):
    from tests.support.models import make_hf_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "latest").write_text("global_step4")
    (out / "global_step4").mkdir()
    good.output_dir = str(out)
    assert resolve(good, 4).resume_tag == "global_step4"
    good.resume = "never"
    assert "already holds a checkpoint (global_step4): set resume=auto" in problems_of(good, 4)
    good.resume = "auto"
    wide = make_hf_dir(tmp_path, tokenizer_dir, "wide", intermediate_size=128)
    (out / "config.json").write_text(open(os.path.join(wide, "config.json")).read())
    assert "holds a checkpoint with intermediate_size=128, this model has 176" in problems_of(good, 4)
    big = make_hf_dir(tmp_path, tokenizer_dir, "big", vocab_size=1024)
    (out / "config.json").write_text(open(os.path.join(big, "config.json")).read())
    good.num_stages = 4  # on another layout too
    assert "holds a checkpoint with vocab_size=1024, this model has 512" in problems_of(good, 4)


def test_resume_on_another_layout_reads_the_optimizer_states_per_parameter(good, tmp_path):
    """A stage split, engine, precision or world size other than the checkpoint's: resume reads the
    optimizer states per parameter (training/checkpoints/reshard.py), whose files are checked before any process
    group starts; a changed micro-batch or grad_acc alone keeps DeepSpeed's own load."""
    out = tmp_path / "out"
    (out / "global_step4").mkdir(parents=True)
    (out / "latest").write_text("global_step4")
    (out / "global_step4" / "train_config.yaml").write_text("num_stages: 2\npartition_method: parameters\n")
    (out / "global_step4" / "trainer_state_rank00000.json").write_text(json.dumps({"world_size": 4}))
    good.output_dir = str(out)
    message = problems_of(good, 4)
    assert f"cannot resume {out}/global_step4: {out}/global_step4 holds no optimizer states" in message
    good.partition_method = "parameters"
    assert resolve(good, 4).reshard == ""
    good.gradient_accumulation_steps = 4
    assert resolve(good, 4).reshard == ""
    assert "holds no optimizer states" in problems_of(good, 8)  # world size 4 -> 8
    good.num_stages = 4
    assert f"{out}/global_step4/layer_00-model_states.pt is missing" in problems_of(good, 4)


def saved_run(good, tmp_path) -> str:
    """An output_dir whose latest checkpoint was saved with ``good``'s settings (its train_config.yaml)."""
    from omegaconf import OmegaConf

    out = tmp_path / "run"
    (out / "global_step4").mkdir(parents=True)
    (out / "latest").write_text("global_step4")
    good.output_dir = str(out)
    OmegaConf.save(OmegaConf.structured(good), str(out / "global_step4" / "train_config.yaml"))
    return str(out)


@pytest.mark.parametrize(
    "cls, change, line",
    [
        ("optim", lambda c: setattr(c.optim, "lr", 1e-3), "optim.lr 0.0003 -> 0.001"),
        ("optim", lambda c: setattr(c.optim, "betas", [0.9, 0.99]), "optim.betas [0.9, 0.95] -> [0.9, 0.99]"),
        (
            "optim",
            lambda c: setattr(c, "loss_normalization", "micro_batch"),
            "loss_normalization 'tokens' -> 'micro_batch'",
        ),
        ("data", lambda c: setattr(c.data, "max_seq_length", 64), "data.max_seq_length 512 -> 64"),
        ("data", lambda c: setattr(c, "seed", 7), "seed 42 -> 7"),
        (
            "model",
            lambda c: setattr(c, "model_name_or_path", c.model_name_or_path + "/"),
            "model_name_or_path '{0}' -> '{0}/'",
        ),
    ],
)
def test_resume_refuses_changed_settings_unless_their_class_is_allowed(good, tmp_path, cls, change, line):
    saved_run(good, tmp_path)
    line = line.format(good.model_name_or_path)
    change(good)
    message = problems_of(good, 4)
    assert (
        f"was saved with other {cls} settings: {line}: set the saved values, or add {cls} to resume_allow_changes"
        in message
    )
    good.resume_allow_changes = [cls]
    resolved = resolve(good, 4)
    assert [f"{k} {o!r} -> {n!r}" for k, (o, n) in resolved.resume_changes.changed[cls].items()] == [line]


def test_resume_applies_free_and_layout_settings_as_given(good, tmp_path):
    saved_run(good, tmp_path)
    good.max_steps, good.save_steps, good.monitor.csv = 500, 10, True
    resolved = resolve(good, 4)
    assert resolved.resume_changes.changed["free"] == {
        "max_steps": (100, 500),
        "save_steps": (0, 10),
        "monitor.csv": (False, True),
    }
    good.micro_batch_size = 4
    assert resolve(good, 4).resume_changes.changed["layout"] == {"micro_batch_size": (2, 4)}
    good.resume_allow_changes = ["layout"]
    assert "resume_allow_changes ['layout'] unknown: choose from ['optim', 'data', 'model']" in problems_of(good, 4)


def test_unknown_keys_are_refused_however_they_are_spelled():
    from training.configuration.overrides import unknown_key_problems

    assert unknown_key_problems(
        {
            "max_step": 3,
            "optim": {"lr": 1.0, "warmup": 5},
            "data": {"max_seq_len": 8},
            "model": {"architecture": {"hidden_size": 8}},
        }
    ) == [
        "unknown key max_step: did you mean max_steps?",
        "unknown key optim.warmup: did you mean optim.warmup_steps?",
        "unknown key data.max_seq_len: did you mean data.max_seq_length?",
    ]


@pytest.mark.e2e
def test_train_py_refuses_unknown_keys_before_starting():
    proc = run_train_py("+max_step=3", "--cfg", "job")
    assert proc.returncode == 0  # --cfg job prints what Hydra composed; the check runs before training
    bad = run_train_py("+max_step=3", "+data.foo=1")
    assert bad.returncode == 1 and "unknown key max_step: did you mean max_steps?" in bad.stderr
    assert "unknown key data.foo" in bad.stderr and "Traceback" not in bad.stderr
    typed = run_train_py("precision=fp8", "--cfg", "job")  # a typed choice: refused before anything starts
    assert typed.returncode != 0 and "expected one of [fp32, bf16, fp16]" in typed.stderr


def model_group_config_dict(name: str) -> dict:
    import yaml

    with open(os.path.join(REPO, "conf", "model", f"{name}.yaml")) as f:
        return yaml.safe_load(f)["architecture"]


def test_a_sequence_longer_than_the_model_was_trained_for_warns(good, tokenizer_dir):
    good.data.max_seq_length = 1024
    (warning,) = [w for w in resolve(good, 4).warnings if "max_position_embeddings" in w]
    assert "data.max_seq_length 1024 > max_position_embeddings 512 of the model (no rope scaling)" in warning
    good.model_name_or_path = ""
    good.model = ModelConfig(
        name="llama3.2-1b", architecture=model_group_config_dict("llama3.2-1b"), tokenizer=tokenizer_dir
    )
    good.data.max_seq_length = 200_000
    warnings = [w for w in resolve(good, 4).warnings if "max_position_embeddings" in w]
    assert warnings and "131072 of the model (rope scaling llama3: " in warnings[0] and "factor=32.0" in warnings[0]


def test_fp16_is_refused_on_a_cpu_that_supports_it(good, monkeypatch):
    """A Xeon with AVX512-FP16, where DeepSpeed's CPU accelerator says fp16 is supported: refused all the same
    (tests/test_device_rules.py: the rule with the device's answers set both ways)."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(ds_json, "accelerator_name", lambda: "cpu")
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    good.precision = "fp16"
    assert "precision fp16 needs a CUDA GPU" in problems_of(good, 4)


@pytest.mark.e2e
def test_hydra_groups_and_unknown_group_entries():
    ok = run_train_py("model=llama3-8b", "ds=zero0", "data=sft", "--cfg", "job")
    assert ok.returncode == 0, ok.stderr
    assert "hidden_size: 4096" in ok.stdout and "ds_config: zero0" in ok.stdout and "format: sft" in ok.stdout
    bad = run_train_py("ds=zero9", "--cfg", "job")
    assert bad.returncode != 0 and "zero9" in bad.stderr and "zero1" in bad.stderr  # Hydra lists the options


@pytest.mark.parametrize("max_steps, num_epochs, expected", [(100, 0, 100), (0, 2, 10), (7, 2, 7), (100, 0.5, 3)])
def test_training_stops_at_max_steps_or_after_num_epochs(max_steps, num_epochs, expected):
    """100 samples, dp 2, micro 5, grad_acc 2: 10 micro-batches per rank per epoch = 5 steps/epoch."""
    from types import SimpleNamespace

    import train

    cfg = TrainConfig(max_steps=max_steps, micro_batch_size=5, gradient_accumulation_steps=2)
    cfg.num_epochs = num_epochs
    resolved = SimpleNamespace(cfg=cfg, dp=2, resume_tag=None)
    total, per_epoch = train.plan_steps(resolved, SimpleNamespace(train=range(100)))
    assert per_epoch == 5 and total == expected


def test_zero_plus_plus_quantized_weights_are_refused_on_cpu(good, monkeypatch):
    monkeypatch.setattr(ds_json, "accelerator_name", lambda: "cpu")  # the rule as a CPU run meets it, on any machine
    good.num_stages, good.ds_config = 1, "zeropp"
    assert (
        "ZeRO++ quantized weights (zero_quantized_weights), whose quantizer kernel the CPU accelerator lacks"
        in problems_of(good, 4)
    )


def test_every_ds_config_trains_or_is_refused_before_training(good, monkeypatch):
    """Each JSON in ds_configs/ is trained by tests/test_train_parity.py, or refused by validation (on the CPU, where
    the parity tests run, on any machine)."""
    from tests.support.parity import TRAINED_CONFIGS
    from training.configuration.ds_json import available_ds_configs

    monkeypatch.setattr(ds_json, "accelerator_name", lambda: "cpu")
    for name in available_ds_configs():
        if name in TRAINED_CONFIGS:
            continue
        good.num_stages, good.ds_config = 1, name
        with pytest.raises(ConfigError):
            resolve(good, 4)


def test_zero_2_and_3_choose_the_data_parallel_engine(good):
    good.num_stages, good.ds_config = 1, "zero3"
    assert isinstance(resolve(good, 4).layout.engine, DataParallelEngine)
    good.ds_config = "zero1"
    assert isinstance(resolve(good, 4).layout.engine, PipelineEngine)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(peft=PeftConfig(r=16, target_modules=["q_proj"], quantize="nf4")),
            "peft.r=16, peft.target_modules=['q_proj'], peft.quantize=nf4: LoRA settings, but LoRA is off "
            "(peft.method=none): add peft.method=lora, or drop them",
        ),
        (
            dict(optim=OptimConfig(min_lr=1e-5)),
            "optim.min_lr=1e-05: where linear and cosine decay end, but the constant schedule stays at optim.lr",
        ),
        (dict(eval_steps=5), "eval_steps=5: evaluation needs eval data, and there is none"),
        (
            dict(resume="never", resume_allow_changes=["optim"]),
            "resume_allow_changes=['optim']: applies when a run is resumed, but resume=never never resumes",
        ),
        (dict(model=ModelConfig(tokenizer="/tok")), "model.tokenizer=/tok: for training from scratch, but"),
        (dict(optim=OptimConfig(lr=0.0)), "optim.lr 0.0 trains nothing: set optim.lr > 0"),
        (dict(peft=PeftConfig(method="lora", alpha=0.0)), "peft.alpha 0 scales every adapter's update to 0"),
        (dict(optim=OptimConfig(betas=[0.9, 1.5])), "optim.betas [0.9, 1.5] must be two numbers in [0, 1)"),
        (dict(optim=OptimConfig(weight_decay=-0.1)), "optim.weight_decay -0.1 < 0: set it >= 0"),
    ],
)
def test_settings_that_cannot_act_or_train_nothing_are_refused(good, change, message):
    assert message in problems_of(dataclasses.replace(good, **change), world_size=4)


def test_a_harmless_inert_setting_is_named_in_one_warning(good):
    resolved = resolve(
        dataclasses.replace(
            good, num_stages=1, ds_config="zero0", data=dataclasses.replace(good.data, order_check_steps=3)
        ),
        4,
    )
    assert resolved.warnings == [
        "data.order_check_steps=3: the order check compares the batches of the first and last stages (and their "
        "tensor-parallel peers); with one stage and one rank per layer it has nothing to compare"
    ]
    assert resolve(dataclasses.replace(good, num_stages=1, ds_config="zero0"), 4).warnings == []
    whole_rows = dataclasses.replace(good.data, group_by_length=True, pad_to_multiple_of=0)
    assert resolve(dataclasses.replace(good, data=whole_rows), 4).warnings == [
        "data.group_by_length=True: groups rows of similar length so micro-batches are cut short, but "
        "data.pad_to_multiple_of=0 feeds every row whole (it only reorders the samples): set data.pad_to_multiple_of=8"
    ]


def test_save_final_false_without_other_saves_warns_that_nothing_is_kept(good):
    nothing = resolve(dataclasses.replace(good, save_final=False, save_steps=0, save_every_minutes=0.0), 4)
    assert nothing.warnings == [
        "save_final=False: saves no checkpoint after the last step, and with save_steps=0 and save_every_minutes=0 "
        "none at all (a stop signal's aside): the trained weights are gone when the run ends; set save_steps, or drop "
        "save_final"
    ]
    assert resolve(dataclasses.replace(good, save_final=False, save_steps=5), 4).warnings == []
