"""Config validation: every problem reported at once, with numbers and the knob, before any process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from training.config import ConfigError, DataConfig, OptimConfig, TrainConfig, resolve
from training.optim import fill_ds_config


@pytest.fixture()
def good(tmp_path, tiny_hf) -> TrainConfig:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    return TrainConfig(model_name_or_path=tiny_hf, num_stages=2, ds_config="zero1", micro_batch_size=2,
                       gradient_accumulation_steps=4, data=DataConfig(train_file=str(data)))


def problems_of(cfg: TrainConfig, world_size: int) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world_size)
    return str(err.value)


def test_valid_config_resolves_and_fills_deepspeed_json(good):
    resolved = resolve(good, world_size=4)
    assert resolved.dp == 2 and resolved.warnings == []
    ds = fill_ds_config(resolved)
    assert ds["train_batch_size"] == 2 * 4 * 2
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 1.0 and ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["zero_optimization"] == {"stage": 1}


def test_no_clipping_is_written_explicitly(good):
    good.optim = OptimConfig(max_grad_norm=0.0)
    # DeepSpeed clips at 1.0 when the key is absent: 0 must be written for "off".
    assert fill_ds_config(resolve(good, 4))["gradient_clipping"] == 0.0


def test_all_problems_reported_together(good):
    good.num_stages = 3
    good.micro_batch_size = 0
    good.precision = "fp8"
    good.data.train_file = "/nonexistent.jsonl"
    message = problems_of(good, world_size=4)
    assert "world size 4 is not divisible by num_stages 3" in message
    assert "micro_batch_size 0 is out of range: set micro_batch_size >= 1" in message
    assert "precision 'fp8' unknown" in message
    assert "data.train_file /nonexistent.jsonl does not exist" in message


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
    env = {**os.environ, "WORLD_SIZE": "4"}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_cli_accepts_the_launchers_local_rank_and_prints_the_config():
    proc = run_train_py("--local_rank=3", "num_stages=2", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "num_stages: 2" in proc.stdout and "max_grad_norm: 1.0" in proc.stdout


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
    (tmp_path / "no_tokenizer" / "config.json").write_text(open(os.path.join(good.model_name_or_path, "config.json")).read())
    good.model_name_or_path = str(tmp_path / "no_tokenizer")
    good.data = DataConfig(train_file=good.data.train_file, format="text", eval_file=good.data.train_file,
                           eval_fraction=0.1, order_check_steps=-1)
    message = problems_of(good, 4)
    assert "data.format=text tokenizes with the model's tokenizer, but" in message
    assert "data.eval_file and data.eval_fraction are both set" in message
    assert "data.order_check_steps -1 < 0" in message


def test_packing_defaults_to_text_only():
    from training.config import default_packing

    assert default_packing(DataConfig(format="text")) and not default_packing(DataConfig(format="sft"))
    assert default_packing(DataConfig(format="sft", packing=True)) and not default_packing(DataConfig(format="text", packing=False))
