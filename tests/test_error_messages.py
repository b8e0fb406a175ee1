"""Error messages name the thing that is wrong, give only a hint that applies, and say what happened.

Fast tier, no ranks: a shard the index of a Hugging Face directory names but the directory lacks is named (by the
converter, train.py's start from the directory and the scripts that load an export), not reported as its tensors
missing; a truncated optimizer file of an expert-parallel checkpoint is named as truncated, not blamed on the layout
(so is any DeepSpeed file read before a resume); a missing expert tensor is named with its file, without the hint
about another layout of the experts; scripts/estimate_memory.py names the optimizer offload, not the ZeRO stage, as
what expert parallelism refuses; a second stop signal once the step's checkpoint is complete says so; a list key
given one value (and any key given a value of another type) is told the form it takes, before Hydra.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import hf_dir
from models.hf_io import ConversionError, hf_to_stages
from models.hf_start import hf_start_problems
from models.layer_files import CheckpointError, load_deepspeed_file, load_layer_file
from models.tiny import save_random_model, tiny_config
from parallel.layout import Layout, layout_problems
from tests.conftest import load_entry_point
from training import preemption
from training.config import ResumeChanges, TrainConfig
from training.overrides import override_key_problems
from training.preemption import PREEMPTED_EXIT_CODE, UNSAVED_EXIT_CODE, StopAndSave
from training.resume_rules import reshard_reason
from training.run_checkpoints import unsafe_checkpoint_files

# -- a message names the thing that is wrong ---------------------------------------------------------------------


def sharded_hf_dir(path: str, model_type: str = "llama") -> str:
    """A tiny random model whose model.safetensors is split in two shards with an index, as save_pretrained shards."""
    config = tiny_config(model_type)
    save_random_model(config, path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    keys = sorted(tensors)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    for name, half in zip(names, halves):
        save_file({k: tensors[k] for k in half}, os.path.join(path, name), metadata={"format": "pt"})
    weight_map = {k: name for name, half in zip(names, halves) for k in half}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def test_a_deleted_shard_is_named_by_every_reader_of_the_directory(tmp_path):
    src = sharded_hf_dir(str(tmp_path / "hf"))
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        held = sum(v == "model-00002-of-00002.safetensors" for v in json.load(f)["weight_map"].values())
    os.remove(os.path.join(src, "model-00002-of-00002.safetensors"))
    said = (
        f"{src} lacks 1 of the 2 shard files its index model.safetensors.index.json names: "
        f"model-00002-of-00002.safetensors ({held} tensors, e.g. "
    )
    with pytest.raises(ConversionError) as converted:
        hf_to_stages(src, str(tmp_path / "ckpt"))  # convert2ckpt.py
    started = "\n".join(hf_start_problems(src, tiny_config()))  # train.py's and the preflight's check
    exported = hf_dir.load_failure(src, OSError("transformers' own error"))  # generate.py, eval_hf.py
    for message in (str(converted.value), started, exported):
        assert said in message and "copy the missing shard files" in message, message
        assert "missing tensor" not in message, message


def test_a_tensor_the_index_puts_in_a_shard_that_lacks_it_names_that_shard(tmp_path):
    src = sharded_hf_dir(str(tmp_path / "hf"))
    shard = os.path.join(src, "model-00001-of-00002.safetensors")
    tensors = load_file(shard)
    gone = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != gone}, shard, metadata={"format": "pt"})
    message = "\n".join(hf_start_problems(src, tiny_config()))
    assert (
        f"missing tensor {gone!r} (expected shape {tuple(tensors[gone].shape)}): model.safetensors.index.json puts "
        "it in model-00001-of-00002.safetensors, which does not hold it"
    ) in message


def test_a_missing_expert_tensor_is_named_without_the_other_layout_hint(tmp_path):
    """Only a file that holds the experts in another layout (fused: tests/test_moe.py) is told about layouts."""
    src = str(tmp_path / "moe")
    save_random_model(tiny_config("qwen3_moe"), src)
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, path, metadata={"format": "pt"})
    with pytest.raises(ConversionError) as e:
        hf_to_stages(src, str(tmp_path / "ckpt"))
    assert str(e.value).splitlines()[1:] == [
        f"  missing tensor {gone!r} (expected shape {tuple(tensors[gone].shape)}) in {path}"
    ]


def truncated(path: str) -> str:
    """``path`` (a torch.save file) cut to half its size, as a full disk or an interrupted copy leaves it."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return f"{path} is truncated ({size // 2} bytes): the end of its zip archive (the central directory) is missing"


def test_a_truncated_optimizer_file_of_an_expert_parallel_checkpoint_is_named_not_blamed_on_the_layout(tmp_path):
    """expert_parallel always reads the optimizer states per parameter (training/reshard.py), on the saved layout
    too: a damaged file there is the checkpoint's, named with what reading it said."""
    tag_dir = tmp_path / "out" / "global_step2"
    tag_dir.mkdir(parents=True)
    (tag_dir / "trainer_state_rank00000.json").write_text(json.dumps({"world_size": 2, "expert_parallel": 2}))
    for rank in (0, 1):
        state = {"zero_stage": 1, "partition_count": [2], "fp32": torch.zeros(4096)}
        torch.save({"optimizer_state_dict": state}, tag_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    said = truncated(str(tag_dir / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    (tag_dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()  # the truncated file is the first read
    cfg = TrainConfig(output_dir=str(tmp_path / "out"), expert_parallel=2)
    _, problems = reshard_reason(cfg, "global_step2", ResumeChanges(), 2, None)
    assert problems == [f"cannot resume {tmp_path / 'out'}/global_step2: {said}"]


def test_every_truncated_checkpoint_file_read_on_resume_is_named(tmp_path):
    """Engine (mp_rank) and ZeRO optimizer files of any run: DeepSpeed's own load goes through load_deepspeed_file,
    and the check before it (unsafe_checkpoint_files) names the file as truncated too. Layer files (a LoRA run's
    adapters too): torch.load of one cut in half failed a seek, a bare "OSError: [Errno 22] Invalid argument"."""
    path = str(tmp_path / "mp_rank_00_model_states.pt")
    torch.save({"module": {"w": torch.zeros(4096)}, "dp_world_size": 1}, path)
    said = truncated(path)
    with pytest.raises(CheckpointError) as e:
        load_deepspeed_file(path, map_location="cpu", mmap=True)
    assert str(e.value) == said
    assert unsafe_checkpoint_files(str(tmp_path), 0, 1) == [said]
    layer = str(tmp_path / "layer" / "layer_01-model_states.pt")
    os.makedirs(os.path.dirname(layer))
    torch.save({"w": torch.zeros(4096)}, layer)
    said = truncated(layer)
    with pytest.raises(CheckpointError) as e:
        load_layer_file(layer)
    assert str(e.value) == said


# -- wording that matches what happened --------------------------------------------------------------------------


def test_estimate_memory_names_the_offload_as_what_expert_parallelism_refuses(capsys):
    script = load_entry_point("scripts/estimate_memory.py")
    layout = ["--model", "mixtral-8x7b", "--stages", "2", "--dp", "4", "--ep", "4", "--offload", "optimizer"]
    said = {}
    for zero in ("0", "1"):
        with pytest.raises(SystemExit):
            script.main([*layout, "--zero", zero])
        said[zero] = capsys.readouterr().err.strip()
    assert said["0"] == (
        "estimate_memory.py: error: --offload optimizer with ZeRO stage 0, where DeepSpeed ignores it: use --offload "
        "none (--ep 4 does not run with the optimizer offloaded; --zero 1 shards the optimizer states over the data "
        "axis)"
    )
    assert said["1"] == (
        "estimate_memory.py: error: --ep 4 with --offload optimizer: not supported yet (DeepSpeed's CPU Adam is not "
        "run with its MoE parameter groups here); keep the optimizer states on the GPU (--offload none; --zero 1 "
        "shards them over the data axis) or use --ep 1"
    )
    # train.py's own line: zero1_offload, which expert parallelism refuses as well, is not offered
    (line,) = layout_problems(Layout(stages=2, dp=4, ep=4, offload_optimizer=True), 8, "parameters")
    assert "zero1_offload" not in line and "remove offload_optimizer from the JSON" in line


@pytest.fixture
def stopper(tmp_path, monkeypatch):
    """A StopAndSave of rank 1 whose exits raise SystemExit (code) instead of ending the process; the signal
    handlers and the module's state are put back after."""
    monkeypatch.setattr(preemption, "_exiting", [])
    monkeypatch.setitem(preemption._job, "handler", None)
    monkeypatch.setitem(preemption._job, "marker", None)

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(preemption, "exit_now", exit_now)
    names = ("SIGTERM", "SIGUSR1", "SIGINT")
    previous = {name: signal.getsignal(getattr(signal, name)) for name in names}
    stop = StopAndSave(0, 30, 1, "cpu", str(tmp_path))
    yield stop
    if stop.timer is not None:
        stop.timer.cancel()
    for name, handler in previous.items():
        signal.signal(getattr(signal, name), handler)


@pytest.mark.parametrize("latest, code", [("global_step3", PREEMPTED_EXIT_CODE), ("global_step2", UNSAVED_EXIT_CODE)])
def test_a_second_signal_says_whether_the_checkpoint_of_the_step_is_complete(stopper, tmp_path, capsys, latest, code):
    """The second SIGTERM lands after rank 0 made global_step3 latest, before this rank's loop heard of it (it waits
    in the save's last barrier): it exits as saved. Before that, latest names the previous one: unsaved."""
    stopper._handle("SIGTERM")
    stopper.saving("global_step3")
    (tmp_path / "latest").write_text(latest)
    with pytest.raises(SystemExit) as e:
        stopper._handle("SIGTERM")
    assert e.value.code == code
    assert capsys.readouterr().err.strip() == (
        "[train] rank 1: a second SIGTERM arrived: checkpoint global_step3 is complete (latest names it); exiting now "
        f"(exit code {PREEMPTED_EXIT_CODE}); resume=auto continues from it exactly"
        if code == PREEMPTED_EXIT_CODE
        else "[train] rank 1: a second SIGTERM arrived before the checkpoint was complete: exiting now without a "
        f"checkpoint of this step (exit code {UNSAVED_EXIT_CODE}); resume=auto continues from the last complete "
        "checkpoint"
    )


LIST_KEYS = [
    ("profile_steps=5", "profile_steps=[5,5] for step 5 alone, e.g. profile_steps=[5,6]"),
    ("optim.betas=0.9", "optim.betas is a list of AdamW's two betas [beta1,beta2], e.g. optim.betas=[0.9,0.95]"),
    ("resume_allow_changes=optim", "write resume_allow_changes=[optim]"),
    ("peft.target_modules=q_proj", "write peft.target_modules=[q_proj]"),
    ("peft.modules_to_save=lm_head", "write peft.modules_to_save=[lm_head]"),
    ("monitor.wandb_tags=sft", "write monitor.wandb_tags=[sft]"),
]  # data.sources and data.eval_sources: training/overrides.py's source_override_problems (tests/test_misuse_data.py)


@pytest.mark.parametrize("override, form", LIST_KEYS, ids=[o for o, _ in LIST_KEYS])
def test_a_list_key_given_one_value_is_told_the_list_form(override, form):
    (line,) = override_key_problems([override])
    assert form in line and line.startswith(override.split("=")[0]), line


TYPED_KEYS = [
    ("max_steps=abc", "max_steps=abc: max_steps takes an integer, e.g. max_steps=100"),
    ("max_steps=[1,2]", "max_steps=[1,2]: max_steps takes an integer, e.g. max_steps=100"),
    ("optim.lr=fast", "optim.lr=fast: optim.lr takes a number, e.g. optim.lr=0.0003"),
    ("save_async=maybe", "save_async=maybe: save_async takes true or false"),
    (
        "profile_steps=[a,b]",
        "profile_steps=[a,b]: each entry of profile_steps must be an integer; profile_steps is a list of two steps "
        "[first,last]: profile_steps=[N,N] for step N alone, e.g. profile_steps=[5,6]",
    ),
]


@pytest.mark.parametrize("override, line", TYPED_KEYS, ids=[o for o, _ in TYPED_KEYS])
def test_a_value_of_another_type_is_told_the_form_the_key_takes(override, line):
    assert override_key_problems([override]) == [line]


def test_a_mapping_key_given_one_value_is_told_the_mapping_forms():
    """The case: ``model.architecture=abc`` was told "model.architecture takes typing.Dict[str, typing.Any]"."""
    (line,) = override_key_problems(["model.architecture=abc"])
    assert line == (
        "model.architecture=abc: model.architecture is a mapping: set one entry with model.architecture.<key>=value "
        "(a Hugging Face config key, e.g. model.architecture.hidden_size=64), or several with "
        "model.architecture='{hidden_size:64,num_hidden_layers:4}' (Hydra's mapping syntax)"
    )
    # the form it gives is one Hydra takes (a mapping merged into the group's architecture: no crash, no problem)
    assert override_key_problems(["model.architecture={hidden_size:64,num_hidden_layers:4}"]) == []


def test_every_declared_type_is_said_in_words():
    import typing
    from typing import Any, Dict, Literal, Optional

    from models.config_rules import type_words
    from training.config import DataFormat

    assert type_words(Optional[Dict[str, Any]]) == "a mapping (name: value) or null"
    assert type_words(Optional[DataFormat]) == "one of " + ", ".join(f.value for f in DataFormat) + " or null"
    assert type_words(int | float | None) == "a number or null"
    assert type_words(int | list[int] | None) == "an integer, a list of integers or null"
    assert type_words(Literal["a", "b"]) == "one of a, b"
    assert type_words(list[str]) == "a list of strings"
    for kind in (Optional[Dict[str, Any]], Optional[DataFormat], int | list[int] | None, typing.Any):
        assert "typing" not in type_words(kind) and "<" not in type_words(kind)


def test_what_hydra_accepts_is_not_refused_and_the_preflight_says_the_same():
    from training.preflight import composed_with_unknown

    accepted = ["profile_steps=[5,6]", "optim.betas=[0.9,0.99]", "max_steps=7", "optim.lr=1", "optim.lr=${optim.eps}"]
    assert override_key_problems([*accepted, "peft.target_modules=[q_proj,v_proj]", "save_async=true"]) == []
    with pytest.raises(ValueError) as e:
        composed_with_unknown(["profile_steps=5"])
    assert str(e.value) == "invalid configuration:\n  " + override_key_problems(["profile_steps=5"])[0]


def test_a_damaged_checkpoint_file_is_said_once_with_what_to_do(tmp_path):
    from training.run_checkpoints import cannot_resume

    # two ranks check layer_01 (its stage's and the pickle share's): one line, no rank list, and what to do
    bad = f"{tmp_path}/global_step4/layer_01-model_states.pt is truncated (48205 bytes): the end of its zip archive"
    (tmp_path / "global_step4").mkdir()
    text = cannot_resume(str(tmp_path), "global_step4", [bad, bad])
    assert text == (
        f"cannot resume from {tmp_path}/global_step4:\n  {bad}\nrestore the files named from a copy of "
        f"{tmp_path}/global_step4 (it is the only checkpoint in {tmp_path}), or start afresh in another output_dir"
    )
    (tmp_path / "global_step2").mkdir()  # an earlier checkpoint: named, and how to resume from it
    assert cannot_resume(str(tmp_path), "global_step4", [bad]).endswith(
        f"\nresume from the previous checkpoint, {tmp_path}/global_step2: write its name into {tmp_path}/latest "
        f"(`echo global_step2 > {tmp_path}/latest`; the next save deletes global_step4: copy it first to keep it), "
        "or restore the files named from a copy"
    )
