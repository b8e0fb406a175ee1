"""Every command in README.md and docs/*.md is run: here, by the demo, or by a named test.

Commands are the lines of ```bash blocks (backslash continuations joined, comments dropped) and the
``$ `` lines of output blocks; a command shown in several files (with the same output) is checked once.
Here:
- ``convert2ckpt.py`` commands run on the tiny model (paths replaced, flags kept);
- training commands (``deepspeed ... train.py``, ``sbatch .../train_slurm.sbatch``,
  ``.../launch_hostfile.sh``) have their overrides checked by the preflight (``training/configuration/preflight.py``,
  what ``scripts/preflight.py`` runs) for their world size: every key, value and cross-field rule, as
  train.py checks them before starting;
- ``preflight.py``, ``estimate_memory.py`` and ``train.py --cfg job`` run as written, and where the
  docs show their output, the output must match it line for line (the docs' figures).
Scripts the demo runs are covered by the demo; benchmark scripts by their smoke tests.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.support import REPO
from tests.support.ranks import child_env
from tests.support.scripts import run_script
from training.configuration.model_source import model_group_config

README = os.path.join(REPO, "README.md")
DOC_FILES = [README, *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]  # every file whose commands are checked
SELF_COVERED = {"scripts/demo.sh", "scripts/test.sh"}  # the demo itself; the suite itself (.ci/run)
PLACEHOLDER_VALUES = {"N": "4", "K": "2"}  # ranks and stages in the generic commands
CLUSTER_WORLD_SIZE = 16  # the SLURM and hostfile recipes: 2 nodes x 8 GPUs


def file_commands(path: str) -> list[tuple[str, list[str] | None]]:
    """(command, expected output lines or None) in one markdown file, in order."""
    with open(path) as f:
        text = f.read()
    out = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        lines = body.splitlines()
        if lang == "bash":
            joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
            for line in joined.splitlines():
                line = re.sub(r"(^|\s+)#.*$", "", line).strip()  # comments, whole-line or trailing
                if line:
                    out.append((line, None))
        elif lines and lines[0].startswith("$ "):
            out.append((lines[0][2:].strip(), [line for line in lines[1:] if line.strip()]))
    return out


def readme_commands() -> list[tuple[str, list[str] | None, str]]:
    """(command, expected output lines or None, file) over README.md then docs/*.md, each distinct
    command (with its expected output) once, where it first appears."""
    out, seen = [], set()
    for path in DOC_FILES:
        for command, expected in file_commands(path):
            key = (command, tuple(expected) if expected is not None else None)
            if key not in seen:
                seen.add(key)
                out.append((command, expected, os.path.relpath(path, REPO)))
    return out


def split_command(command: str) -> tuple[dict, list[str]]:
    """(leading VAR=value environment, argv) with README notation removed: [optional parts], `...`."""
    command = re.sub(r"(?<!=)\[[^\]]*\]", "", command)  # a list value (profile_steps=[2,3]) is no optional part
    words = [w for w in shlex.split(command) if w != "..."]
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def script_of(argv: list[str]) -> str:
    """The repo file a command runs (train.py, convert2ckpt.py, scripts/...)."""
    for word in argv:
        if word.endswith((".py", ".sh", ".sbatch")):
            return word
    raise AssertionError(f"documented command runs no repo script: {' '.join(argv)}")


@pytest.fixture(scope="module")
def stage(tmp_path_factory, tiny_hf, tokenizer_dir):
    """Stand-ins for the README's paths: a converted tiny checkpoint, config-only checkpoints of the
    real models (preflight reads config.json and the tokenizer files, never weights), a data file."""
    root = tmp_path_factory.mktemp("readme")
    ckpt = str(root / "ckpt")
    run_script(["convert2ckpt.py", "--input", tiny_hf, "--output", ckpt]).check_returncode()
    configs = {}
    for name in ("llama2-70b", "llama3-8b", "llama3-70b", "qwen3-30b-a3b"):
        path = str(root / name)
        model_group_config(name).save_pretrained(path)
        with open(os.path.join(path, "latest"), "w") as f:  # a converted checkpoint's (a Hugging Face directory's
            f.write("global_step0")  # weights would be checked)
        for tok in os.listdir(tokenizer_dir):
            with open(os.path.join(tokenizer_dir, tok), "rb") as src, open(os.path.join(path, tok), "wb") as dst:
                dst.write(src.read())
        configs[name.replace(".", "").replace("llama", "")] = path  # "2-70b", "3-8b", "3-70b", "qwen3-30b-a3b"
    data = str(root / "train.jsonl")
    with open(data, "w") as f:
        # one record every format reads (data=text, tokens, sft and dpo commands share this file)
        f.write(
            '{"text": "a document", "input_ids": [1, 5, 6, 2], "prompt": "a question", "response": "an answer", '
            '"chosen": " yes", "rejected": " no"}\n'
        )
    return dict(root=root, hf=tiny_hf, ckpt=ckpt, configs=configs, data=data, tokenizer=tokenizer_dir, n=0)


@pytest.fixture(scope="module")
def lora_run(run_a) -> str:
    """A LoRA run of 2 steps on run A's model (pipe 2, 2 ranks): what docs/lora.md's exports read."""
    from tests.support.ranks import run_deepspeed
    from tests.support.runs import loop_args

    root = run_a[0]
    out = root / "lora-readme"
    args = loop_args(root, out, max_steps=2, eval_steps=0, **{"peft.method": "lora", "data.eval_fraction": 0})
    proc = run_deepspeed(2, "train.py", args, str(root / "lora-readme.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return str(out)


def checkpoint_for(value: str, stage: dict) -> str:
    for key, path in stage["configs"].items():
        if key in value.lower():
            return path
    return stage["hf"] if value == "HF_DIR" else stage["ckpt"]  # train.py starts from either


def substitute_overrides(words: list[str], stage: dict) -> list[str]:
    """Paths in Hydra overrides -> stand-ins (a from-scratch vocabulary fitted to the stand-in tokenizer); free disk
    check off (no 1 TB here for a 70B checkpoint)."""
    out = []
    for word in words:
        key, _, value = word.partition("=")
        if key == "model_name_or_path":
            value = checkpoint_for(value, stage)
        elif key == "model.tokenizer":
            value = stage["tokenizer"]
            out.append("model.architecture.vocab_size=512")  # the stand-in tokenizer's tokens: an architecture's own
        elif key in ("data.train_file", "data.eval_file"):
            value = stage["data"]
        elif key == "peft.init_from":
            value = adapter_for(words, stage)
        elif key == "output_dir":
            stage["n"] += 1
            value = str(stage["root"] / f"run{stage['n']}")
        value = PLACEHOLDER_VALUES.get(value, value)
        out.append(f"{key}={value}")
    return out + ["min_free_disk_gb=0"]


def adapter_for(words: list[str], stage: dict) -> str:
    """A PEFT adapter directory with the command's own peft.* settings, made on the stand-in model."""
    from omegaconf import OmegaConf
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.lora import lora_config
    from training.configuration.schema import PeftConfig

    dotlist = [w[5:] for w in words if w.startswith("peft.") and not w.startswith("peft.init_from")]
    settings = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PeftConfig), OmegaConf.from_dotlist(dotlist)))
    stage["n"] += 1
    path = str(stage["root"] / f"adapter{stage['n']}")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(stage["hf"]))
    get_peft_model(model, lora_config(settings)).save_pretrained(path)
    return path


def run(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    if argv[0] == sys.executable:
        return run_script(argv[1:], env={**child_env(), **(env or {})}, timeout=300)
    return subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300
    )


def preflight(world_size: int, overrides: list[str], stage: dict) -> subprocess.CompletedProcess:
    """The preflight in this process (training/configuration/preflight.py's check(), which scripts/preflight.py runs;
    the CLI is run once in test_preflight_cli)."""
    from training.configuration.preflight import check

    argv = ["scripts/preflight.py", "--world-size", str(world_size), *substitute_overrides(overrides, stage)]
    try:
        return subprocess.CompletedProcess(argv, 0, "\n".join(check(world_size, argv[3:])), "")
    except ValueError as e:
        return subprocess.CompletedProcess(argv, 1, "", f"train.py: error: {e}")


def program_output(proc: subprocess.CompletedProcess) -> list[str]:
    """stdout without DeepSpeed's log lines ("[2026-... WARNING] ...")."""
    return [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith("[20")]


def check_command(command: str, expected: list[str] | None, stage: dict) -> str:
    """Run or check one README command; returns how it was covered."""
    env, argv = split_command(command)
    script = script_of(argv)
    args = argv[argv.index(script) + 1 :]
    if script in SELF_COVERED:
        return "self"
    if script == "train.py" and argv[0] == "deepspeed":
        ranks = argv[argv.index("--num_gpus") + 1] if "--num_gpus" in argv else "1"
        proc = preflight(int(PLACEHOLDER_VALUES.get(ranks, ranks)), args, stage)
    elif script in ("scripts/multinode/train_slurm.sbatch", "scripts/multinode/launch_hostfile.sh"):
        proc = preflight(CLUSTER_WORLD_SIZE, args, stage)
    elif script == "train.py":
        proc = run([sys.executable, "train.py", *args])
    elif script == "scripts/preflight.py":
        world = args[args.index("--world-size") + 1]
        proc = preflight(int(world), [a for a in args if a not in ("--world-size", world)], stage)
    elif script == "scripts/estimate_memory.py":
        proc = run([sys.executable, script, *args])
    elif script == "convert2ckpt.py":
        stage["n"] += 1
        flags = [a for a in args if a in ("--to-hf", "--reshard", "--merge")]
        rest = [a for a in args if a not in flags]
        opts = {rest[i]: rest[i + 1] for i in range(0, len(rest), 2)}
        # --reshard reads a run's checkpoint (train.py's run A, conftest), --to-hf a converted one or, from a
        # LoRA run (an --input naming lora), the LoRA run below
        if "--reshard" in flags or "lora" in opts["--input"]:
            opts["--input"] = str(stage["run"])
        else:
            opts["--input"] = stage["ckpt"] if flags else stage["hf"]
        opts["--output"] = str(stage["root"] / f"convert{stage['n']}")
        opts.pop("--tag", None)
        proc = run([sys.executable, script, *flags, *[x for kv in opts.items() for x in kv]])
    else:
        with open(os.path.join(REPO, "scripts", "demo.sh")) as f:
            if script in f.read():
                return "demo"
        tests = [t for t in os.listdir(os.path.join(REPO, "tests")) if t.startswith("test_") and t != "test_readme.py"]
        for t in tests:
            with open(os.path.join(REPO, "tests", t)) as f:
                if os.path.basename(script) in f.read():
                    return f"tests/{t}"
        raise AssertionError(f"documented command not run by this test, the demo or any test: {command}")
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if expected is not None:
        assert program_output(proc) == expected, f"documented output differs for: {command}"
    return "here"


def test_readme_has_the_two_commands_first():
    commands = file_commands(README)
    assert [c for c, _ in commands[:2]] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert "bash scripts/test.sh" in f.read()


def test_readme_folder_table_names_every_script():
    """The "Where things live" row of scripts/ names every script a user runs (the table is written by hand)."""
    with open(README) as f:
        row = next(line for line in f if line.startswith("| `scripts/` |"))
    named = set(re.findall(r"`([\w./-]+\.(?:py|sh))`", row))
    on_disk = {f for f in os.listdir(os.path.join(REPO, "scripts")) if f.endswith((".py", ".sh"))}
    missing, extra = sorted(on_disk - named), sorted(named - on_disk)
    assert not missing and not extra, f"README's scripts/ row: missing {missing}, extra {extra}"


COMMANDS = readme_commands()


@pytest.mark.multirank  # some commands start DeepSpeed ranks (train.py, the demo's steps)
@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[f"{file}-{i}" for i, (_, _, file) in enumerate(COMMANDS)])
def test_readme_command(index, stage, request):
    command, expected, where = COMMANDS[index]
    if "--reshard" in command:
        stage["run"] = request.getfixturevalue("run_a")[0] / "A"
    elif "convert2ckpt.py" in command and "lora" in command:
        stage["run"] = request.getfixturevalue("lora_run")
    assert check_command(command, expected, stage), where


@pytest.mark.e2e
def test_preflight_cli_reports_every_problem(stage):
    """The CLI: exit 1 with train.py's message listing all problems (here two), exit 0 on a good config."""
    args = [sys.executable, "scripts/preflight.py", "--world-size", "16"]
    bad = run(
        [
            *args,
            *substitute_overrides(
                ["model_name_or_path=llama3-8b", "num_stages=2", "ds=zero3", "micro_batch_size=0", "data.train_file=x"],
                stage,
            ),
        ]
    )
    assert bad.returncode == 1 and bad.stderr.startswith("train.py: error: invalid configuration:")
    assert "micro_batch_size 0" in bad.stderr and "ZeRO stage 3 with num_stages=2" in bad.stderr
    good = run(
        [*args, *substitute_overrides(["model_name_or_path=llama3-8b", "num_stages=2", "data.train_file=x"], stage)]
    )
    assert good.returncode == 0 and "config OK for 16 ranks: pipe 2 x data 8" in good.stdout
