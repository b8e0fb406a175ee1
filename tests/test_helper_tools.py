"""The helper tools refuse what train.py refuses, in train.py's words, and print no dependency noise.

Layouts: scripts/estimate_memory.py and preflight share ``parallel.layout.layout_problems`` with train.py's
``training.configuration.schema.resolve``; each case compares the script's line with resolve's line for the same layout
(in estimate_memory.py's flags: its ``in_flags``).
Counts that train.py has no knob for are refused by argparse. The subprocesses (3) check what only a fresh
process shows: the dependency lines filtered at start (training/observation/logs.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from parallel.layout import Layout, layout_problems
from tests.support import REPO
from tests.support.scripts import load_entry_point, run_script
from tests.test_config import good  # noqa: F401 (a fixture)
from training.configuration.preflight import check
from training.configuration.schema import ConfigError, TrainConfig
from training.configuration.validate import resolve

# Known-harmless dependency lines that no entry point may print (training/observation/logs.py filters them).
NOISE = ("Setting accelerator to CPU", "gemm_4bit_forward", "an autograd kernel was not registered")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# train.py's knobs, which estimate_memory.py's lines must not name (it has flags: --seq-len, --stages, --zero, ...).
TRAIN_KNOBS = re.compile(
    r"(?<![\w-])(data\.\w+|peft\.\w+|ds_config|ds=|num_stages|tensor_parallel|sequence_parallel|"
    r"micro_batch_size|gradient_accumulation_steps|loss_chunk_tokens|partition_method|"
    r"pipeline_schedule|zero_optimization|offload_param\b|offload_optimizer\b)"
)


def in_flags(line: str) -> str:
    """A line of train.py's rules as scripts/estimate_memory.py says it (in its flags)."""
    return load_entry_point("scripts/estimate_memory.py").in_flags(line)


def resolve_lines(cfg: TrainConfig, world_size: int) -> list[str]:
    """train.py's problem lines for ``cfg`` on ``world_size`` ranks."""
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world_size)
    return [line.strip() for line in str(err.value).splitlines()[1:]]


def estimate_lines(argv: list[str], capsys) -> tuple[int, list[str]]:
    """(exit status, stderr lines) of scripts/estimate_memory.py run in-process."""
    with pytest.raises(SystemExit) as exit_:
        load_entry_point("scripts/estimate_memory.py").main(argv)
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture()
def valid(good, tmp_path) -> TrainConfig:  # noqa: F811
    """A config train.py accepts on 2 ranks: pipe 1 x data 2 of the 4-layer tiny model."""
    return dataclasses.replace(
        good,
        output_dir=str(tmp_path / "out"),
        num_stages=1,
        ds_config="zero0",
        micro_batch_size=1,
        gradient_accumulation_steps=1,
        min_free_disk_gb=0,
    )


def run_entry(*argv: str) -> subprocess.CompletedProcess:
    return run_script(list(argv), timeout=120)


def offload_json(tmp_path, stage: int, params: bool) -> str:
    path = tmp_path / f"zero{stage}_offload{'_params' if params else ''}.json"
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if params:
        zero["offload_param"] = {"device": "cpu"}
    path.write_text(json.dumps({"zero_optimization": zero}))
    return str(path)


# (estimate_memory.py options, the same layout as train.py settings: (TrainConfig changes, world size), a word
# the line must hold). dp is 1 unless given.
CASES = [
    (["--stages", "0"], ({"num_stages": 0}, 1), "--stages 0"),
    (["--stages", "5"], ({"num_stages": 5}, 5), "decoder layers"),  # the tiny model has 4
    (["--micro-batch", "0"], ({"micro_batch_size": 0}, 1), "--micro-batch 0"),
    (["--grad-accum", "0"], ({"gradient_accumulation_steps": 0}, 1), "--grad-accum 0"),
    (["--seq-len", "1"], ({"data.max_seq_length": 1}, 1), "--seq-len 1"),
    (["--loss-chunk-tokens", "-1"], ({"loss_chunk_tokens": -1}, 1), "--loss-chunk-tokens -1"),
    (["--zero", "3", "--stages", "2"], ({"num_stages": 2, "ds_config": "zero3"}, 2), "ZeRO stage 3"),
    (["--partition-method", "bogus"], ({"partition_method": "bogus"}, 1), "'bogus'"),
    (["--zero", "1", "--offload", "params"], ({"ds_config": ("offload", 1, True)}, 1), "--offload params"),
    (["--zero", "0", "--offload", "optimizer"], ({"ds_config": ("offload", 0, False)}, 1), "--offload optimizer"),
    (["--sp", "2", "--zero", "2"], ({"sequence_parallel": 2, "ds_config": "zero2"}, 2), "pipeline engine"),
    (["--sp", "2", "--seq-len", "2047"], ({"sequence_parallel": 2, "data.max_seq_length": 2047}, 2), "2047"),
]


@pytest.mark.parametrize("argv, same, word", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_estimate_memory_refuses_what_train_py_refuses_with_its_line(
    argv, same, word, valid, tiny_hf, tmp_path, capsys
):
    changes, world_size = same
    for key, value in changes.items():
        if isinstance(value, tuple):  # a DeepSpeed JSON with offload
            value = offload_json(tmp_path, *value[1:])
        target, _, name = key.rpartition(".")
        setattr(getattr(valid, target) if target else valid, name, value)
    train_lines = [in_flags(line) for line in resolve_lines(valid, world_size)]
    code, lines = estimate_lines(["--model", tiny_hf, *argv], capsys)
    assert code == 1 and len(lines) == 1, lines  # one problem, no plan printed
    prefix = "estimate_memory.py: error: "
    assert lines[0].startswith(prefix) and lines[0][len(prefix) :] in train_lines, (lines, train_lines)
    assert word in lines[0]
    assert not TRAIN_KNOBS.search(lines[0]), lines[0]  # its own flags, none of train.py's knobs


def test_train_py_says_a_shared_rule_once(valid):
    """ZeRO-3 with a pipeline is both a layout rule and a DeepSpeed JSON conflict: one line."""
    valid.num_stages, valid.ds_config = 2, "zero3"
    lines = resolve_lines(valid, 2)
    assert len(lines) == len(set(lines)) == 1, lines


def test_a_valid_layout_still_gets_its_plan(tiny_hf, capsys):
    load_entry_point("scripts/estimate_memory.py").main(["--model", tiny_hf, "--stages", "2", "--dp", "2"])
    out = capsys.readouterr().out
    assert "layout: pipe 2 x data 2" in out and "most loaded GPU: stage" in out


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--dp", "-1"], "argument --dp: -1 is not >= 1"),
        (["--gpus", "0", "--gpu-mem", "80"], "argument --gpus: 0 is not >= 1"),
        (["--gpus", "8", "--gpu-mem", "-1"], "argument --gpu-mem: -1 is not in (0, 4096]"),
        (["--gpus", "8", "--gpu-mem", "nan"], "argument --gpu-mem: nan is not a finite number: give one in (0, 4096]"),
        (["--gpus", "8", "--gpu-mem", "inf"], "argument --gpu-mem: inf is not a finite number: give one in (0, 4096]"),
        (["--gpus", "8", "--gpu-mem", "1e9"], "argument --gpu-mem: 1e9 is not in (0, 4096]"),
        (["--top", "0", "--gpus", "8", "--gpu-mem", "80"], "argument --top: 0 is not >= 1"),
        (["--gpus", "8"], "--gpus and --gpu-mem go together: give both to list the layouts that fit, or neither"),
    ],
)
def test_estimate_memory_counts_train_py_has_no_knob_for_are_argparse_errors(argv, line, capsys):
    code, lines = estimate_lines(["--model", "llama3-8b", *argv], capsys)
    assert code == 2 and lines[0].startswith("usage: ") and lines[-1].endswith(f": error: {line}")


def test_estimate_memory_fit_search_checks_the_batch_settings_too(tiny_hf, valid, capsys):
    valid.micro_batch_size = 0
    code, lines = estimate_lines(["--model", tiny_hf, "--gpus", "4", "--gpu-mem", "80", "--micro-batch", "0"], capsys)
    assert code == 1 and lines == [f"estimate_memory.py: error: {in_flags(p)}" for p in resolve_lines(valid, 2)]


def test_preflight_world_size_below_one_is_refused(tiny_hf, tmp_path):
    """In-process (the CLI's argparse refuses it before): resolve's own line for the world size."""
    for world in (0, -2):
        with pytest.raises(ValueError) as err:
            check(world, [f"model_name_or_path={tiny_hf}", "num_stages=2", f"output_dir={tmp_path}"])
        (expected,) = layout_problems(Layout(stages=2, dp=0), world, "compute", 4)
        assert expected == f"world size {world} < 1: launch 1 rank or more"
        assert f"\n  {expected}\n" in str(err.value) + "\n"


@pytest.mark.parametrize(
    "script, argv, line",
    [
        ("scripts/preflight.py", ["--world-size", "0"], "argument --world-size: 0 is not >= 1"),
        ("scripts/generate.py", ["--model", "m", "--max-new-tokens", "0"], "argument --max-new-tokens: 0 is not >= 1"),
        ("scripts/generate.py", ["--model", "m", "--temperature", "0"], "argument --temperature: 0 is not in (0, 100]"),
        (
            "scripts/generate.py",
            ["--model", "m", "--temperature", "nan"],
            "argument --temperature: nan is not a finite number: give one in (0, 100]",
        ),
        (
            "scripts/generate.py",
            ["--model", "m", "--repetition-penalty", "1e6"],
            "argument --repetition-penalty: 1e6 is not in (0, 10]",
        ),
        ("scripts/eval_hf.py", ["--model", "m", "--data", "d", "--seq-len", "1"], "argument --seq-len: 1 is not >= 2"),
        (
            "scripts/eval_hf.py",
            ["--model", "m", "--data", "d", "--docs", "x"],
            "argument --docs: 'x' is not an integer",
        ),
    ],
)
def test_script_counts_are_argparse_errors(script, argv, line, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_entry_point(script).main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f": error: {line}")  # prog: sys.argv[0]


@pytest.mark.e2e  # a script in a subprocess
def test_preflight_prints_train_py_lines_and_no_dependency_noise(tiny_hf, tmp_path):
    proc = run_entry(
        "scripts/preflight.py",
        "--world-size",
        "3",
        f"model_name_or_path={tiny_hf}",
        "num_stages=2",
        f"output_dir={tmp_path}",
        "data.train_file=/nonexistent.jsonl",
    )
    assert proc.returncode == 1 and proc.stdout == ""
    err = proc.stderr.splitlines()
    assert err[0] == "train.py: error: invalid configuration:"
    (divisible,) = layout_problems(Layout(stages=2), 3, "compute", 4)
    assert f"  {divisible}" in err and not any(n in proc.stderr for n in NOISE), proc.stderr


@pytest.mark.e2e  # a script in a subprocess
def test_convert2ckpt_prints_its_error_and_no_dependency_noise(tmp_path):
    proc = run_entry("convert2ckpt.py", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "o"))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"convert2ckpt.py: error: --input {tmp_path / 'missing'} does not exist\n"


BROADCAST = """
import os, sys, warnings
sys.path.insert(0, {repo!r})
from training.observation.logs import quiet_dependencies
quiet_dependencies(sys.argv[1])
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
lin = torch.nn.Linear(2, 2)
dist.broadcast(lin.weight, 0)  # what DeepSpeed does to a tied weight at start (_synchronize_tied_weights)
lin(torch.ones(1, 2)).sum().backward()
assert lin.weight.is_leaf and torch.equal(lin.weight.grad, torch.ones(2, 2))  # the gradient is unharmed
dist.destroy_process_group()
"""


@pytest.mark.e2e  # a script in a subprocess
def test_the_tied_weight_broadcast_warning_is_filtered_unless_log_level_info():
    from training.resilience.ports import free_port

    script = BROADCAST.format(repo=REPO)
    runs = {
        level: subprocess.run(
            [sys.executable, "-c", script, level, str(free_port())],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        for level in ("warning", "info")
    }
    assert all(r.returncode == 0 for r in runs.values()), {k: r.stderr for k, r in runs.items()}
    assert "c10d::broadcast_: an autograd kernel was not registered" in runs["info"].stderr  # the warning is real
    assert runs["warning"].stderr == ""
