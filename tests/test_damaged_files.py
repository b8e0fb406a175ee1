"""Damaged or missing files (and values of the wrong form) are named with what is wrong and only a hint that applies.

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

from models.files import hf_dir_checks
from models.files.hf_convert import ConversionError, hf_to_stages
from models.files.hf_stage import hf_start_problems
from models.files.pipeline_dir import CheckpointError, load_deepspeed_file, load_layer_file
from models.tiny import save_random_model, tiny_config
from parallel.layout import Layout, layout_problems
from tests.support.scripts import load_entry_point
from training.checkpoints.save_restore import unsafe_checkpoint_files
from training.configuration.overrides import override_key_problems
from training.configuration.resume_rules import reshard_reason
from training.configuration.schema import ResumeChanges, TrainConfig
from training.resilience import preemption
from training.resilience.preemption import PREEMPTED_EXIT_CODE, UNSAVED_EXIT_CODE, StopAndSave

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
    exported = hf_dir_checks.load_failure(src, OSError("transformers' own error"))  # generate.py, eval_hf.py
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
    """expert_parallel always reads the optimizer states per parameter (training/checkpoints/reshard.py), on the saved
    layout too: a damaged file there is the checkpoint's, named with what reading it said."""
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
    # data.sources and data.eval_sources: training/configuration/overrides.py's source_override_problems
    # (tests/test_data_refusals.py)
]


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
    from training.configuration.schema import DataFormat

    assert type_words(Optional[Dict[str, Any]]) == "a mapping (name: value) or null"
    assert type_words(Optional[DataFormat]) == "one of " + ", ".join(f.value for f in DataFormat) + " or null"
    assert type_words(int | float | None) == "a number or null"
    assert type_words(int | list[int] | None) == "an integer, a list of integers or null"
    assert type_words(Literal["a", "b"]) == "one of a, b"
    assert type_words(list[str]) == "a list of strings"
    for kind in (Optional[Dict[str, Any]], Optional[DataFormat], int | list[int] | None, typing.Any):
        assert "typing" not in type_words(kind) and "<" not in type_words(kind)


def test_what_hydra_accepts_is_not_refused_and_the_preflight_says_the_same():
    from training.configuration.preflight import composed_with_unknown

    accepted = ["profile_steps=[5,6]", "optim.betas=[0.9,0.99]", "max_steps=7", "optim.lr=1", "optim.lr=${optim.eps}"]
    assert override_key_problems([*accepted, "peft.target_modules=[q_proj,v_proj]", "save_async=true"]) == []
    with pytest.raises(ValueError) as e:
        composed_with_unknown(["profile_steps=5"])
    assert str(e.value) == "invalid configuration:\n  " + override_key_problems(["profile_steps=5"])[0]


def test_a_damaged_checkpoint_file_is_said_once_with_what_to_do(tmp_path):
    from training.checkpoints.save_restore import cannot_resume

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


# -- a damaged prepared directory or cache entry is refused, naming the file ---------------------------------------


def prepared_dir(path, rows: int = 6, seq_len: int = 8) -> str:
    """A prepared directory's layout (scripts/prepare_data.py): meta.json and one shard of .bin files."""
    import numpy as np

    from data.cache import ARRAYS, NUM_TOKENS

    shard = os.path.join(path, "shard-00000")
    os.makedirs(shard)
    for name in ARRAYS:
        np.ones((rows, seq_len), dtype=np.int32).tofile(os.path.join(shard, f"{name}.bin"))
    np.full(rows, seq_len, dtype=np.int32).tofile(os.path.join(shard, f"{NUM_TOKENS}.bin"))
    meta = {"prepared": 1, "seq_len": seq_len, "num_samples": rows, "tokens": rows * seq_len, "settings": {}}
    meta["shards"] = [{"dir": "shard-00000", "num_samples": rows}]
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    return str(path)


def cut(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda d: cut(f"{d}/shard-00000/num_tokens.bin", 8), "num_tokens.bin holds 8 bytes, and"),
        (lambda d: cut(f"{d}/shard-00000/input_ids.bin", 100), "input_ids.bin holds 100 bytes, and"),
        (lambda d: os.remove(f"{d}/shard-00000/labels.bin"), "shard-00000/labels.bin is missing"),
        (lambda d: __import__("shutil").rmtree(f"{d}/shard-00000"), "shard-00000 is missing"),
    ],
)
def test_a_damaged_prepared_directory_is_refused_naming_the_file(tmp_path, damage, said):
    from data.cache import TokenBlocks
    from data.sources import DataError

    d = prepared_dir(tmp_path)
    assert len(TokenBlocks(d)) == 6
    damage(d)
    with pytest.raises(DataError) as e:
        TokenBlocks(d)
    assert said in str(e.value) and "prepare the data again" in str(e.value)
    if "bytes" in said:
        expected = "24 (6 rows x 4 bytes)" if "num_tokens" in said else "192 (6 rows x 8 x 4 bytes)"
        assert expected in str(e.value)


def test_a_meta_json_with_a_count_that_is_not_a_number_is_said_damaged(tmp_path):
    from data.cache import entry_files_problem

    d = prepared_dir(tmp_path)
    with open(f"{d}/meta.json") as f:
        meta = json.load(f)
    meta["num_samples"] = "many"
    assert entry_files_problem(d, meta) == (
        f"{d}/meta.json is damaged: num_samples is 'many', not a whole number: prepare the data again "
        "(python scripts/prepare_data.py)"
    )


def test_a_cut_cache_entry_is_refused_with_its_deletion_as_the_fix(tmp_path):
    from data.cache import entry_files_problem

    d = prepared_dir(tmp_path)
    entry = f"{d}/shard-00000"
    cut(f"{entry}/position_ids.bin", 4)
    problem = entry_files_problem(entry, {"seq_len": 8, "num_samples": 6})
    assert "position_ids.bin holds 4 bytes" in problem and f"delete the cache entry {entry}" in problem


def test_a_prepared_directory_missing_its_meta_json_is_said_so(tmp_path):
    from data.sources import source_problems

    d = prepared_dir(tmp_path)
    os.remove(f"{d}/meta.json")
    (problem,) = source_problems(d)
    assert "looks like a directory made by scripts/prepare_data.py" in problem and "missing its meta.json" in problem


# -- a misspelt ds_config key is refused, not ignored ---------------------------------------------------------------


def test_a_misspelt_ds_config_key_is_refused_with_the_nearest_key(tmp_path):
    from training.configuration.ds_json import load_ds_json

    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"zero_optimisation": {"stage": 1}, "bf16": {"enabled": "auto"}}))
    ds_json, problem = load_ds_json(str(path))
    assert problem == (
        "ds_config typo.json: unknown key 'zero_optimisation' (DeepSpeed ignores it): did you mean 'zero_optimization'?"
    )


def test_every_shipped_ds_config_and_deepspeeds_documented_keys_pass():
    from training.configuration.ds_json import available_ds_configs, load_ds_json, unknown_key_problems

    for name in available_ds_configs():
        assert load_ds_json(name)[1] is None, name
    documented = [
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
        "communication_data_type", "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "fp16",
        "bf16", "amp", "gradient_clipping", "zero_optimization", "aio", "activation_checkpointing", "flops_profiler",
        "steps_per_print", "wall_clock_breakdown", "dump_state", "tensorboard", "wandb", "csv_monitor", "comet",
        "comms_logger", "checkpoint", "data_types", "data_efficiency", "zero_allow_untested_optimizer", "pipeline",
        "elasticity", "autotuning", "compression_training", "torch_autocast", "memory_breakdown",
    ]  # fmt: skip
    assert unknown_key_problems("x.json", dict.fromkeys(documented, {})) == []


# -- a PEFT adapter directory (peft.init_from) and the JSON files a run reads are named when damaged --------------


def adapter_dir(path, **config) -> str:
    """An adapter directory with PEFT's adapter_config.json (the pipeline's default peft settings, then ``config``)
    and a one-tensor adapter_model.safetensors."""
    os.makedirs(path, exist_ok=True)
    saved = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": False, "use_dora": False}
    saved |= {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(saved | config))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({key: torch.zeros(8, 64)}, str(path / "adapter_model.safetensors"))
    return str(path)


def test_a_truncated_adapter_file_is_named_as_truncated(tmp_path):
    from models.files.peft_adapter import adapter_model_problems

    adapter = adapter_dir(tmp_path / "adapter")
    cut(os.path.join(adapter, "adapter_model.safetensors"), 50)
    (problem,) = adapter_model_problems(adapter, tiny_config())
    assert problem.startswith(f"peft.init_from: {adapter}/adapter_model.safetensors is truncated")


def test_a_target_modules_string_is_read_as_peft_reads_it_never_split_into_characters(tmp_path):
    from models.files.peft_adapter import adapter_settings_problems
    from training.configuration.schema import PeftConfig

    peft = PeftConfig(method="lora")
    assert adapter_settings_problems(adapter_dir(tmp_path / "all", target_modules="all-linear"), peft) == ([], [])
    damaged, differs = adapter_settings_problems(adapter_dir(tmp_path / "re", target_modules=".*q_proj"), peft)
    assert differs == [] and damaged[0].startswith(f"target_modules '.*q_proj' in {tmp_path}/re/adapter_config.json")
    assert "write the modules it selects there as a list" in damaged[0]


def test_a_value_of_the_wrong_type_in_adapter_config_is_the_files_fault(tmp_path):
    from models.files.peft_adapter import adapter_settings_problems
    from training.configuration.schema import PeftConfig

    damaged, differs = adapter_settings_problems(adapter_dir(tmp_path / "a", r="eight"), PeftConfig(method="lora"))
    assert differs == [] and damaged == [
        f"r 'eight' in {tmp_path}/a/adapter_config.json is not an integer: the file is damaged or hand-edited; write "
        "the value the adapter was trained with, or copy it again"
    ]


def test_a_missing_init_from_directory_is_said_missing(tmp_path):
    from models.lora_rules import peft_problems
    from training.configuration.schema import PeftConfig

    cfg = TrainConfig(model_name_or_path="ckpt", peft=PeftConfig(method="lora", init_from=str(tmp_path / "gone")))
    assert f"peft.init_from {tmp_path}/gone: no such directory" in "\n".join(peft_problems(cfg, None, Layout()))


@pytest.mark.parametrize("text", ['{"r": 8,\n', ""])
def test_a_json_file_that_is_not_json_is_named_with_what_to_do(tmp_path, text):
    from data.sources import is_prepared
    from models.families import load_config
    from models.files.peft_adapter import adapter_settings_problems
    from training.configuration.schema import PeftConfig

    for name in ("adapter_config.json", "config.json", "meta.json"):
        (tmp_path / name).write_text(text)
    (damaged,), _ = adapter_settings_problems(str(tmp_path), PeftConfig(method="lora"))
    assert damaged.startswith(f"peft.init_from: {tmp_path}/adapter_config.json: not valid JSON (")
    assert damaged.endswith("): copy the adapter directory again (save_pretrained's output)")
    with pytest.raises(ValueError, match=f"{tmp_path}/config.json: not valid JSON .*copy the model's config.json"):
        load_config(str(tmp_path))
    with pytest.raises(ValueError, match=f"{tmp_path}/meta.json: not valid JSON .*copy the prepared directory again"):
        is_prepared(str(tmp_path))


def test_the_preflight_refuses_a_cut_prepared_directory_too(tmp_path):
    from data.tokenize_settings import prepared_problems

    d = prepared_dir(tmp_path)
    cut(f"{d}/shard-00000/num_tokens.bin", 8)
    cfg = TrainConfig()
    cfg.data.train_file = d
    (problem,) = prepared_problems(cfg, object())
    assert problem.startswith(
        f"data.train_file {d}/shard-00000/num_tokens.bin holds 8 bytes, and {d}/meta.json implies 24"
    )
