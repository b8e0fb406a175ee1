"""train_objective=grpo's configuration: grpo.* named and defaulted as TRL 1.16's GRPOConfig, data=grpo composing,
every GRPO refusal before start with its numbers and knob, grpo.* refused without GRPO, and TRL's settings we do
not have refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from training.configuration.overrides import TRL_GRPO_ONLY, override_key_problems
from training.configuration.preflight import composed, composed_with_unknown
from training.configuration.schema import (
    ConfigError,
    DataConfig,
    GRPOConfig,
    SourceConfig,
    TrainConfig,
)
from training.configuration.validate import objective_problems, resolve

REWARD = "tests.support.rewards_fixture:length_reward"
OURS_ONLY = ("reward_funcs", "generation_micro_batches")  # GRPOTrainer's argument, and this pipeline's own knob


@pytest.fixture(scope="module")
def trl_grpo_config():
    return pytest.importorskip("trl").GRPOConfig


@pytest.fixture()
def prompts(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"count to {i}", "answer": str(i)}) + "\n" for i in range(4)))
    return str(path)


@pytest.fixture()
def good(tmp_path, tiny_hf, prompts) -> TrainConfig:
    """pipe 2 x data 2 on 4 ranks, a global batch of 2 x 4 x 2 = 16 completions: 2 prompts x 8."""
    return TrainConfig(
        model_name_or_path=tiny_hf,
        output_dir=str(tmp_path / "out"),
        num_stages=2,
        micro_batch_size=2,
        gradient_accumulation_steps=4,
        train_objective="grpo",
        data=DataConfig(train_file=prompts, format="grpo", packing=False, max_seq_length=128),
        grpo=GRPOConfig(max_completion_length=64, reward_funcs=[REWARD]),
    )


def changed(cfg: TrainConfig, **changes) -> TrainConfig:
    """``cfg`` with dotted keys set (``grpo__top_k=-1`` sets grpo.top_k)."""
    for key, value in changes.items():
        *path, name = key.split("__")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, name, value)
    return cfg


def problems_of(cfg: TrainConfig, world_size: int = 4) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world_size)
    return str(err.value)


def test_defaults_are_trls(trl_grpo_config):
    """Each grpo.* key TRL has is named and defaulted as TRL 1.16's GRPOConfig declares it."""
    trl = {f.name: f.default for f in dataclasses.fields(trl_grpo_config)}
    for f in dataclasses.fields(GRPOConfig):
        if f.name in OURS_ONLY:
            continue
        ours = getattr(GRPOConfig(), f.name)
        assert f.name in trl and ours == trl[f.name], (f.name, ours, trl.get(f.name))
    assert GRPOConfig().reward_funcs == [] and GRPOConfig().generation_micro_batches == 0


def test_every_trl_setting_is_ours_or_refused_by_name(trl_grpo_config):
    """TRL_GRPO_ONLY names GRPOConfig's own fields only, and with ours covers every one of them."""
    declared = set(trl_grpo_config.__dict__["__annotations__"])
    ours = {f.name for f in dataclasses.fields(GRPOConfig)} - set(OURS_ONLY)
    assert set(TRL_GRPO_ONLY) <= declared, set(TRL_GRPO_ONLY) - declared
    assert not ours & set(TRL_GRPO_ONLY)
    assert declared == ours | set(TRL_GRPO_ONLY), declared - ours - set(TRL_GRPO_ONLY)


def test_data_grpo_composes():
    cfg = composed(["data=grpo", f"grpo.reward_funcs=[{REWARD}]", "grpo.loss_type=bnpo"])
    assert (cfg.train_objective, cfg.data.format, cfg.data.packing) == ("grpo", "grpo", False)
    assert cfg.grpo.reward_funcs == [REWARD] and cfg.grpo.loss_type == "bnpo" and cfg.grpo.num_generations == 8


@pytest.mark.parametrize("name", ["min_p", "steps_per_generation", "use_vllm", "vllm_mode", "use_bias_correction_kl"])
def test_trl_settings_we_do_not_have_are_refused_by_name(name):
    line = f"grpo.{name} is TRL GRPOConfig's setting, not supported here: {TRL_GRPO_ONLY[name]}"
    assert override_key_problems([f"grpo.{name}=1"]) == [line]
    cfg, unknown = composed_with_unknown(["data=grpo", f"+grpo.{name}=1"])
    assert unknown == [line]
    assert override_key_problems(["grpo.num_generation=4"]) == [
        "unknown key grpo.num_generation: did you mean grpo.num_generations?"
    ]


def test_the_valid_config_resolves(good):
    resolved = resolve(good, world_size=4)
    assert resolved.layout.global_batch == 16 and resolved.cfg.grpo.reward_funcs == [REWARD]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(train_objective="sft"),
            "train_objective=sft with data.format=grpo: GRPO generates completions for prompts",
        ),
        (dict(data__format="sft"), "train_objective=grpo with data.format=sft: GRPO generates completions"),
        (dict(data__packing=True), "data.packing=true with train_objective=grpo"),
        (
            dict(data__sources=[SourceConfig(path="PROMPTS")], data__train_file=""),
            "data.sources/eval_sources (1 and 0 sources) with train_objective=grpo: the prompts come from one "
            "source; use data.train_file",
        ),
        (dict(num_epochs=1.0), "num_epochs 1 with train_objective=grpo: a GRPO run counts max_steps"),
        (dict(sequence_parallel=2), "sequence_parallel 2 with train_objective=grpo"),
        (dict(expert_parallel=2), "expert_parallel 2 with train_objective=grpo is not supported yet"),
        (
            dict(pipeline_schedule="dualpipev", gradient_accumulation_steps=8, data__pad_to_multiple_of=0),
            "pipeline_schedule=dualpipev with train_objective=grpo",
        ),
        (
            dict(num_stages=1, ds_config="zero2"),
            "train_objective=grpo runs on the pipeline engine; num_stages=1 with ds=zero2 (ZeRO 2) uses DeepSpeed's "
            "data-parallel engine: use ds=zero0 or ds=zero1",
        ),
        (dict(compile=True), "compile=true with train_objective=grpo"),
        (dict(data__group_by_length=True), "data.group_by_length=true with train_objective=grpo"),
        (dict(loss_chunk_tokens=0), "loss_chunk_tokens 0 with train_objective=grpo"),
        (
            dict(loss_normalization="micro_batch"),
            "loss_normalization=micro_batch: normalises the next-token loss over label tokens; GRPO's loss",
        ),
        (dict(grpo__num_generations=1), "grpo.num_generations 1 must be >= 2"),
        (
            dict(grpo__num_generations=3),
            "the global batch micro_batch_size 2 x gradient_accumulation_steps 4 x data-parallel 2 = 16 is not a "
            "multiple of grpo.num_generations 3: it is the step's completions, num_generations per prompt",
        ),
        (dict(grpo__max_completion_length=0), "grpo.max_completion_length 0 must be >= 1"),
        (
            dict(grpo__max_completion_length=128),
            "grpo.max_completion_length 128 leaves no token of data.max_seq_length 128 for the prompt (its budget is "
            "max_seq_length - max_completion_length = 0)",
        ),
        (dict(grpo__temperature=0.0), "grpo.temperature 0 must be > 0"),
        (dict(grpo__top_p=0.0), "grpo.top_p 0 must be in (0, 1]"),
        (dict(grpo__top_p=1.5), "grpo.top_p 1.5 must be in (0, 1]"),
        (dict(grpo__top_k=-1), "grpo.top_k -1 must be >= 0"),
        (dict(grpo__beta=-0.1), "grpo.beta -0.1 must be >= 0"),
        (dict(grpo__epsilon=0.0), "grpo.epsilon 0 must be > 0"),
        (dict(grpo__epsilon_high=-0.1), "grpo.epsilon_high -0.1 must be >= 0, or None"),
        (dict(grpo__num_iterations=0), "grpo.num_iterations 0 must be >= 1"),
        (dict(grpo__generation_micro_batches=-1), "grpo.generation_micro_batches -1 must be >= 0"),
        (dict(grpo__reward_funcs=[]), "grpo.reward_funcs is empty: GRPO needs at least one reward function"),
        (dict(grpo__reward_funcs=["no_such_module_here:f"]), "grpo.reward_funcs[0] 'no_such_module_here:f' cannot"),
        (
            dict(grpo__reward_weights=[1.0, 2.0]),
            "grpo.reward_weights has 2 weights for 1 reward functions in grpo.reward_funcs",
        ),
    ],
)
def test_grpo_refusals(good, change, message):
    if "data__sources" in change:
        change["data__sources"] = [SourceConfig(path=good.data.train_file)]
    assert message in problems_of(changed(good, **change))


def test_every_grpo_problem_is_reported_at_once(good):
    cfg = changed(good, data__packing=True, compile=True, grpo__num_generations=1, grpo__top_k=-1)
    text = problems_of(cfg)
    for line in ("data.packing=true", "compile=true", "grpo.num_generations 1", "grpo.top_k -1"):
        assert line in text


def test_a_prompt_source_in_another_objectives_mixture_is_refused(prompts):
    cfg = TrainConfig(data=DataConfig(format="sft", sources=[SourceConfig(path=prompts, format="grpo")]))
    (line,) = objective_problems(cfg, layout=None)
    assert line.startswith(f"data.sources[0] ({prompts}) has format grpo, and train_objective is sft")
    assert f"train on it alone (data=grpo data.train_file={prompts})" in line


@pytest.mark.parametrize("objective, fmt", [("sft", "tokens"), ("dpo", "dpo")])
def test_grpo_settings_without_grpo_are_refused(good, objective, fmt):
    cfg = changed(good, train_objective=objective, data__format=fmt, grpo=GRPOConfig(beta=0.04, top_k=5))
    line = f"grpo.top_k=5, grpo.beta=0.04: GRPO settings, but train_objective is {objective}: use data=grpo"
    assert line in problems_of(cfg)


def test_the_prompt_column_is_checked_and_renamed_by_data_prompt_field(good, tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question": "2 + 2?", "answer": "4"}) + "\n")
    good.data.train_file = str(questions)
    assert "data.format=grpo reads a 'prompt' column, and its first record's keys are question, answer" in problems_of(
        good
    )
    good.data.prompt_field = "question"
    assert resolve(good, world_size=4).cfg.data.prompt_field == "question"
    good.data.prompt_field = "query"
    assert "data.prompt_field=query names a column that is not there" in problems_of(good)
