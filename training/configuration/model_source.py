"""The model a run trains: model_name_or_path's checkpoint, or an architecture of the Hydra model group
(``conf/model/*.yaml``) trained from scratch; each of a family in ``models.families``."""

from __future__ import annotations

import os

import yaml

from data.checks import LOADABLE_TOKENIZER_FILES
from models.config_rules import model_config_problems
from models.families import ModelConfigError, UnsupportedModelError, config_from_dict, load_config
from models.files.hf_stage import hf_start_problems, is_hf_dir
from models.files.peft_adapter import lora_run_base
from models.files.pipeline_dir import latest_tag
from training.configuration.schema import MODEL_CONF_DIR, TrainConfig

# Fields that define the modules and tensor shapes: a checkpoint and a chosen architecture must agree.
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def model_group_names() -> list[str]:
    """The entries of the ``model=`` group (conf/model/*.yaml)."""
    return sorted(f[: -len(".yaml")] for f in os.listdir(MODEL_CONF_DIR) if f.endswith(".yaml"))


def model_group_config(name: str, **overrides):
    """The Hugging Face config (its family's class, ``models.families``) of ``conf/model/<name>.yaml``'s
    architecture, with ``overrides`` applied; None for an entry that takes its architecture from a
    checkpoint (``checkpoint``). For scripts and tests; train.py reads the same file through Hydra."""
    path = os.path.join(MODEL_CONF_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model {name!r}: no {path} (choose one of {model_group_names()})")
    with open(path) as f:
        arch = yaml.safe_load(f)["architecture"]
    return None if arch is None else config_from_dict({**arch, **overrides}, where=path)


def resolve_model(cfg: TrainConfig) -> tuple[object, list[str]]:
    """(Hugging Face config or None, problems): from model_name_or_path, or from the model group's
    architecture; either must be of a family in models.families."""
    arch = dict(cfg.model.architecture) if cfg.model.architecture is not None else None
    if cfg.model_name_or_path:
        if not os.path.isfile(os.path.join(cfg.model_name_or_path, "config.json")):
            name = cfg.model_name_or_path
            if not os.path.isdir(name) and name in model_group_names():  # the group's name taken for a checkpoint
                return None, [
                    f"model_name_or_path {name} is not a directory, and {name} is conf/model/{name}.yaml: did you "
                    f"mean model={name}? (an architecture from scratch, with model.tokenizer=DIR; to fine-tune, "
                    "model_name_or_path is a checkpoint directory made by convert2ckpt.py)"
                ]
            return None, [f"model_name_or_path {name}: no config.json there"]
        try:
            config = load_config(cfg.model_name_or_path)
        except UnsupportedModelError as e:
            return None, config_problems(e)
        # a meaningless value (its own problem) would mislead the rules that read the model: they skip it
        values = model_config_problems(config, os.path.join(cfg.model_name_or_path, "config.json"), override=False)
        if values:
            return None, values
        if arch is None:
            return config, []
        try:
            chosen = config_from_dict(arch, where=f"model.architecture (model={cfg.model.name})")
        except UnsupportedModelError as e:
            return config, config_problems(e)
        return config, [
            f"model={cfg.model.name} has {f}={getattr(chosen, f)} but {cfg.model_name_or_path}/config.json has "
            f"{getattr(config, f)}: drop the model= override or use a checkpoint of that architecture"
            for f in SHAPE_FIELDS
            if getattr(chosen, f) != getattr(config, f)
        ]
    if arch is None:
        return None, [
            "no model: set model_name_or_path=CKPT_DIR (made by convert2ckpt.py, or a Hugging Face directory with "
            "safetensors) or, to train from "
            "scratch, model=<architecture in conf/model/> and model.tokenizer=DIR"
        ]
    problems = []
    if not cfg.model.tokenizer or not any(
        os.path.isfile(os.path.join(cfg.model.tokenizer, f)) for f in LOADABLE_TOKENIZER_FILES
    ):
        problems.append(
            f"model.tokenizer {cfg.model.tokenizer!r} holds no tokenizer ({' or '.join(LOADABLE_TOKENIZER_FILES)}): "
            f"training from scratch needs one (it is saved with every checkpoint)"
        )
    where = f"model.architecture (model={cfg.model.name})"
    try:
        config = config_from_dict(arch, where=where)
    except UnsupportedModelError as e:
        return None, problems + config_problems(e)
    values = model_config_problems(config, where, override=True)
    return (None, problems + values) if values else (config, problems)


def config_problems(error: UnsupportedModelError) -> list[str]:
    """The lines of a config the family table cannot build: one per value (ModelConfigError), or the one."""
    return error.problems if isinstance(error, ModelConfigError) else [str(error)]


def input_checkpoint_problems(cfg: TrainConfig, model_config=None) -> list[str]:
    """model_name_or_path that is not a model to start from: the run's own output_dir, a LoRA run (whose layer
    files hold adapters, not a model), or a Hugging Face directory (of ``model_config``) that train.py cannot read
    (models/files/hf_stage.py) or that LoRA cannot use as its base."""
    path = cfg.model_name_or_path
    if not path or not os.path.isdir(path):
        return []
    if os.path.realpath(path) == os.path.realpath(cfg.output_dir):
        return [
            f"output_dir {cfg.output_dir} is model_name_or_path: the run would write its checkpoints into its input; "
            "set output_dir to a new directory"
        ]
    if is_hf_dir(path):
        problems = hf_start_problems(path, model_config) if model_config is not None else []
        if cfg.peft.method != "none":  # the adapters' export and resume check the base's layer files (SHA-256s)
            ckpt = path.rstrip(os.sep) + "-ckpt"
            problems.append(
                f"peft.method={cfg.peft.method} adapts a base in layer files (its checkpoints record their SHA-256s), "
                f"and model_name_or_path {path} is a Hugging Face directory: convert it first (python convert2ckpt.py "
                f"--input {path} --output {ckpt}), then model_name_or_path={ckpt}"
            )
        return problems
    tag = latest_tag(path)
    if tag and os.path.isdir(os.path.join(path, tag)) and lora_run_base(os.path.join(path, tag)):
        return [
            f"model_name_or_path {path} is a LoRA run, whose layer files hold adapters, not a model: continue it "
            f"with output_dir={path} and its base as model_name_or_path, start from its adapters (convert2ckpt.py "
            f"--to-hf --input {path} --output ADAPTER_DIR, then peft.init_from=ADAPTER_DIR), or merge it into a model "
            f"first (convert2ckpt.py --to-hf --merge --input {path} --output MERGED_HF, then convert2ckpt.py "
            "--input MERGED_HF --output CKPT_DIR)"
        ]
    return []
