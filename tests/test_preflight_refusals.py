"""The preflight and scripts/estimate_memory.py refuse what train.py refuses before start, in train.py's words.

The preflight (training/configuration/preflight.py): a prepared directory made for another run, W&B online without
credentials, an invalid choice with the list of valid values, a model group entry taken for a checkpoint, a key
TrainConfig lacks. scripts/estimate_memory.py refuses LoRA with tensor or sequence parallelism through train.py's own
rule functions, and names its own flags. In-process, except one e2e run of train.py itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from data.prepare import prepare
from tests.support import REPO
from tests.support.scripts import load_entry_point
from training.configuration.overrides import override_key_problems
from training.configuration.preflight import check, composed
from training.configuration.schema import ConfigError
from training.configuration.validate import resolve
from training.observation.tracking import wandb_problems

PREPARE_HINT = (
    "Prepare it again with this run's settings (python scripts/prepare_data.py with the same overrides), or set "
    "these to the prepared ones"
)


def base(tiny_hf, tmp_path, data: str) -> list[str]:
    """Overrides train.py accepts on 1 rank: the tiny model, pipe 1 on ZeRO-0."""
    return [
        f"model_name_or_path={tiny_hf}",
        f"output_dir={tmp_path / 'out'}",
        f"data.train_file={data}",
        "ds=zero0",
        "min_free_disk_gb=0",
    ]


@pytest.fixture()
def tokens(tmp_path) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [1, 5 + i, 6, 2]}) + "\n" for i in range(8)))
    return str(path)


def refusal(world_size: int, overrides: list[str]) -> str:
    """The preflight's message (what scripts/preflight.py prints after ``train.py: error: ``)."""
    with pytest.raises(ValueError) as err:
        check(world_size, overrides)
    return str(err.value)


def test_a_prepared_directory_of_other_settings_is_refused_before_start(tiny_hf, tmp_path, tokens):
    """train.py refused it only when the ranks opened the data (data.cache.check_prepared); now resolve asks the same
    rule (data.cache.prepared_mismatch), so the preflight refuses it too."""
    from data.tokenize_settings import data_settings
    from models.families import load_config

    made = str(tmp_path / "prepared")
    cfg = composed(base(tiny_hf, tmp_path, tokens) + ["data.max_seq_length=64"])
    prepare(tokens, data_settings(cfg, load_config(tiny_hf)), tiny_hf, made, workers=1, log=lambda line: None)
    check(1, base(tiny_hf, tmp_path, made) + ["data.max_seq_length=64"])  # its own settings: accepted
    message = refusal(1, base(tiny_hf, tmp_path, made) + ["data.max_seq_length=128"])
    assert message == (
        "invalid configuration:\n"
        f"  data.train_file {made} was prepared for another run: data.max_seq_length 64 there, 128 here. {PREPARE_HINT}"
    )
    with pytest.raises(ConfigError) as err:  # train.py: the same line before any process group
        resolve(composed(base(tiny_hf, tmp_path, made) + ["data.max_seq_length=128"]), world_size=1)
    assert str(err.value) == message


@pytest.fixture()
def no_wandb_credentials(tmp_path, monkeypatch):
    """A user without W&B credentials: empty HOME and W&B config dir, no WANDB_* variables; no network at all."""
    for key in [k for k in os.environ if k.startswith("WANDB_")] + ["NETRC", "RANK"]:
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb-config"))
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.wandb.ai")
    monkeypatch.chdir(tmp_path)  # no ./wandb/settings

    def no_network(*args, **kwargs):
        raise AssertionError("W&B was contacted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return tmp_path / "home"


def test_wandb_online_without_credentials_is_refused_with_the_fix(tiny_hf, tmp_path, tokens, no_wandb_credentials):
    overrides = base(tiny_hf, tmp_path, tokens) + ["monitor.wandb=true"]
    assert refusal(1, overrides) == (
        "invalid configuration:\n"
        "  monitor.wandb=true logs to W&B online (https://api.wandb.ai), and no API key is set here: run `wandb "
        "login` or set WANDB_API_KEY, or set WANDB_MODE=offline to write the run under "
        f"{tmp_path / 'out'}/wandb for `wandb sync` later"
    )


@pytest.mark.parametrize("way", ["WANDB_MODE=offline", "WANDB_MODE=disabled", "WANDB_API_KEY", "netrc"])
def test_wandb_with_credentials_or_offline_is_accepted(no_wandb_credentials, monkeypatch, way):
    if way == "netrc":  # what `wandb login` writes
        netrc = no_wandb_credentials / ".netrc"
        netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
        netrc.chmod(0o600)
    elif way == "WANDB_API_KEY":
        monkeypatch.setenv(way, "k" * 40)
    else:
        monkeypatch.setenv(*way.split("="))
    assert wandb_problems("out") == []  # the rule resolve asks on the rank that logs


def test_wandb_is_checked_on_the_rank_that_logs_only(tiny_hf, tmp_path, tokens, no_wandb_credentials, monkeypatch):
    """Global rank 0 alone logs to W&B (train.py's tracking_run); another node may hold no credentials."""
    monkeypatch.setenv("RANK", "1")
    assert check(1, base(tiny_hf, tmp_path, tokens) + ["monitor.wandb=true"])


@pytest.mark.parametrize(
    "override, valid",
    [("dpo.loss_type=hinge", "[sigmoid, ipo]"), ("data.format=chat", "[tokens, text, sft, dpo, grpo]")],
)
def test_an_invalid_choice_shows_every_valid_value(override, valid):
    """Hydra's first line alone ("Error merging override ...") was all the preflight said; train.py prints its cause."""
    key, _, value = override.partition("=")
    assert refusal(1, [override]) == (
        f"Error merging override {override}\nInvalid value '{value}', expected one of {valid}\n    full_key: {key}"
    )


def test_a_sources_format_shows_every_valid_value():
    override = "data.sources=[{path:a.jsonl,format:chat}]"
    message = refusal(1, [override])
    assert message == "invalid configuration:\n  " + "\n  ".join(override_key_problems([override]))  # train.py's
    assert "tokens, text, sft, dpo, grpo" in message


def test_a_model_group_name_given_as_model_name_or_path_suggests_model(tmp_path, tokens):
    message = refusal(16, ["model_name_or_path=llama3-70b", f"data.train_file={tokens}", "min_free_disk_gb=0"])
    assert message.splitlines()[1] == (
        "  model_name_or_path llama3-70b is not a directory, and llama3-70b is conf/model/llama3-70b.yaml: did you "
        "mean model=llama3-70b? (an architecture from scratch, with model.tokenizer=DIR; to fine-tune, "
        "model_name_or_path is a checkpoint directory made by convert2ckpt.py)"
    )
    assert "model_name_or_path=llama3-70b" not in open(os.path.join(REPO, "README.md")).read()  # its own example


# Found beside the cases: the preflight and scripts/prepare_data.py composed the overrides without train.py's
# key checks, so a `+key` typo passed silently (OmegaConf.to_object drops it: prepare_data.py tokenized to 512
# tokens, not 4096) and a plain typo got Hydra's advice to append it with `+`.
@pytest.mark.parametrize(
    "override, line",
    [
        ("+data.max_seq_len=4096", "unknown key data.max_seq_len: did you mean data.max_seq_length?"),
        ("data.max_seq_lenght=4096", "unknown key data.max_seq_lenght: did you mean data.max_seq_length?"),
    ],
)
def test_a_mistyped_key_is_refused_in_train_py_words(tiny_hf, tmp_path, tokens, capsys, override, line):
    assert refusal(1, base(tiny_hf, tmp_path, tokens) + [override]) == f"invalid configuration:\n  {line}"
    script = load_entry_point("scripts/prepare_data.py")
    argv = ["--output", str(tmp_path / "p"), f"model_name_or_path={tiny_hf}", f"data.train_file={tokens}", override]
    assert script.main(argv) == 1 and not os.path.exists(tmp_path / "p")
    assert capsys.readouterr().err == f"prepare_data.py: error: invalid configuration:\n  {line}\n"


def estimate(argv: list[str], capsys, monkeypatch) -> tuple[int, list[str], str]:
    """(exit status, stderr lines, stdout) of scripts/estimate_memory.py run in-process; a layout it accepts prints
    "planned" instead of its plan (the plan's formulas are tests/test_memory_plan.py's)."""
    script = load_entry_point("scripts/estimate_memory.py")
    monkeypatch.setattr(script, "report", lambda config, total, layout, method: print("planned", layout.describe()))
    try:
        script.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.err.strip().splitlines(), out.out


LORA = ["--model", "llama3-8b", "--stages", "2", "--lora-rank", "16"]


@pytest.mark.parametrize(
    "argv, rule, line",
    [
        (
            ["--tp", "2"],
            "parallel.tensor_parallel.TensorParallelPlan.problems",
            "--lora-rank with --tp 2 is not supported yet: PEFT's layers would wrap DeepSpeed's split linears; use "
            "--tp 1 (LoRA's frozen base rarely needs it)",
        ),
        (
            ["--sp", "2"],
            "parallel.sequence_parallel.SequenceParallelPlan.problems",
            "--lora-rank with --sp 2 is not supported yet (no parity test of the two together): use --sp 1",
        ),
        (
            ["--stages", "1", "--zero", "2"],
            "models.lora_rules.peft_problems",
            "--lora-rank runs on the pipeline engine: --stages 1 with --zero 2 uses DeepSpeed's data-parallel engine, "
            "which this version does not adapt; use --zero 0 or --zero 1 (the frozen base has no optimizer state to "
            "partition further)",
        ),
    ],
    ids=["tp", "sp", "one-stage-zero2"],
)
def test_estimate_memory_refuses_lora_as_train_py_does(argv, rule, line, capsys, monkeypatch):
    code, err, out = estimate(LORA + argv, capsys, monkeypatch)
    assert (code, err, out) == (1, [f"estimate_memory.py: error: {line}"], "")
    # The line is the rule function's that training.configuration.schema.resolve asks, not a copy: replaced, the script
    # says its.
    monkeypatch.setattr(rule, lambda *args: ["num_stages=3 stands in for the rule"])
    code, err, _ = estimate(LORA + argv, capsys, monkeypatch)
    assert (code, err) == (1, ["estimate_memory.py: error: --stages 3 stands in for the rule"])


def test_estimate_memory_names_its_own_flags(capsys, monkeypatch):
    code, err, _ = estimate(["--model", "llama3-8b", "--sp", "16", "--seq-len", "4097"], capsys, monkeypatch)
    assert (code, err) == (
        1,
        [
            "estimate_memory.py: error: --seq-len 4097 is not divisible by --sp 16: each rank keeps an equal slice; "
            "set --seq-len to a multiple of 16 (e.g. 4096)"
        ],
    )
    # Rows fed whole (there is no --pad-to-multiple-of): data.pad_to_multiple_of's default 8 is no refusal for --sp 16.
    code, err, out = estimate(["--model", "llama3-8b", "--sp", "16", "--seq-len", "4096"], capsys, monkeypatch)
    assert (code, err, out) == (
        0,
        [],
        "planned pipe 1 x sequence 16 x data 1, ZeRO-0, micro 1 x seq 4096, loss chunk 1024, bf16\n",
    )


@pytest.mark.e2e  # train.py in a subprocess
def test_train_py_refuses_wandb_without_credentials_with_its_error_line(tiny_hf, tmp_path, tokens):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k not in ("RANK", "NETRC")}
    (tmp_path / "home").mkdir()
    env.update(
        HOME=str(tmp_path / "home"), WANDB_CONFIG_DIR=str(tmp_path / "home"), WANDB_BASE_URL="https://api.wandb.ai"
    )
    env.update(OMP_NUM_THREADS="1", WORLD_SIZE="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "train.py"), *base(tiny_hf, tmp_path, tokens), "monitor.wandb=true"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "UsageError" not in proc.stderr
    assert "train.py: error: invalid configuration:\n  monitor.wandb=true logs to W&B online" in proc.stderr
