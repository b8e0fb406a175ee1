"""The axis contract: a plan put in ``AXES`` is asked by every collector with no other change (validation's problems,
warnings, adapted defaults, objective, compile and harmless-setting rules; the planner's refusals; the stage's
plans), and the collectors themselves name no axis.

A toy axis, used on layouts of three stages, stands in for a new one; ``AXES`` is patched where each collector reads
it, which is what an entry in parallel/axes.py gives them all.
"""

from __future__ import annotations

import inspect
import json
import re

import pytest

from parallel import memory_plan, stage
from parallel.axes import AXES
from parallel.axis import AxisPlan, ModelFacts, RuleSettings
from parallel.layout import Layout
from training import compile as compile_rules
from training.configuration import validate
from training.configuration.schema import ConfigError, DataConfig, TrainConfig
from training.configuration.validate import resolve

REFUSED = "toy_parallel: micro_batch_size 3 is refused"


class ToyPlan(AxisPlan):
    """A new axis, as parallel/axis.py's contract asks for one: its rules and no step."""

    harmless_settings = ((("data.group_by_length",), lambda cfg, layout: False, "the toy axis reorders nothing"),)

    @staticmethod
    def used(layout: Layout) -> bool:
        return layout.stages == 3

    @staticmethod
    def layout_problems(layout: Layout, model=ModelFacts(), settings=RuleSettings()) -> list[str]:
        return [REFUSED] if layout.micro_batch == 3 else []

    @staticmethod
    def warnings(layout: Layout, local_world_size: int) -> list[str]:
        return ["toy_parallel: a warning"] if layout.stages == 3 else []

    @staticmethod
    def defaults(cfg, is_set) -> list[tuple[str, object, str]]:
        return [] if cfg.num_stages != 3 or is_set("optim.warmup_steps") else [("optim.warmup_steps", 1, "toy")]

    @staticmethod
    def compile_problems(layout: Layout) -> list[str]:
        return ["toy_parallel: not compiled"] if layout.stages == 3 else []

    @staticmethod
    def objective_problems(layout: Layout, train_objective: str) -> list[str]:
        return ["toy_parallel: no dpo"] if layout.stages == 3 and train_objective == "dpo" else []


@pytest.fixture()
def toy_axis(monkeypatch):
    for module in (validate, memory_plan, stage, compile_rules):
        monkeypatch.setattr(module, "AXES", (*AXES, ToyPlan))


def config(tmp_path, tiny_hf, **overrides) -> TrainConfig:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    settings = dict(num_stages=3, ds_config="zero1", micro_batch_size=2, gradient_accumulation_steps=4)
    return TrainConfig(model_name_or_path=tiny_hf, data=DataConfig(train_file=str(data)), **{**settings, **overrides})


def test_validation_asks_a_new_axis_every_rule(tmp_path, tiny_hf, toy_axis):
    cfg = config(tmp_path, tiny_hf)
    cfg.data.group_by_length = True
    resolved = resolve(cfg, world_size=3)
    assert "toy_parallel: a warning" in resolved.warnings
    assert "data.group_by_length=True: the toy axis reorders nothing" in resolved.warnings
    assert any(line.startswith("optim.warmup_steps 0 -> 1 (the default; toy)") for line in resolved.adapted)
    with pytest.raises(ConfigError) as err:
        resolve(config(tmp_path, tiny_hf, micro_batch_size=3), world_size=3)
    assert REFUSED in str(err.value)
    with pytest.raises(ConfigError, match="toy_parallel: not compiled"):
        resolve(config(tmp_path, tiny_hf, compile=True), world_size=3)
    with pytest.raises(ConfigError, match="toy_parallel: no dpo"):
        resolve(config(tmp_path, tiny_hf, train_objective="dpo"), world_size=3)


def test_without_the_entry_nothing_asks_it(tmp_path, tiny_hf):
    resolved = resolve(config(tmp_path, tiny_hf, micro_batch_size=3), world_size=3)
    assert not any("toy" in line for line in resolved.warnings + resolved.adapted)
    assert not any(isinstance(plan, ToyPlan) for plan in stage.axis_plans(Layout(stages=3)))


def test_the_planner_and_the_stage_ask_a_new_axis(toy_axis):
    assert REFUSED in memory_plan.refusals_of(Layout(stages=3, micro_batch=3), 3, None, None)
    assert REFUSED not in memory_plan.refusals_of(Layout(stages=3, micro_batch=2), 3, None, None)
    assert [type(plan) for plan in stage.axis_plans(Layout(stages=3))] == [ToyPlan]
    assert stage.axis_plans(Layout(stages=2)) == []


AXIS_WORDS = re.compile(r"(?:tensor(?!board)|sequence|expert|dualpipe|schedule|\b(?:tp|sp|ep)\b)\w*", re.IGNORECASE)


def test_the_collectors_name_no_axis():
    """validate.py's code and compile's refusals (comments and strings dropped; monitor.tensorboard and
    optim.scheduler are not axes) and the planner's refusals name no axis: each loops over AXES."""
    source = inspect.getsource(validate) + inspect.getsource(compile_rules.compile_problems)
    code = re.sub(r"#[^\n]*|\"\"\".*?\"\"\"|\"[^\"\n]*\"", "", source, flags=re.DOTALL)
    assert not AXIS_WORDS.findall(code.replace("optim.scheduler", "")), AXIS_WORDS.findall(code)
    refusals = inspect.getsource(memory_plan.refusals_of).split('"""')[-1]
    assert not AXIS_WORDS.search(refusals), refusals
