"""Model inputs that cannot work (a quantized checkpoint, an unknown rope type, a LoRA run or an adapter of another
model as the base, a mistyped key) are refused with one message naming the file or setting and the fix.

Each used to end in a traceback, a wrong hint or a silent wrong result. Fast tier: in one process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
from peft import get_peft_model

from models.families import UnsupportedModelError, config_from_dict
from models.lora import lora_config
from models.tiny import tiny_config
from tests.support.scripts import load_entry_point, run_script
from tests.test_config import good, problems_of  # noqa: F401 (a fixture)
from training.configuration.overrides import override_key_problems
from training.configuration.schema import PeftConfig


def edited_copy(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(fields)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


def test_the_converter_names_a_quantized_checkpoint_and_an_unknown_rope_type(tiny_hf, tmp_path, capsys):
    convert = load_entry_point("convert2ckpt.py").main
    quantized = edited_copy(tiny_hf, tmp_path / "q", quantization_config={"quant_method": "gptq", "bits": 4})
    assert convert(["--input", quantized, "--output", str(tmp_path / "out_q")]) == 1
    assert "a quantized checkpoint (quantization_config: gptq)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out_q")
    rope = edited_copy(tiny_hf, tmp_path / "r", rope_scaling={"rope_type": "bogus", "factor": 2.0})
    assert convert(["--input", rope, "--output", str(tmp_path / "out_r")]) == 1
    assert "rope_type 'bogus' is not one transformers" in capsys.readouterr().err
    with pytest.raises(UnsupportedModelError, match="model.architecture: rope_type 'nope'"):
        config_from_dict({**tiny_config().to_dict(), "rope_scaling": {"rope_type": "nope", "factor": 2.0}})


def test_a_lora_run_or_the_output_dir_as_model_name_or_path_is_named(good, tmp_path):  # noqa: F811
    run = tmp_path / "lora_run"
    (run / "global_step2").mkdir(parents=True)
    shutil.copy(os.path.join(good.model_name_or_path, "config.json"), run)
    (run / "latest").write_text("global_step2")
    state = {"peft_base": {"path": "/base", "tag": "global_step0", "sha256": {}}}
    (run / "global_step2" / "trainer_state_rank00000.json").write_text(json.dumps(state))
    message = problems_of(dataclasses.replace(good, model_name_or_path=str(run)), 4)
    assert f"model_name_or_path {run} is a LoRA run, whose layer files hold adapters, not a model" in message
    message = problems_of(dataclasses.replace(good, output_dir=good.model_name_or_path), 4)
    assert f"output_dir {good.model_name_or_path} is model_name_or_path" in message


def test_an_adapter_of_another_model_is_refused_before_start(good, tmp_path):  # noqa: F811
    from transformers import LlamaForCausalLM

    settings = PeftConfig(method="lora", r=4, alpha=8.0)
    other = LlamaForCausalLM(tiny_config(num_hidden_layers=6, hidden_size=96, intermediate_size=128))
    get_peft_model(other, lora_config(settings)).save_pretrained(tmp_path / "adapter")
    cfg = dataclasses.replace(good, peft=dataclasses.replace(settings, init_from=str(tmp_path / "adapter")))
    message = problems_of(cfg, 4)
    assert "has adapters for decoder layers up to 5, the model has 4" in message
    assert "adapters take inputs of width [96], the model's hidden size is 64" in message
    assert "an adapter of another model" in message


def test_the_partition_hint_does_not_offer_the_method_that_failed(good):  # noqa: F811
    cfg = dataclasses.replace(good, num_stages=4, partition_method="uniform", peft=PeftConfig(method="lora"))
    message = problems_of(cfg, 4)
    assert "hold no decoder layer, hence nothing to train: use partition_method=compute, fewer" in message
    assert "partition_method=uniform," not in message.split("nothing to train")[1]


def test_a_typo_in_an_override_key_gets_our_message_not_hydras():
    assert override_key_problems(
        ["num_stage=2", "optim.lrr=1e-4", "model=tiny", "model.architecture.hidden_size=64", "+x=1", "ds=zero0"]
    ) == ["unknown key num_stage: did you mean num_stages?", "unknown key optim.lrr: did you mean optim.lr?"]
    assert override_key_problems(["hydra.run.dir=x", "--cfg", "job", "peft.r=4", "data.train_file=a"]) == []


@pytest.mark.e2e
def test_train_py_names_a_mistyped_key_before_hydra():
    proc = run_script(["train.py", "num_stage=2", "optim.lrr=1e-4"])
    assert proc.returncode == 1
    assert "train.py: error: invalid configuration:\n  unknown key num_stage: did you mean num_stages?" in proc.stderr
    assert "+num_stage" not in proc.stderr  # Hydra's advice to add the typo
