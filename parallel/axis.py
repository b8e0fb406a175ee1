"""What a parallel axis's plan is: the rules of an axis and the steps at which it acts on a rank's pipeline stage and
its engine.

Each axis (tensor parallelism, parallel/tensor_parallel.py; sequence parallelism, parallel/sequence_parallel.py;
expert parallelism, parallel/expert_parallel.py; the pipeline schedule, parallel/dualpipev.py) is one
:class:`AxisPlan` subclass, which owns its rules and overrides the steps where it acts; the base has no rule and
does nothing at any step. ``parallel.axes.AXES`` lists the axes, in the order they apply.

The rules are class-level (they run before any plan is built, and the planner asks them of layouts no run builds);
each collector asks every axis in one loop over ``AXES``:

- ``layout_problems(layout, model, settings)``: what train.py refuses about a layout, given the model's
  :class:`ModelFacts` and train.py's :class:`RuleSettings` (the planner's refusals, parallel/memory_plan.py);
- ``problems(cfg, model_config, layout, ds_json)``: the same with a training config's settings, and the rules that
  need the config itself (training.configuration.validate.resolve);
- ``harmless_settings``: settings that cannot act where the axis is used (a warning each, validate's
  ``inert_settings``);
- ``warnings(layout, local_world_size)``, ``defaults(cfg, is_set)`` (defaults the axis cannot run with, adapted:
  validate's ``adapt_defaults``), ``objective_problems(layout, train_objective)`` (validate's objective rules) and
  ``compile_problems(layout)`` (what ``compile=true`` does not run with, training/compile.py) and
  ``fp8_problems(layout, recipe)`` (what ``fp8`` does not run with, models/fp8.py).

``parallel.stage.axis_plans(layout)`` builds the plans a layout uses, and their steps run in this order:

1. ``before_build``: collectives that must precede the stage's own process groups (every rank, in the same order),
   and the attention function the decoder layers call;
2. ``stage_class``: the ``LlamaPipelineModule`` subclass the stage is built as, which says what building, saving and
   loading do with the axis's pieces (``parallel.stage.stage_class``; no two axes with a class of their own combine:
   their rules refuse it);
3. ``checkpoint_pieces``: the functions that write and read the axis's share of a checkpoint (the stage class's
   ``save_state_dict`` / ``load_state_dir``, through parallel/split_layer_files.py for parameters split over ranks;
   files of the engine's own); none: DeepSpeed's layer files and engine file as they are;
4. ``apply``: the built stage changed in place; returns what the loss needs to know of this rank's share (fields of
   ``models.loss.LossSplit``), which ``build_pipeline_model`` hands to the loss;
5. ``ds_config_``: the keys of the DeepSpeed config the axis needs (training/optim.py's ``fill_ds_config``);
6. ``building_engine``: a context around ``deepspeed.initialize`` (training/build.py);
7. ``adopt_engine``: the engine ``deepspeed.initialize`` built, made the axis's (training/build.py);
8. ``announce``: the axis's start-up lines (training/observation/announce.py);
9. ``end_check``: a check at the end of a run (training/loop.py).

A new axis is a config field (training/configuration/schema.py) read into a new ``Layout`` field (``Layout.of``), an
:class:`AxisPlan` subclass in its own module with its rules and its steps, and an entry in ``parallel.axes.AXES``:
validation and the planner find its rules there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from models.families import moe_spec
from models.family_gemma4 import largest
from parallel.layout import Layout


@dataclass(frozen=True)
class ModelFacts:
    """What the axes' rules read of the model; None: not known, not checked."""

    num_layers: int | None = None  # decoder layers
    heads: int | None = None  # attention heads
    kv_heads: int | None = None  # key/value heads (given with ``heads``)
    model_type: str | None = None  # names the model in the lines
    num_experts: int | None = None  # each MoE layer's experts, 0 for a dense model

    @classmethod
    def of(cls, model_config) -> ModelFacts:
        """The facts of a loaded model config (None: nothing known; its own problem is said)."""
        if model_config is None:
            return cls()
        moe = moe_spec(model_config)
        return cls(
            num_layers=model_config.num_hidden_layers,
            heads=model_config.num_attention_heads,
            kv_heads=largest(model_config, "num_key_value_heads"),  # Gemma 4's full layers may have their own
            model_type=model_config.model_type,
            num_experts=moe.num_experts if moe is not None else 0,
        )


@dataclass(frozen=True)
class RuleSettings:
    """train.py's settings beyond the layout that the axes' rules read: they only shape the lines, and by default
    are those the layout implies (``ds_config`` zeroN of its ZeRO stage, ``peft_method`` lora where it has a LoRA
    rank) or train.py's defaults, rows fed whole (the planner's)."""

    peft_method: str | None = None
    ds_config: str | None = None
    pad_to_multiple_of: int = 0
    loss_normalization: str = "tokens"
    attention: str = "documents"
    train_objective: str = "sft"

    @classmethod
    def of(cls, cfg) -> RuleSettings:
        """The settings of a training config (training.configuration.schema.TrainConfig)."""
        return cls(
            peft_method=cfg.peft.method,
            ds_config=cfg.ds_config,
            pad_to_multiple_of=cfg.data.pad_to_multiple_of,
            loss_normalization=cfg.loss_normalization,
            attention=cfg.attention,
            train_objective=cfg.train_objective,
        )

    def peft(self, layout: Layout) -> str:
        return self.peft_method if self.peft_method is not None else "lora" if layout.lora_rank else "none"

    def ds(self, layout: Layout) -> str:
        return self.ds_config if self.ds_config is not None else f"zero{layout.zero}"


class AxisPlan:
    """One parallel axis: its rules (class-level) and its steps on a pipeline stage (the lists above); the base has
    no rule and does nothing at any step."""

    stage_class: type | None = None  # None: LlamaPipelineModule
    checkpoint_pieces: tuple = ()
    # Settings harmless where this axis is used, one warning each, as validate's HARMLESS_RULES: (keys, whether they
    # act: fn(cfg, layout), why).
    harmless_settings: tuple = ()

    def __init__(self, layout: Layout):
        self.layout = layout

    @staticmethod
    def used(layout: Layout) -> bool:
        """Whether ``layout`` uses this axis."""
        raise NotImplementedError

    @staticmethod
    def layout_problems(
        layout: Layout, model: ModelFacts = ModelFacts(), settings: RuleSettings = RuleSettings()
    ) -> list[str]:
        """What train.py refuses about ``layout`` on this axis, in its words (its knob names)."""
        return []

    @classmethod
    def problems(cls, cfg, model_config, layout: Layout, ds_json: dict | None = None) -> list[str]:
        """Everything train.py refuses on this axis (cfg: training.configuration.schema.TrainConfig; model_config
        None where it could not be loaded): the layout's rules with the config's settings."""
        return cls.layout_problems(layout, ModelFacts.of(model_config), RuleSettings.of(cfg))

    @staticmethod
    def warnings(layout: Layout, local_world_size: int) -> list[str]:
        """What runs, but worse than it could (``local_world_size``: ranks per node, 0 unknown)."""
        return []

    @staticmethod
    def defaults(cfg, is_set) -> list[tuple[str, object, str]]:
        """The defaults the axis cannot run with: (key, the value it runs with, why) for each such key ``is_set``
        says the user left (cfg: training.configuration.schema.TrainConfig)."""
        return []

    @staticmethod
    def compile_problems(layout: Layout) -> list[str]:
        """What ``compile=true`` does not run with on this axis (training/compile.py asks when compile is on)."""
        return []

    @staticmethod
    def fp8_problems(layout: Layout, recipe: str) -> list[str]:
        """What ``fp8`` = ``recipe`` does not run with on this axis (validate asks when fp8 is set, models/fp8.py)."""
        return []

    @staticmethod
    def objective_problems(layout: Layout, train_objective: str) -> list[str]:
        """What the axis does not run with under ``train_objective`` (asked for train_objective=dpo and grpo)."""
        return []

    def before_build(self, config, topology, attention: str) -> str:
        """Before the stage is built: returns the attention function (a registered name) the decoder layers call,
        given the one the config asks for."""
        return attention

    def apply(self, model) -> dict:
        """The built stage, changed in place; returns fields of ``models.loss.LossSplit`` for this rank's loss."""
        return {}

    def ds_config_(self, ds: dict) -> None:
        """Set the keys of the DeepSpeed config ``ds`` that the axis needs."""

    def building_engine(self) -> contextlib.AbstractContextManager:
        """A context ``deepspeed.initialize`` runs in (expert parallelism: DeepSpeed's MoE paths turned on)."""
        return contextlib.nullcontext()

    def adopt_engine(self, engine) -> None:
        """Make the engine ``deepspeed.initialize`` built the axis's."""

    def announce(self, engine, gather) -> list[str]:
        """The axis's start-up lines; ``gather(what, fn)`` runs ``fn`` on every rank and returns every rank's result
        (training.resilience.all_ranks.on_all_ranks)."""
        return []

    def end_check(self, model, gather) -> tuple[str, str]:
        """At the end of a run: (a problem that stops the run, else "", the line that says the check passed, or "")."""
        return "", ""
