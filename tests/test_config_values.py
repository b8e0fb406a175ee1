"""A config's values are checked before start, not only its types: the model's own config, its vocabulary, expert
parallelism's precisions and every float key of the training config.

Through training/configuration/validate.py's resolve, which the preflight runs: the model's own config (config.json, or
model.architecture) where it changes the loss or the routing (models/config_rules.py), its vocabulary against its
tokenizer (data/cache.py's vocab_problem), expert parallelism's precisions, and every float key of the training config:
finite (training/configuration/float_keys.py) and in its range, as docs/configuration.md says it."""

from __future__ import annotations

import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import transformers
from safetensors.torch import load_file, save_file

from models.families import load_config
from models.files.hf_convert import HFTensorSource, hf_input_problems
from models.tiny import tiny_config
from tools.config_docs import render
from training.configuration.float_keys import FLOAT_RANGES, float_leaves, range_key
from training.configuration.model_source import resolve_model
from training.configuration.preflight import check
from training.configuration.schema import (
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    PeftConfig,
    SourceConfig,
    TrainConfig,
)
from training.configuration.validate import MFU_PEAK_TFLOPS, resolve
from training.observation.announce import model_lines, moe_line

NAN, INF = float("nan"), float("inf")


@pytest.fixture()
def cfg(tmp_path, tiny_hf) -> TrainConfig:
    """A valid config for 4 ranks (tiny Llama, pipe 2 x data 2, ZeRO-1)."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    return TrainConfig(
        model_name_or_path=tiny_hf,
        output_dir=str(tmp_path / "out"),
        num_stages=2,
        micro_batch_size=2,
        gradient_accumulation_steps=4,
        data=DataConfig(train_file=str(data)),
    )


def problems_of(cfg: TrainConfig, world_size: int = 4) -> list[str]:
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world_size)
    return [line.strip() for line in str(err.value).splitlines()[1:]]


# keys of released config.json files (Qwen3-MoE's num_experts, transformers 4's rope keys) -> the key transformers 5
# writes instead, dropped where a test gives the released one
RELEASED_KEYS = {"num_experts": "num_local_experts", "rope_theta": "rope_parameters", "rope_scaling": "rope_parameters"}


def scratch(cfg: TrainConfig, tokenizer_dir: str, model_type: str = "llama", **fields) -> TrainConfig:
    """``cfg`` training a tiny ``model_type`` from scratch with the test tokenizer (512 tokens)."""
    arch = {"model_type": model_type, **tiny_config(model_type).to_diff_dict()}
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype", *map(RELEASED_KEYS.get, fields)):
        arch.pop(key, None)
    arch.update(fields)
    cfg.model_name_or_path = ""
    cfg.model = ModelConfig(name=f"tiny-{model_type}", architecture=arch, tokenizer=tokenizer_dir)
    return cfg


def checkpoint_config(root, model_type: str, **fields) -> str:
    """A model directory holding only ``config.json`` (all the config check reads) of a tiny ``model_type``, with
    ``fields`` written as a released config.json holds them."""
    path = os.path.join(str(root), model_type)
    tiny_config(model_type).save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    for key in fields:
        config.pop(RELEASED_KEYS.get(key, key), None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, **fields}, f)
    return path


# --- class 1: what the model's config contributes to the loss or the routing ---


def test_a_negative_router_loss_coefficient_in_config_json_is_refused(cfg, tmp_path):
    """The case: Qwen3-MoE's config.json with router_aux_loss_coef -0.5 trained cross entropy minus half the router
    loss without a word."""
    path = checkpoint_config(tmp_path, "qwen3_moe", router_aux_loss_coef=-0.5, output_router_logits=True)
    cfg.model_name_or_path = path
    assert (
        f"{path}/config.json: router_aux_loss_coef -0.5 would subtract 0.5 x the router's load-balancing loss from "
        "the cross entropy, rewarding experts out of balance: set router_aux_loss_coef >= 0 (0.001 in Qwen3-MoE, "
        "0.02 in Mixtral) there"
    ) in problems_of(cfg)


MODEL_VALUES = [
    ("qwen3_moe", dict(router_aux_loss_coef=NAN), "router_aux_loss_coef nan is not a finite number"),
    ("qwen3_moe", dict(num_experts_per_tok=0), "num_experts_per_tok 0 routes each token to no expert"),
    ("qwen3_moe", dict(num_experts_per_tok=5), "num_experts_per_tok 5 is more than the 4 experts"),
    ("qwen3_moe", dict(num_experts=-1), "num_experts -1 is out of range"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step 0 is out of range"),
    ("qwen3_moe", dict(mlp_only_layers=[1, 7]), "mlp_only_layers [1, 7] names layers the model does not have"),
    ("mixtral", dict(router_aux_loss_coef=INF), "router_aux_loss_coef inf is not a finite number"),
    ("mixtral", dict(router_jitter_noise=-0.1), "router_jitter_noise -0.1 is not a noise scale"),
    ("mixtral", dict(router_jitter_noise=1.0), "router_jitter_noise 1.0 is not a noise scale"),
    ("mixtral", dict(num_local_experts=0), "num_local_experts 0 is out of range"),
    ("llama4_text", dict(moe_layers=[1, 9]), "moe_layers [1, 9] names layers the model does not have"),
    ("llama4_text", dict(num_experts_per_tok=0), "num_experts_per_tok 0 routes each token to no expert"),
    ("llama4_text", dict(floor_scale=0), "floor_scale 0 is out of range (the attention temperature divides"),
    ("llama4_text", dict(attention_chunk_size=0), "attention_chunk_size 0 is out of range"),
    ("llama", dict(rms_norm_eps=0.0), "rms_norm_eps 0.0 is not a positive number"),
    ("qwen3", dict(rms_norm_eps=NAN), "rms_norm_eps nan is not a positive number"),
    ("llama", dict(rope_theta=-1.0), "rope_theta -1.0 is out of range"),
    (
        "llama",
        dict(rope_scaling={"rope_type": "linear", "factor": 0.0, "rope_theta": 10000.0}),
        "rope scaling factor 0.0 (rope_type linear) is out of range",
    ),
    ("qwen2", dict(attention_dropout=1.5), "attention_dropout 1.5 is out of range"),
    ("mistral", dict(sliding_window=0), "sliding_window 0 lets a token attend to nothing"),
    # names transformers looks up when it builds the model (a KeyError / AttributeError from inside the build)
    ("llama", dict(hidden_act="gelu_foo"), "hidden_act 'gelu_foo' is not an activation transformers knows"),
    ("qwen3_moe", dict(hidden_act="foo"), "hidden_act 'foo' is not an activation transformers knows"),
    ("llama", dict(dtype="float8"), "dtype 'float8' is not a torch floating dtype"),
    ("mixtral", dict(dtype="int8"), "dtype 'int8' is not a torch floating dtype"),
    # token ids outside the vocabulary (pad_token_id: the embedding's padding row, an AssertionError in the build)
    ("llama", dict(pad_token_id=1000), "pad_token_id 1000 is outside the vocabulary (vocab_size 512)"),
    # LlamaConfig's validator refuses it with its own text; the house's words instead
    ("llama", dict(initializer_range=NAN), "initializer_range nan is not a finite number"),
    ("mixtral", dict(initializer_range=NAN), "initializer_range nan is not a finite number"),
]


@pytest.mark.parametrize("model_type, fields, message", MODEL_VALUES, ids=lambda x: None)
def test_meaningless_values_of_the_models_config_are_refused_naming_file_and_key(
    tmp_path, tokenizer_dir, model_type, fields, message
):
    """The other values of a family's config that change its loss, routing or attention: in config.json (the file
    named) and in model.architecture (the override named)."""
    path = checkpoint_config(tmp_path, model_type, **fields)
    config, problems = resolve_model(TrainConfig(model_name_or_path=path))
    assert config is None and len(problems) == 1, problems
    assert problems[0].startswith(f"{path}/config.json: {message}") and problems[0].endswith(" there"), problems[0]
    key = message.split()[0] if message.split()[0] != "rope" else "rope_scaling.factor"
    cfg = scratch(TrainConfig(), tokenizer_dir, model_type, **fields)
    config, problems = resolve_model(cfg)
    assert config is None and len(problems) == 1, problems
    assert problems[0].startswith(f"model.architecture (model=tiny-{model_type}): {message}"), problems[0]
    assert f"set model.architecture.{key} " in problems[0]


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "llama4_text"])
def test_the_families_own_configs_pass(tmp_path, model_type):
    assert resolve_model(TrainConfig(model_name_or_path=checkpoint_config(tmp_path, model_type)))[1] == []


def test_names_and_token_ids_transformers_takes_pass(tmp_path):
    path = checkpoint_config(
        tmp_path, "llama", hidden_act="gelu_pytorch_tanh", dtype="bfloat16", pad_token_id=0, eos_token_id=[2, 511]
    )
    config, problems = resolve_model(TrainConfig(model_name_or_path=path))
    assert problems == [] and config.eos_token_id == [2, 511]


@pytest.mark.parametrize(
    "fields, line",
    [
        (dict(bos_token_id=-5), "bos_token_id -5 is outside the vocabulary (vocab_size 512): set bos_token_id to"),
        (dict(eos_token_id=[2, 100000]), "eos_token_id [2, 100000] is outside the vocabulary (vocab_size 512): set"),
    ],
    ids=lambda x: None,
)
def test_bos_and_eos_of_a_config_json_are_in_its_vocabulary(tmp_path, tokenizer_dir, fields, line):
    """In a config.json; model.architecture's are left alone (a conf/model's stay set where its vocab_size is lowered
    to the tokenizer's)."""
    path = checkpoint_config(tmp_path, "qwen3", **fields)
    config, problems = resolve_model(TrainConfig(model_name_or_path=path))
    assert config is None and len(problems) == 1 and problems[0].startswith(f"{path}/config.json: {line}"), problems
    assert resolve_model(scratch(TrainConfig(), tokenizer_dir, "qwen3", **fields))[1] == []


def test_a_rope_type_without_the_keys_it_needs_is_one_line(tmp_path, tokenizer_dir):
    """The case: rope_parameters {"rope_type": "llama3", "rope_theta": 10000, "factor": 8} was transformers'
    KeyError "Missing required keys in `rope_parameters`" from inside the config's build."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    path = checkpoint_config(tmp_path, "llama", rope_parameters=rope)
    config, problems = resolve_model(TrainConfig(model_name_or_path=path))
    assert config is None and problems == [
        f"{path}/config.json: rope_parameters (rope_type 'llama3') lacks high_freq_factor, low_freq_factor, which "
        f"transformers {transformers.__version__} needs for that rope type: add them to rope_parameters there, or set "
        "rope_type default (no scaling)"
    ], problems
    # with another problem beside it: both lines
    config, problems = resolve_model(scratch(TrainConfig(), tokenizer_dir, rope_parameters=rope, hidden_size=-64))
    assert config is None and len(problems) == 2, problems
    assert problems[0].startswith("model.architecture (model=tiny-llama): hidden_size -64 ")
    assert "rope_parameters (rope_type 'llama3') lacks high_freq_factor, low_freq_factor" in problems[1]
    assert "add them to model.architecture.rope_parameters" in problems[1]


def both_problems(tmp_path, tokenizer_dir, model_type: str, **fields) -> tuple[str, list[str], list[str]]:
    """(the config.json path, its problems, model.architecture's) of ``fields`` in a tiny ``model_type``."""
    path = checkpoint_config(tmp_path, model_type, **fields)
    from_file = resolve_model(TrainConfig(model_name_or_path=path))[1]
    from_arch = resolve_model(scratch(TrainConfig(), tokenizer_dir, model_type, **fields))[1]
    return f"{path}/config.json", from_file, from_arch


@pytest.mark.parametrize(
    "model_type, key, value",
    [("qwen3_moe", "router_aux_loss_coef", 0), ("mixtral", "router_aux_loss_coef", 0), ("llama", "rms_norm_eps", 1)],
)
def test_a_whole_number_where_the_config_declares_a_float_is_that_float(
    tmp_path, tokenizer_dir, model_type, key, value
):
    """The case: ``"router_aux_loss_coef": 0`` (the router loss off) was transformers' StrictDataclass traceback
    "expected float, got int", naming no file."""
    path = checkpoint_config(tmp_path, model_type, **{key: value})
    config, problems = resolve_model(TrainConfig(model_name_or_path=path))
    assert problems == [] and getattr(config, key) == value and isinstance(getattr(config, key), float)
    config, problems = resolve_model(scratch(TrainConfig(), tokenizer_dir, model_type, **{key: value}))
    assert problems == [] and isinstance(getattr(config, key), float)


WRONG_TYPES = [
    (
        "qwen3_moe",
        dict(router_aux_loss_coef="0.01"),
        ["router_aux_loss_coef '0.01' is not a number: set {k} to a number"],
    ),
    ("llama", dict(hidden_size="abc"), ["hidden_size 'abc' is not an integer: set {k} to an integer"]),
    ("qwen3_moe", dict(norm_topk_prob="yes"), ["norm_topk_prob 'yes' is not true or false: set {k} to true or false"]),
    (  # LlamaConfig's own range check, said in the house's words (not the validator's text)
        "llama",
        dict(initializer_range=-1.0),
        [
            "initializer_range -1.0 is not a standard deviation (a model from scratch draws its weights from N(0, "
            "it)): set {k} in [0, 1] (0.02 in most families)"
        ],
    ),
    (  # every problem of the config at once: the type, and the value rules on the keys that have a type
        "mixtral",
        dict(num_experts_per_tok=1.5, router_jitter_noise=5, initializer_range=-1.0),
        [
            "num_experts_per_tok 1.5 is not an integer: set {k} to an integer",
            "initializer_range -1.0 is not a standard deviation",
            "router_jitter_noise 5.0 is not a noise scale",
        ],
    ),
]


@pytest.mark.parametrize("model_type, fields, messages", WRONG_TYPES, ids=lambda x: None)
def test_a_value_of_a_type_the_config_does_not_take_is_one_line_naming_file_and_key(
    tmp_path, tokenizer_dir, model_type, fields, messages
):
    """Any other value transformers' strict config classes refuse: a problem line with the others, no traceback."""
    path, from_file, from_arch = both_problems(tmp_path, tokenizer_dir, model_type, **fields)
    assert len(from_file) == len(messages) and len(from_arch) == len(messages), (from_file, from_arch)
    for message, line, override in zip(messages, from_file, from_arch):
        key = message.split()[0]
        assert line.startswith(f"{path}: " + message.format(k=key)), line
        assert override.startswith(f"model.architecture (model=tiny-{model_type}): ") and (
            message.format(k=f"model.architecture.{key}") in override
        ), override


SIZES = [
    ("llama", dict(hidden_size=-64), ["hidden_size -64 is not a positive whole number"]),
    ("llama", dict(num_hidden_layers=0), ["num_hidden_layers 0 is not a positive whole number"]),
    ("qwen3_moe", dict(moe_intermediate_size=0, vocab_size=0), ["vocab_size 0 is", "moe_intermediate_size 0 is"]),
    ("qwen3", dict(head_dim=0), ["head_dim 0 is not a positive whole number"]),
    (
        "llama",
        dict(num_key_value_heads=3),
        [
            "num_attention_heads 4 is not a multiple of num_key_value_heads 3 (each key/value head serves the same "
            "number of query heads): set {p}num_key_value_heads to a divisor of 4 (1, 2 or 4) or "
            "{p}num_attention_heads to a multiple of 3"
        ],
    ),
    (
        "qwen2",  # no head_dim: each head takes hidden_size / num_attention_heads
        dict(num_attention_heads=3, num_key_value_heads=1),
        [
            "hidden_size 64 is not a multiple of num_attention_heads 3 (each head takes hidden_size / "
            "num_attention_heads dimensions): set {p}num_attention_heads to a divisor of 64 (e.g. 4)"
        ],
    ),
]


@pytest.mark.parametrize("model_type, fields, messages", SIZES, ids=lambda x: None)
def test_sizes_and_heads_that_build_no_model_are_refused(tmp_path, tokenizer_dir, model_type, fields, messages):
    """The cases: a negative hidden_size was a "negative dimension" traceback, 3 heads of a 64-wide model
    transformers' class validation traceback, 3 key/value heads of 4 query heads passed the preflight (and failed in
    the first forward), 0 layers was told to "set num_stages <= 0"."""
    path, from_file, from_arch = both_problems(tmp_path, tokenizer_dir, model_type, **fields)
    assert len(from_file) == len(messages) and len(from_arch) == len(messages), (from_file, from_arch)
    for message, line, override in zip(messages, from_file, from_arch):
        assert line.startswith(f"{path}: " + message.format(p="")), line
        assert override.startswith(f"model.architecture (model=tiny-{model_type}): "), override
        assert message.format(p="model.architecture.") in override, override


def test_zero_layers_gets_no_num_stages_hint(cfg, tokenizer_dir):
    from parallel.layout import Layout, layout_problems

    problems = problems_of(scratch(cfg, tokenizer_dir, num_hidden_layers=0))
    assert any("num_hidden_layers 0 is not a positive whole number" in line for line in problems), problems
    assert not any("num_stages" in line for line in problems), problems
    assert not any("num_stages" in line for line in layout_problems(Layout(stages=2, dp=1), 2, "parameters", 0))


def test_heads_need_not_divide_the_width_where_head_dim_is_set(tmp_path, tokenizer_dir):
    """Qwen3 (head_dim given) takes 3 heads of 16 in a 64-wide model; Llama's own config class refuses it."""
    assert both_problems(tmp_path, tokenizer_dir, "qwen3", num_attention_heads=3, num_key_value_heads=1)[1:] == ([], [])
    path, from_file, _ = both_problems(tmp_path, tokenizer_dir, "llama", head_dim=16, num_attention_heads=3)
    assert len(from_file) == 2 and "hidden_size 64 is not a multiple of num_attention_heads 3" in from_file[1]


def test_a_rope_value_set_twice_differently_is_refused_naming_the_one_transformers_uses(tmp_path, tokenizer_dir):
    """The case: a llama config.json keeping rope_parameters.rope_theta 10000.0 and a top-level rope_theta of
    -10000.0 (or 500000) passed; transformers 5 uses rope_parameters' and drops the top-level key silently."""
    import transformers

    path = os.path.join(str(tmp_path), "llama")
    tiny_config("llama").save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    for top in (-10000.0, 500000.0):
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**config, "rope_theta": top}, f)
        assert resolve_model(TrainConfig(model_name_or_path=path))[1] == [
            f"{path}/config.json: rope_theta {top!r} and rope_parameters.rope_theta 10000.0 disagree: transformers "
            f"{transformers.__version__} uses rope_parameters.rope_theta (10000.0) and ignores the top-level "
            "rope_theta; set the one you mean in rope_parameters.rope_theta and remove rope_theta"
        ]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "rope_theta": 10000}, f)  # the same value twice: what transformers 4 wrote
    assert resolve_model(TrainConfig(model_name_or_path=path))[1] == []
    scaling = {"rope_type": "linear", "factor": 2.0}  # rope_scaling replaces rope_parameters, theta and all
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(
            {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": scaling}, f
        )
    (line,) = resolve_model(TrainConfig(model_name_or_path=path))[1]
    assert (
        "builds the RoPE from rope_scaling and ignores rope_parameters' rope_theta 500000.0 (it takes 10000.0)" in line
    )
    with open(os.path.join(path, "config.json"), "w") as f:  # rope_scaling added, nothing of rope_parameters lost
        json.dump({**config, "rope_scaling": scaling}, f)
    assert resolve_model(TrainConfig(model_name_or_path=path))[1] == []
    rope = {"rope_type": "default", "rope_theta": 1e6}
    (line,) = resolve_model(scratch(TrainConfig(), tokenizer_dir, "llama", rope_theta=5e5, rope_parameters=rope))[1]
    assert line.startswith("model.architecture (model=tiny-llama): rope_theta 500000.0 and rope_parameters.rope_theta")
    assert line.endswith("model.architecture.rope_parameters.rope_theta and remove model.architecture.rope_theta")


def test_the_start_up_lines_say_which_router_loss_is_in_use(capsys):
    on = tiny_config("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5, mlp_only_layers=[0])
    assert moe_line(on, "CKPT/config.json") == (
        "moe: 4 experts per MoE layer, top 2, 3 of 4 layers routed | router loss on (output_router_logits true in "
        "CKPT/config.json): loss = cross entropy + router_aux_loss_coef 0.5 x the load-balancing loss"
    )
    off = tiny_config("mixtral")
    assert moe_line(off, "model.architecture").endswith(
        "| router loss off (output_router_logits false in model.architecture): loss = cross entropy; "
        "router_aux_loss_coef 0.001 unused"
    )
    assert moe_line(tiny_config("llama4_text", output_router_logits=True), "x").endswith(
        "| no router loss (Llama4ForCausalLM adds none, whatever output_router_logits says)"
    )
    assert moe_line(tiny_config("llama"), "x") == ""
    resolved = SimpleNamespace(cfg=TrainConfig(model_name_or_path="CKPT"), model_config=on, lora=False)
    model_lines(resolved)
    assert (
        "[train] moe: 4 experts per MoE layer, top 2, 3 of 4 layers routed | router loss on" in capsys.readouterr().out
    )


def test_expert_parallel_with_fp16_is_refused(cfg, tokenizer_dir):
    """docs/moe.md: the split experts run in fp32 or bf16."""
    cfg = scratch(cfg, tokenizer_dir, "qwen3_moe")
    cfg.num_stages, cfg.expert_parallel, cfg.precision = 1, 2, "fp16"
    assert (
        "expert_parallel 2 with precision=fp16: not supported yet (the experts' gradient reduction, their share of "
        "the gradient norm and their optimizer groups are built and tested in fp32 and bf16 only, not with fp16's "
        "loss scaling); set precision=bf16 (or fp32), or expert_parallel=1"
    ) in problems_of(cfg, 2)
    cfg.precision = "bf16"
    assert resolve(cfg, 2).layout.ep == 2


def test_a_vocabulary_far_larger_than_the_tokenizer_is_refused_from_scratch(cfg, tokenizer_dir, tmp_path):
    """The case: a from-scratch architecture with 200 x its tokenizer's tokens passed the preflight. Padding up to a
    multiple of 256 (or a quarter more) passes; fewer rows than tokens was refused when the data was read, now before
    start too. With data=tokens the ids are the data's own (a benchmark's random ids over a vocabulary of 8192)."""
    data = tmp_path / "text.jsonl"
    data.write_text(json.dumps({"text": "a b c"}) + "\n")
    overrides = ["model=tiny", f"model.tokenizer={tokenizer_dir}", "data=text", f"data.train_file={data}"]
    overrides += [f"output_dir={tmp_path / 'out'}", "min_free_disk_gb=0", "model.architecture.vocab_size=102400"]
    with pytest.raises(ValueError) as err:
        check(1, overrides)
    assert (
        "model.architecture (model=tiny): vocab_size 102400 is 200 x the 512 tokens of the tokenizer in "
        f"{tokenizer_dir}: the rows no token reads are trained towards zero probability in every softmax and held in "
        "memory; set model.architecture.vocab_size=512, or padded up to 640 (a multiple of 64 to 256 above it), or "
        "give the model's own tokenizer in model.tokenizer"
    ) in str(err.value)
    assert resolve(scratch(cfg, tokenizer_dir, vocab_size=102400), 4)  # data=tokens
    cfg.data = DataConfig(format="text", train_file=str(data))
    for vocab in (512, 576, 640):
        assert resolve(scratch(cfg, tokenizer_dir, vocab_size=vocab), 4)
    (line,) = problems_of(scratch(cfg, tokenizer_dir, vocab_size=500))
    assert line == (
        f"model.architecture (model=tiny-llama): vocab_size 500 is less than the 512 tokens of the tokenizer in "
        f"{tokenizer_dir}: set model.architecture.vocab_size=512 (or up to 640)"
    )
    (line,) = problems_of(scratch(cfg, tokenizer_dir, vocab_size=641))
    assert line.startswith("model.architecture (model=tiny-llama): vocab_size 641 is 1.25 x the 512 tokens")


# --- class 3: every float key finite and plausible ---


@pytest.mark.parametrize(
    "value, message",
    [
        (INF, "mfu_peak_tflops inf is not a finite number: set mfu_peak_tflops to 0 or in [0.01, 100000]"),
        (NAN, "mfu_peak_tflops nan is not a finite number: set mfu_peak_tflops to 0 or in [0.01, 100000]"),
        (-INF, "mfu_peak_tflops -inf is not a finite number: set mfu_peak_tflops to 0 or in [0.01, 100000]"),
        (
            1e-12,
            "mfu_peak_tflops 1e-12 is not one device's peak TFLOP/s: set it in [0.01, 100000] (989 for an H100's or "
            "H200's bf16), or 0 for the known-GPU table",
        ),
        (-1.0, "mfu_peak_tflops -1 is not one device's peak TFLOP/s"),
        (1e6, "mfu_peak_tflops 1e+06 is not one device's peak TFLOP/s"),
    ],
)
def test_mfu_peak_tflops_is_a_finite_plausible_peak(cfg, value, message):
    """The case: inf logged MFU 0.0% each step, nan dropped it silently, 1e-12 printed 21 billion percent."""
    cfg.mfu_peak_tflops = value
    (line,) = problems_of(cfg)
    assert line.startswith(message), line


def test_mfu_peak_tflops_zero_or_a_device_peak_is_taken(cfg):
    for value in (0.0, MFU_PEAK_TFLOPS[0], 989.0, MFU_PEAK_TFLOPS[1]):
        cfg.mfu_peak_tflops = value
        assert resolve(cfg, 4)


def with_every_float(cfg: TrainConfig, value: float) -> TrainConfig:
    """``cfg`` with a mixture of one source and one eval source, and every float key (those included) ``value``."""
    data = cfg.data.train_file
    cfg.data = DataConfig(sources=[SourceConfig(path=data)], eval_sources=[SourceConfig(path=data)])
    for _, owner, name in float_leaves(cfg):
        if isinstance(name, int):
            owner[name] = value
        else:
            setattr(owner, name, value)
    return cfg


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_every_float_key_that_is_not_finite_is_refused_once(cfg, value):
    """One generic check of every float key, nested ones and list items included: each named once with its range
    (NaN compares false with everything, so a rule's ``x < 0`` let it through), all of them together."""
    cfg = with_every_float(cfg, value)
    keys = [key for key, _, _ in float_leaves(cfg)]
    assert {range_key(k) for k in keys} == set(FLOAT_RANGES)  # the walk finds every key of the table
    lines = problems_of(cfg)
    for key in keys:
        named = [line for line in lines if line.startswith(f"{key} ")]
        assert named == [f"{key} {value} is not a finite number: set {key} {FLOAT_RANGES[range_key(key)]}"], named


def test_every_float_key_has_its_range_in_the_configuration_reference():
    """Each float key of training/configuration/schema.py has an entry in FLOAT_RANGES, and its line of
    docs/configuration.md (rendered from the key's comment) states that range."""
    keys = {range_key(key) for key, _, _ in float_leaves(with_every_float(TrainConfig(), 1.0))}
    assert keys == set(FLOAT_RANGES)
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)` \|[^|]*\|[^|]*\| (.*) \|$", render(), re.M)}
    for key, text in FLOAT_RANGES.items():
        row = rows.get(key) or rows[key.rsplit(".", 1)[0]]  # a source's weight: on data.sources' line
        assert text in row, (key, text, row)
    low, high = MFU_PEAK_TFLOPS
    assert FLOAT_RANGES["mfu_peak_tflops"] == f"to 0 or in [{low:g}, {high:g}]"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(optim=OptimConfig(lr=3.0)), "optim.lr 3 > 1 is no AdamW learning rate: set it in (0, 1]"),
        (dict(optim=OptimConfig(eps=1e8)), "optim.eps 1e+08 >= 1 swamps every update: set it in (0, 1)"),
        (
            dict(optim=OptimConfig(eps=0.0)),
            "optim.eps 0 <= 0: AdamW divides each update by sqrt(v) + eps, which is 0 (a NaN update) wherever a "
            "weight's gradients have been 0; set it in (0, 1)",
        ),
        (
            dict(optim=OptimConfig(lr=0.1, weight_decay=20.0)),
            "optim.weight_decay 20 x optim.lr 0.1 >= 1: decoupled weight decay multiplies each weight by 1 - lr x "
            "weight_decay every step, which zeroes or flips it; set optim.weight_decay < 10",
        ),
        (
            dict(peft=PeftConfig(method="lora", alpha=-16.0)),
            "peft.alpha -16 < 0 scales every adapter's update by a negative alpha / r: set peft.alpha > 0",
        ),
        (dict(num_epochs=-1.0), "num_epochs -1.0 is out of range: set num_epochs >= 0"),
    ],
    ids=lambda x: None,
)
def test_implausible_finite_values_are_refused(cfg, tiny_ckpt, change, message):
    for key, value in change.items():
        setattr(cfg, key, value)
    if cfg.peft.method == "lora":
        cfg.model_name_or_path = tiny_ckpt  # LoRA adapts a base in layer files
    assert any(line.startswith(message) for line in problems_of(cfg)), problems_of(cfg)


@pytest.mark.parametrize(
    "change, line",
    [
        (dict(seed=-1), "seed -1 is out of range: set seed in [0, 2**63 - 1] (e.g. 42)"),
        (dict(seed=10**20), "seed 100000000000000000000 is out of range: set seed in [0, 2**63 - 1] (e.g. 42)"),
        (
            dict(optim=OptimConfig(warmup_steps=-1)),
            "optim.warmup_steps -1 is out of range: set optim.warmup_steps >= 0 (0 = no warm-up)",
        ),
    ],
    ids=lambda x: None,
)
def test_int_keys_out_of_range_are_refused(cfg, change, line):
    """The cases: seed -1 broke numpy's default_rng with data.sources, seed 1e20 overflowed torch's manual_seed,
    optim.warmup_steps -1 was taken without a word."""
    for key, value in change.items():
        setattr(cfg, key, value)
    assert line in problems_of(cfg)


def test_the_largest_seed_mixes_sources():
    """seed 2**63 - 1 (the top of its range) orders a data.sources mixture: its per-source seeds wrap to torch's."""
    from data.mixture import MixtureDataset

    mixture = MixtureDataset([list(range(3)), list(range(2))], [0.6, 0.4], ["a", "b"])
    assert sorted(mixture.epoch_order(1, 2**63 - 1, shuffle=True).tolist()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "optim, line",
    [
        (OptimConfig(lr=-1e-3), "optim.lr -0.001 < 0 climbs the loss instead of descending it: set it in (0, 1]"),
        (
            OptimConfig(lr=3.0, min_lr=5.0, scheduler="cosine"),
            "optim.lr 3 > 1 is no AdamW learning rate: set it in (0, 1]",
        ),
        (OptimConfig(lr=0.0, min_lr=1e-5, scheduler="cosine"), "optim.lr 0.0 trains nothing: set optim.lr > 0"),
        (OptimConfig(lr=-1e-3, weight_decay=-0.1), "optim.lr -0.001 < 0 climbs the loss"),
    ],
    ids=lambda x: None,
)
def test_a_learning_rate_out_of_range_is_the_one_key_reported(cfg, optim, line):
    """optim.lr out of its range is said once, on its own line: optim.min_lr (left at its default, or set) and
    optim.weight_decay x lr are not measured against it as well."""
    cfg.optim = optim
    lines = [p for p in problems_of(cfg) if p.startswith("optim.")]
    assert any(p.startswith(line) for p in lines) and not any("optim.lr=" in p or "x optim.lr" in p for p in lines)
    assert len(lines) == 1 + (optim.weight_decay < 0), lines


@pytest.mark.parametrize("head", ["differs", "equal"])
def test_a_tied_config_beside_a_head_of_its_own_is_refused_where_they_differ(tmp_path, tiny_tied_hf, head):
    """tie_word_embeddings true in config.json while the file holds an lm_head.weight of its own: transformers (and the
    converter, and train.py's start from the directory) would use the embedding as the head and drop the file's."""
    model = tmp_path / "tied"
    shutil.copytree(tiny_tied_hf, model)
    weights = load_file(str(model / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embed + 1 if head == "differs" else embed.clone()
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    config = load_config(str(model))
    problems = hf_input_problems(config, HFTensorSource(str(model)))
    if head == "equal":
        assert problems == []
        return
    assert problems == [
        f"config.json sets tie_word_embeddings true, but {model / 'model.safetensors'} holds its own 'lm_head.weight', "
        "which differs from 'model.embed_tokens.weight': the embedding would be the LM head and the file's head "
        "dropped; set tie_word_embeddings false there to train the file's head, or remove lm_head.weight from the file"
    ]
