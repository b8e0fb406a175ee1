"""A killed rank, a crash while saving, a hung rank, a non-finite loss, output and input problems and untrusted files:
nothing hangs, nothing is lost.

The multi-rank runs are few and serve several assertions each:

- ``chain`` (4 ranks, pipe 2 x data 2, fp32, 10 steps, a checkpoint every 2): an uninterrupted run U;
  run C whose rank 2 SIGKILLs itself in the middle of saving step 4; C resumed, saving every step in the
  background (``save_async``), and killed from outside (``kill -9`` of rank 1) after step 7 while rank 1
  still writes step 6; C resumed again and sent SIGUSR1 during a background write (exit 75); C resumed to
  the end. C must end bit-identical to U, its checkpoints the same files.
- a NaN loss with ``nonfinite_loss=stop`` (2 ranks); a NaN loss with ``nonfinite_loss=skip``
  followed by a hung rank that ``dist_timeout_s`` unblocks (4 ranks).

Faults are injected by ``tests/ds_scripts/train_faults.py`` (nothing test-only is in train.py).
"""

from __future__ import annotations

import glob
import json
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass

import psutil
import pytest
import torch

from models.files.hf_convert import ConversionError, hf_to_stages, load_bin, stages_to_hf
from models.files.pipeline_dir import CheckpointError, load_layer_file, load_stage_weights, stage_file_problems
from models.llama_pipe import layer_file_name
from models.tiny import write_random_tokens
from tests.support import REPO
from tests.support.models import make_hf_dir
from tests.support.ranks import LAUNCH_TIMEOUT_S, child_env, finish_deepspeed, start_deepspeed
from tests.support.runs import read_metrics
from tests.support.scripts import load_entry_point, run_script
from tools.launch import deepspeed_command, remove_shm_leftovers
from training.configuration.output_checks import checkpoint_size_bytes
from training.configuration.schema import ConfigError, DataConfig, TrainConfig
from training.configuration.validate import resolve
from training.resilience.ports import free_port

convert2ckpt = load_entry_point("convert2ckpt.py")
KILL_EXIT_BOUND_S = 60  # the whole job must be gone this long after a rank is killed
STEPS = 10
FAULTS = "tests/ds_scripts/train_faults.py"


# ---------- launching with a kill switch ----------


@dataclass
class Launch:
    returncode: int
    output: str  # stdout and stderr, interleaved
    killed_at: float | None
    ended_at: float
    port: int

    def line(self, fragment: str) -> str:
        return next(line for line in self.output.splitlines() if fragment in line)


def launch(
    num_ranks: int,
    script: str,
    args: list[str],
    log_path: str,
    kill_rank_after: tuple[str, int],
    env: dict | None = None,
    send: signal.Signals = signal.SIGKILL,
) -> Launch:
    """The real ``deepspeed --num_gpus N script args`` (``env`` added to its environment), output streamed; rank
    ``kill_rank_after[1]`` gets ``send`` (SIGKILL) as soon as a line containing ``kill_rank_after[0]`` appears.
    Afterwards every process left of the job is killed and its /dev/shm segments removed (a killed rank cannot
    remove its own)."""
    port = free_port()
    proc = subprocess.Popen(
        deepspeed_command(num_ranks, script, args, port),
        cwd=REPO,
        env={**child_env(), **(env or {})},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines, killed_at = [], None
    deadline = time.time() + LAUNCH_TIMEOUT_S
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed_at is None and kill_rank_after[0] in line:
                victim = [
                    p
                    for p in psutil.Process(proc.pid).children(recursive=True)
                    if f"--local_rank={kill_rank_after[1]}" in p.cmdline()
                ]
                assert len(victim) == 1, victim
                victim[0].send_signal(send)
                killed_at = time.time()
            if time.time() > deadline:
                break
        proc.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        ended_at = time.time()
        if proc.poll() is None:  # a hang the job did not resolve itself: fail the test, not the CI run
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
            proc.wait()
        remove_shm_leftovers(port)
    output = "".join(lines)
    with open(log_path, "w") as f:
        f.write(output)
    return Launch(proc.returncode, output, killed_at, ended_at, port)


def forked(num_ranks: int, script: str, args: list[str], log_path: str, env: dict | None = None) -> Launch:
    """The ranks started directly, as tests/support/ranks.py's ``run_deepspeed`` starts them (a rank that fails
    ends the others, as the launcher does), ``env`` added to their environment."""
    job = start_deepspeed(num_ranks, script, args, env)
    proc = finish_deepspeed(job, log_path)
    return Launch(proc.returncode, proc.stdout + proc.stderr, None, time.time(), job.port)


def train_args(ckpt: str, data: str, out, cache, **overrides) -> list[str]:
    args = {
        "model_name_or_path": ckpt,
        "output_dir": out,
        "data.train_file": data,
        "data.max_seq_length": 16,
        "data.cache_dir": cache,
        "num_stages": 2,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "max_steps": STEPS,
        "precision": "fp32",
        "ds": "zero1",
        "optim.lr": 1e-3,
        "save_steps": 2,
        "save_total_limit": 0,
        **overrides,
    }
    return [f"{k}={v}" for k, v in args.items()]


def trainer_states(tag_dir) -> list[str]:
    return sorted(f for f in os.listdir(tag_dir) if f.startswith("trainer_state_rank"))


def layers_equal(a_dir, b_dir) -> bool:
    names = sorted(f for f in os.listdir(a_dir) if f.startswith("layer_"))
    assert names and names == sorted(f for f in os.listdir(b_dir) if f.startswith("layer_"))
    for name in names:
        a, b = load_layer_file(os.path.join(a_dir, name)), load_layer_file(os.path.join(b_dir, name))
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            return False
    return True


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_hf):
    root = tmp_path_factory.mktemp("reliability")
    ckpt, data = str(root / "ckpt"), str(root / "train.jsonl")
    hf_to_stages(tiny_hf, ckpt)
    write_random_tokens(data, 64, 16, vocab_size=512)
    return root, ckpt, data


# ---------- 1 + 2: a killed rank, a crash while saving, resume ----------


@pytest.fixture(scope="module")
def chain(setup):
    root, ckpt, data = setup
    cache = root / "cache"
    runs = {}

    def without_kill(out: str, log: str) -> Launch:
        return forked(4, "train.py", train_args(ckpt, data, root / out, cache), str(root / log))

    runs["U"] = without_kill("U", "U.log")
    assert runs["U"].returncode == 0, runs["U"].output[-4000:]
    # C: rank 2 dies right after writing its first file of global_step4 (the others wait in the save).
    kill_time = root / "crash.time"
    runs["crash"] = forked(
        4,
        FAULTS,
        train_args(ckpt, data, root / "C", cache),
        str(root / "C-crash.log"),
        env={"FAULT_CRASH_IN_SAVE": "4:2", "FAULT_KILL_TIME_FILE": str(kill_time)},
    )
    runs["crash"].killed_at = float(kill_time.read_text().split()[0])
    runs["after_crash"] = {
        "latest": (root / "C" / "latest").read_text(),
        "step4": sorted(os.listdir(root / "C" / ".global_step4.partial")),
        "dirs": sorted(os.listdir(root / "C")),
    }

    # From here C saves every step in the background (save_async), one rank's writer slowed by FAULT_SLOW_WRITE.
    def slow_writer(log: str, slow: str, trigger: tuple[str, int], send=signal.SIGKILL) -> Launch:
        args = train_args(ckpt, data, root / "C", cache, save_async="true", save_steps=1)
        return launch(4, FAULTS, args, str(root / log), trigger, env={"FAULT_SLOW_WRITE": slow}, send=send)

    # C resumed; rank 1's writer takes 30 s over its files of global_step6, and rank 1 is killed from outside once
    # step 7 is logged (training went on), under the real launcher: it is what ends the job.
    runs["kill"] = slow_writer("C-kill.log", "6:1:30", ("step 7/", 1))
    runs["after_kill"] = {"latest": (root / "C" / "latest").read_text(), "dirs": sorted(os.listdir(root / "C"))}
    # C resumed again; rank 3's writer takes 4 s over global_step7, and rank 3 gets SIGUSR1 as it starts on them.
    runs["usr1"] = slow_writer("C-usr1.log", "7:3:4", ("[fault] rank 3: writing global_step7", 3), signal.SIGUSR1)
    runs["after_usr1"] = {"latest": (root / "C" / "latest").read_text(), "dirs": sorted(os.listdir(root / "C"))}
    runs["final"] = without_kill("C", "C-final.log")
    assert runs["final"].returncode == 0, runs["final"].output[-4000:]
    return root, runs


def checkpoint_files_equal(a_dir, b_dir) -> list[str]:
    """The files of two checkpoints that differ: names, then every DeepSpeed file's content (tensors equal, and
    every other value and container type the same)."""

    def same(x, y) -> bool:
        if torch.is_tensor(x):
            return torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        if hasattr(x, "__dict__"):  # DeepSpeed's LossScaler: no __eq__ of its own
            return same(vars(x), vars(y))
        return x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))

    names = sorted(f for f in os.listdir(a_dir) if f.endswith(".pt"))
    if names != sorted(f for f in os.listdir(b_dir) if f.endswith(".pt")):
        return ["names"]
    from training.checkpoints.async_save import CheckpointEngine

    load = CheckpointEngine().load
    return [n for n in names if not same(load(os.path.join(a_dir, n)), load(os.path.join(b_dir, n)))]


def assert_one_line_naming(output: str, *fragments: str) -> None:
    """A job ended by a lost rank said so once (training/resilience/preemption.py's exit_if_peer_lost), and nothing else
    failed aloud."""
    errors = [line for line in output.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1 and all(f in errors[0] for f in fragments), errors or output[-3000:]
    assert "ended without a word" in errors[0]
    assert "Traceback" not in output and "Error executing job" not in output, output[-3000:]


@pytest.mark.multirank
def test_a_rank_killed_mid_training_ends_the_job_and_resume_matches_an_uninterrupted_run(chain):
    """Also save_async: C saves every step in the background from step 3 on, and ends bit-identical to U."""
    root, runs = chain
    kill = runs["kill"]
    assert kill.killed_at is not None and kill.returncode != 0
    exit_s = kill.ended_at - kill.killed_at
    print(f"kill -9 of rank 1 mid-training: job exited {exit_s:.1f} s later with code {kill.returncode}")
    assert exit_s < KILL_EXIT_BOUND_S
    assert "exits with return code = " in kill.output  # the launcher saw a rank fail and stopped the others
    # one line for the job, naming the rank killed, and no survivor's traceback (gloo's "Connection reset by peer")
    assert_one_line_naming(kill.output, "rank 1 (pid ", f"latest names {root / 'C' / 'global_step5'}")
    final = runs["final"]
    assert f"(resumed from {runs['after_usr1']['latest']})" in final.output
    u, c = read_metrics(str(root / "U")), read_metrics(str(root / "C"))
    assert [m["step"] for m in c] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in c] == [m["loss"] for m in u]  # bit-identical, fp32
    for step in range(2, STEPS + 1, 2):  # every checkpoint, written at once (U) or in the background (C, 4 to 8)
        tag = f"global_step{step}"
        assert sorted(os.listdir(root / "C" / tag)) == sorted(os.listdir(root / "U" / tag)), tag
        assert layers_equal(root / "U" / tag, root / "C" / tag), tag
        assert checkpoint_files_equal(root / "U" / tag, root / "C" / tag) == [], tag
    assert (root / "C" / "latest").read_text() == f"global_step{STEPS}"
    assert not [d for d in os.listdir(root / "C") if d.endswith(".partial")]


@pytest.mark.multirank
def test_a_crash_while_saving_keeps_latest_and_the_incomplete_checkpoint_is_never_used(chain):
    root, runs = chain
    crash = runs["crash"]
    exit_s = crash.ended_at - crash.killed_at
    print(f"rank 2 killed while saving global_step4: job exited {exit_s:.1f} s later with code {crash.returncode}")
    assert crash.returncode != 0 and exit_s < KILL_EXIT_BOUND_S
    assert_one_line_naming(crash.output, "rank 2 (pid ", f"latest names {root / 'C' / 'global_step2'}")
    assert runs["after_crash"]["latest"] == "global_step2"  # the previous complete checkpoint
    assert "global_step4" not in runs["after_crash"]["dirs"]  # only complete checkpoints are named global_step<N>
    partial = runs["after_crash"]["step4"]
    assert len([f for f in partial if f.startswith("trainer_state_rank")]) < 4, partial  # incomplete
    resumed = runs["kill"]
    assert "(resumed from global_step2)" in resumed.output
    assert (
        f"removing {root / 'C' / '.global_step4.partial'}: an incomplete checkpoint left by an interrupted save"
        in resumed.output
    )
    # saved again cleanly: the same files as the uninterrupted run's global_step4 (checked in the test above too)
    assert trainer_states(root / "C" / "global_step4") == [f"trainer_state_rank{r:05d}.json" for r in range(4)]


@pytest.mark.multirank
def test_a_rank_killed_during_a_background_write_leaves_latest_on_the_previous_checkpoint(chain):
    """save_async: rank 1 SIGKILLed while its writer still writes global_step6 (training went on to step 7)."""
    root, runs = chain
    kill = runs["kill"].output
    assert kill.index("[fault] rank 1: writing global_step6 in the background") < kill.index("step 7/")
    assert "checkpoint global_step6: copied to host memory in" in kill
    assert runs["after_kill"]["latest"] == "global_step5"  # every save up to 5 was complete before 6's copy
    assert ".global_step6.partial" in runs["after_kill"]["dirs"] and "global_step6" not in runs["after_kill"]["dirs"]
    usr1 = runs["usr1"].output
    assert "(resumed from global_step5)" in usr1
    assert f"removing {root / 'C' / '.global_step6.partial'}: an incomplete checkpoint" in usr1


@pytest.mark.multirank
def test_a_stop_signal_during_a_background_write_waits_for_it_and_exits_75(chain):
    """save_async: SIGUSR1 to rank 3 as its writer starts on global_step7, 4 s slow: the step after it is saved at
    once, after global_step7 is written and made latest, and the job exits 75; the resume is exact (test above)."""
    root, runs = chain
    usr1 = runs["usr1"]
    assert usr1.returncode == 75, usr1.output[-3000:]
    assert "checkpoint global_step7 is still being written in the background: waiting for it before saving" in (
        usr1.output
    )
    assert "saved checkpoint global_step7 in" in usr1.output and "(written in the background in " in usr1.line(
        "saved checkpoint global_step7"
    )
    stopped = usr1.line("stop signal (SIGTERM/SIGUSR1) on rank(s) [3]")
    latest = runs["after_usr1"]["latest"]
    assert latest in ("global_step8", "global_step9") and f"checkpoint {latest} saved" in stopped
    assert usr1.ended_at - usr1.killed_at > 2.0  # the 4 s write, waited for
    assert not [d for d in runs["after_usr1"]["dirs"] if d.endswith(".partial")]
    assert trainer_states(root / "C" / "global_step7") == [f"trainer_state_rank{r:05d}.json" for r in range(4)]


@pytest.mark.multirank
def test_saved_checkpoint_lines_report_rss_per_rank_and_the_size_estimate_holds(chain, setup):
    root, runs = chain
    line = runs["U"].line("saved checkpoint global_step10")
    assert "RSS per rank now: " in line and len(line.split("RSS per rank now: ")[1].split(" MiB")[0].split(", ")) == 4
    from transformers import LlamaConfig

    tag_dir = root / "U" / "global_step10"
    actual = sum(os.path.getsize(tag_dir / f) for f in os.listdir(tag_dir))
    estimate, _ = checkpoint_size_bytes(LlamaConfig.from_pretrained(setup[1]), "fp32", 1, 4)
    print(f"checkpoint size: estimated {estimate} bytes, written {actual} bytes")
    assert 1.0 <= estimate / actual < 1.15  # measured 1.02 (4,269,056 vs 4,194,905 bytes)


@pytest.mark.multirank
def test_the_stress_script_reads_the_saved_checkpoint_lines(chain):
    """tools/stress.py (by hand: 20 short runs and a 500-step run) measures RSS from these lines."""
    from training.checkpoints.save_restore import SAVED_LINE

    lines = SAVED_LINE.finditer(chain[1]["U"].output)
    saves = {int(m.group(1)): [int(x) for x in m.group(2).split(", ")] for m in lines}
    assert sorted(saves) == list(range(2, STEPS + 1, 2)) and all(len(r) == 4 and min(r) > 0 for r in saves.values())


@pytest.mark.multirank
def test_no_shared_memory_segment_is_left_behind(chain):
    """Killed ranks cannot remove their /dev/shm segments; the launch helper does (by the job's port)."""
    for run in chain[1].values():
        if isinstance(run, Launch):
            assert not remove_shm_leftovers(run.port), run.port


# ---------- 4 (NaN) and 1 (hung rank): non-finite loss, dist_timeout_s ----------


@pytest.mark.multirank
def test_a_nan_loss_stops_every_rank_naming_the_step_and_the_last_good_checkpoint(setup):
    root, ckpt, data = setup
    out = root / "nan-stop"
    run = forked(
        2,
        FAULTS,
        train_args(ckpt, data, out, root / "cache", max_steps=6),
        str(root / "nan-stop.log"),
        env={"FAULT_NAN_AT_STEPS": "3"},
    )
    assert run.returncode != 0
    assert (
        f"train.py: error: step 3: loss is nan: training stopped (nonfinite_loss=stop). "
        f"Last good checkpoint: {out / 'global_step2'} (resume=auto continues from it)."
    ) in run.output
    assert "set nonfinite_loss=skip to skip such steps" in run.output
    assert "Traceback" not in run.output
    assert (out / "latest").read_text() == "global_step2"
    assert sorted(t for t in os.listdir(out) if t.startswith("global_step")) == ["global_step2"]


@pytest.mark.multirank
def test_nan_skip_leaves_the_weights_and_a_hung_rank_times_out(setup):
    """nonfinite_loss=skip: step 3's NaN update is skipped (its checkpoint equals step 2's), step 4
    trains. Then rank 3 hangs at step 5: the others fail after dist_timeout_s and the job exits."""
    root, ckpt, data = setup
    # Above any wait between ranks: forked ranks start together, the cache of 64 rows and a save take well under 1 s.
    out, timeout_s = root / "nan-skip", 10
    run = forked(
        4,
        FAULTS,
        train_args(
            ckpt, data, out, root / "cache", max_steps=8, save_steps=1, nonfinite_loss="skip", dist_timeout_s=timeout_s
        ),
        str(root / "nan-skip.log"),
        env={"FAULT_NAN_AT_STEPS": "3", "FAULT_HANG_AT_STEP": "5:3"},
    )
    assert "warning: step 3: loss is nan: update skipped (nonfinite_loss=skip; 1 skipped: steps [3])" in run.output
    losses = {m["step"]: m["loss"] for m in read_metrics(str(out))}
    assert math.isnan(losses[3]) and all(math.isfinite(losses[s]) for s in (1, 2, 4))
    assert layers_equal(out / "global_step2", out / "global_step3")  # the NaN step changed nothing
    assert not layers_equal(out / "global_step3", out / "global_step4")  # the next one trained
    for tag in ("global_step3", "global_step4"):
        weights = [
            t
            for f in os.listdir(out / tag)
            if f.startswith("layer_")
            for t in load_layer_file(str(out / tag / f)).values()
        ]
        assert all(torch.isfinite(t).all() for t in weights)
    hung_at = float(run.line("FAULT rank 3 hangs at step 5").split(" at time ")[1])
    exit_s = run.ended_at - hung_at
    print(
        f"rank 3 hung at step 5 with dist_timeout_s={timeout_s}: job exited {exit_s:.1f} s later, code {run.returncode}"
    )
    assert run.returncode != 0
    assert f"Timed out waiting {timeout_s * 1000}ms" in run.output
    assert exit_s < timeout_s + 40
    assert (out / "latest").read_text() == "global_step4"


# ---------- 3: output problems before training starts ----------


@pytest.fixture()
def good(tmp_path, tiny_hf) -> TrainConfig:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    return TrainConfig(
        model_name_or_path=tiny_hf,
        num_stages=2,
        micro_batch_size=1,
        gradient_accumulation_steps=2,
        output_dir=str(tmp_path / "out"),
        data=DataConfig(train_file=str(data)),
    )


def problems_of(cfg: TrainConfig, world_size: int = 4) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world_size)
    return str(err.value)


def test_an_unwritable_output_dir_is_refused_before_training(good, tmp_path):
    (tmp_path / "a_file").write_text("x")
    good.output_dir = str(tmp_path / "a_file" / "run")
    assert f"output_dir {good.output_dir}: {tmp_path / 'a_file'} exists and is not a directory" in problems_of(good)
    if os.geteuid() == 0:  # root writes through permissions: use a file system that refuses everyone
        if not os.path.isdir("/sys"):
            pytest.skip("running as root without /sys")
        good.output_dir = "/sys/llama-pipe-run"
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        good.output_dir = str(tmp_path / "ro" / "run")
    assert f"output_dir {good.output_dir} is not writable" in problems_of(good)


def test_too_little_free_disk_for_one_checkpoint_is_refused(good, monkeypatch):
    import shutil

    import training.configuration.output_checks as config

    need, _ = checkpoint_size_bytes(resolve(good, 4).model_config, "bf16", 1, 4)
    real = shutil.disk_usage
    monkeypatch.setattr(config.shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    message = problems_of(good)
    assert f"output_dir {good.output_dir}: {(need - 1) / 1e9:.3g} GB free on its file system" in message
    assert "one checkpoint needs about" in message and "0.3 M parameters x 14 bytes: bf16 weights" in message
    assert "(min_free_disk_gb=0 skips this check)" in message
    good.min_free_disk_gb = 0.0
    resolve(good, 4)  # the knob turns the check off
    good.min_free_disk_gb = -1.0
    monkeypatch.setattr(config.shutil, "disk_usage", lambda p: real(p)._replace(free=2 * need))
    good.save_total_limit = 3
    (warning,) = resolve(good, 4).warnings
    assert "4 checkpoints of about" in warning and "a later save will fail" in warning


@pytest.mark.e2e
def test_cli_refuses_output_problems_before_any_process_group(tmp_path, tiny_hf):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    env = {**child_env(), "WORLD_SIZE": "4"}
    env.pop("RANK", None)
    proc = run_script(
        [
            "train.py",
            f"model_name_or_path={tiny_hf}",
            f"data.train_file={data}",
            "num_stages=2",
            f"output_dir={tmp_path / 'out'}",
            "min_free_disk_gb=1e9",
        ],
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "train.py: error: invalid configuration:" in proc.stderr
    assert "GB free on its file system" in proc.stderr and "but min_free_disk_gb=1e+09 asks for 1e+09 GB" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_an_output_dir_holding_another_shape_names_the_layer_and_both_shapes(good, tmp_path, tokenizer_dir):
    out = tmp_path / "out"
    (out / "global_step4").mkdir(parents=True)
    (out / "latest").write_text("global_step4")
    wide = make_hf_dir(tmp_path, tokenizer_dir, "wide", intermediate_size=128)
    (out / "config.json").write_text(open(os.path.join(wide, "config.json")).read())
    message = problems_of(good)
    assert "holds a checkpoint with intermediate_size=128, this model has 176: choose another output_dir" in message
    assert (
        f"output_dir {out}/global_step4: layer_01-model_states.pt tensor 'mlp.gate_proj.weight' has shape "
        f"(128, 64) in the checkpoint, (176, 64) in this model"
    ) in message
    assert "... and 9 more tensors of other shapes" in message  # 3 MLP matrices x 4 layers, 3 named


def test_latest_naming_a_missing_tag_and_leftover_newer_directories(good, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "latest").write_text("global_step9")
    assert f"{out}/latest names global_step9, which is not in {out}" in problems_of(good)
    (out / "global_step9").mkdir()
    (out / "global_step12").mkdir()
    (warning,) = resolve(good, 4).warnings
    assert f"{out}/global_step12 is not a complete checkpoint" in warning


def test_prune_keeps_the_newest_and_removes_directories_newer_than_the_saved_one(tmp_path):
    from training.checkpoints.save_restore import prune

    for step in (2, 4, 6, 8, 10):
        (tmp_path / f"global_step{step}").mkdir()
    assert sorted(prune(str(tmp_path), 2, keep="global_step6")) == ["global_step10", "global_step2", "global_step8"]
    assert sorted(os.listdir(tmp_path)) == ["global_step4", "global_step6"]


# ---------- 4: bad input, named with what and where ----------


class _Stage:
    """Just enough of a PipelineModule: one stage owning ``specs``."""

    def __init__(self, config, specs):
        from models.llama_pipe import build_specs

        self._layer_specs = build_specs(config)
        self._local_start, self._local_stop = specs[0], specs[-1] + 1
        self.tied_modules = {}
        self.forward_funcs = [self._layer_specs[i].build() for i in specs]


def test_a_checkpoint_of_another_shape_names_the_layer_file_and_both_shapes(tmp_path, tiny_hf, tokenizer_dir):
    from transformers import LlamaConfig

    hf_to_stages(tiny_hf, str(tmp_path / "ckpt"))
    wide = LlamaConfig.from_pretrained(make_hf_dir(tmp_path, tokenizer_dir, "wide", intermediate_size=128))
    path = tmp_path / "ckpt" / "global_step0" / layer_file_name(2)
    with pytest.raises(CheckpointError) as err:
        load_stage_weights(_Stage(wide, [2, 3]), wide, str(tmp_path / "ckpt"))
    assert f"{path}: tensor 'mlp.gate_proj.weight' has shape (176, 64), the model config expects (128, 64)" in str(
        err.value
    )
    # the same check before a resume, from the specs (whatever ZeRO did to the module's parameters)
    problems = stage_file_problems(_Stage(wide, [2, 3]), wide, str(tmp_path / "ckpt"), "global_step0")
    assert f"{path}: tensor 'mlp.up_proj.weight' has shape (176, 64), the model config expects (128, 64)" in problems
    with pytest.raises(
        CheckpointError, match="checkpoint tag 'global_step5' not found in .*tags there: \\['global_step0'\\]"
    ):
        load_stage_weights(_Stage(wide, [2, 3]), wide, str(tmp_path / "ckpt"), tag="global_step5")


def test_invalid_ds_config_json_names_the_file_line_and_column(good, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "zero_optimization": {"stage": 1},\n}\n')
    good.ds_config = str(path)
    message = problems_of(good)
    assert f"ds_config {path} is not valid JSON: " in message and " at line 3 column 1" in message


# ---------- 5: untrusted files ----------


class _Payload:
    """Unpickling this runs a shell command (what a malicious checkpoint would do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_a_malicious_pickle_bin_is_refused_by_the_converter(tmp_path, tiny_hf, zip_format, capsys):
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text(open(os.path.join(tiny_hf, "config.json")).read())
    marker = tmp_path / "PWNED"
    state = {"model.embed_tokens.weight": torch.zeros(512, 64), "x": _Payload(str(marker))}
    torch.save(state, model / "pytorch_model.bin", _use_new_zipfile_serialization=zip_format)
    assert convert2ckpt.main(["--input", str(model), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"convert2ckpt.py: error: {model / 'pytorch_model.bin'} holds objects other than tensors" in err
    assert "unsupported GLOBAL posix.system" in err or "unsupported GLOBAL os.system" in err
    assert not marker.exists() and not (tmp_path / "out").exists()
    with pytest.raises(ConversionError):
        load_bin(str(model / "pytorch_model.bin"))
    assert not marker.exists()


def test_a_malicious_layer_file_is_refused_by_the_loaders(tmp_path, tiny_hf):
    from transformers import LlamaConfig

    hf_to_stages(tiny_hf, str(tmp_path / "ckpt"))
    marker = tmp_path / "PWNED"
    path = tmp_path / "ckpt" / "global_step0" / layer_file_name(2)
    torch.save({"x": _Payload(str(marker))}, path)
    config = LlamaConfig.from_pretrained(tiny_hf)
    with pytest.raises(CheckpointError, match=f"{path} holds objects other than tensors"):
        load_stage_weights(_Stage(config, [2, 3]), config, str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match="holds objects other than tensors"):
        stages_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert not marker.exists()


def test_deepspeed_checkpoint_files_are_loaded_without_running_pickles(tmp_path):
    """What resume reads through DeepSpeed (engine and optimizer states) is loaded with weights_only=True:
    the classes DeepSpeed's ZeRO states hold load; a file naming anything else is named by the pre-check
    (which reads the pickle without running it) and refused by the loader, and its code never runs."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from training.checkpoints.async_save import CheckpointEngine
    from training.checkpoints.save_restore import unsafe_checkpoint_files

    optim = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.optimizer_states}
    state["param_slice_mappings"] = [{"w": fragment_address(numel=4, start=0)}]
    torch.save({"optimizer_state_dict": {**state, "fp32": torch.ones(4)}}, optim)
    loaded = CheckpointEngine().load(str(optim))["optimizer_state_dict"]
    assert loaded["zero_stage"] is ZeroStageEnum.optimizer_states and loaded["loss_scaler"].cur_scale == 1.0
    assert loaded["param_slice_mappings"][0]["w"] == fragment_address(numel=4, start=0)
    assert unsafe_checkpoint_files(str(tmp_path), 0, 1) == []

    marker = tmp_path / "PWNED"
    engine_state = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": None, "lr_scheduler": _Payload(str(marker))}, engine_state)
    problems = unsafe_checkpoint_files(str(tmp_path), 0, 1)
    assert problems == [
        f"{engine_state} names posix.system, which a DeepSpeed checkpoint never holds (a pickle that could run "
        "code when loaded): refused, nothing loaded"
    ]
    assert unsafe_checkpoint_files(str(tmp_path), 1, 2) == []  # rank 1 of 2 checks the other file
    with pytest.raises(CheckpointError, match=f"{engine_state} holds objects a DeepSpeed checkpoint does not"):
        CheckpointEngine().load(str(engine_state))
    assert not marker.exists()


def test_resharding_reads_optimizer_states_without_running_pickles(tmp_path, tiny_hf, capsys):
    """convert2ckpt.py --reshard (and a resume on another layout, the same reader) refuses a tampered
    optimizer-state file by name, writes nothing, and never runs it."""
    from training.checkpoints.reshard import SavedOptimizerState

    run = tmp_path / "run"
    hf_to_stages(tiny_hf, str(run))
    tag_dir = run / "global_step0"
    marker = tmp_path / "PWNED"
    optim = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"partition_count": [1], "x": _Payload(str(marker))}}, optim)
    (tag_dir / "trainer_state_rank00000.json").write_text(json.dumps({"step": 0}))
    (problem,) = SavedOptimizerState(str(tag_dir)).problems
    assert problem.startswith(
        f"{optim} holds objects a DeepSpeed checkpoint does not (a pickle that could run code when loaded): "
        "refused, nothing loaded"
    )
    assert "posix.system" in problem or "os.system" in problem
    assert convert2ckpt.main(["--reshard", "--input", str(run), "--output", str(tmp_path / "out")]) == 1
    assert f"cannot reshard {tag_dir}:\n  {optim} holds objects" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_every_torch_load_in_the_project_is_weights_only():
    """The project's own loads; DeepSpeed's (resume) go through training.checkpoints.async_save's
    CheckpointEngine, tested above and in tests/test_training_loop.py."""
    offenders = []
    paths = glob.glob(os.path.join(REPO, "*.py"))
    for folder in ("models", "parallel", "training", "data", "scripts", "tools", "benchmarks"):
        paths += glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True)
    for path in paths:
        for n, line in enumerate(open(path), 1):
            if "torch.load(" in line and "weights_only=True" not in line:
                offenders.append(f"{path}:{n}: {line.strip()}")
    assert not offenders, offenders
