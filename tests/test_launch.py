"""tools/launch.py: ranks forked from the fork server behave as fresh ``python -u script`` processes."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from tests.support import REPO
from tests.support.ranks import LAUNCHER, child_env
from tests.support.scripts import run_script
from tools.launch import IMPORT_TIME_PREFIXES, Launcher, RankJob, imported_modules

pytestmark = pytest.mark.e2e  # starts the fork server (the imports of train.py: seconds)

SCRIPT = textwrap.dedent(
    """
    import os, sys
    print("argv", sys.argv[1:], "rank", os.environ["RANK"], "flavour", os.environ.get("FLAVOUR"))
    print("cwd", os.getcwd(), "path0", sys.path[0], "main", __name__)
    print("to stderr", file=sys.stderr)
    if os.environ["RANK"] == os.environ.get("FAIL_RANK"):
        raise ValueError("rank failed on purpose")
    if os.environ["RANK"] == os.environ.get("SLEEP_RANK"):
        import signal, time
        if os.environ.get("ON_TERM") == "ignore":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif os.environ.get("ON_TERM") == "count":
            signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM", flush=True))
        print("asleep", flush=True)
        for _ in range(40 if os.environ.get("ON_TERM") == "count" else 1):
            time.sleep(60 if os.environ.get("ON_TERM") != "count" else 0.05)
    sys.exit(int(os.environ.get("CODE", "0")))
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


def test_a_forked_rank_has_its_own_arguments_environment_and_exit_status(script):
    env = {**child_env(), "FLAVOUR": "mint", "CODE": "3"}
    proc = RankJob(LAUNCHER, 2, script, ["a=1"], env, 29531).wait(timeout=60, grace=1.0)
    assert LAUNCHER.server_for(env) is not None  # these ranks were forked, not fresh interpreters
    assert proc.returncode == 3
    for rank in "01":
        assert f"argv ['--local_rank={rank}', 'a=1'] rank {rank} flavour mint" in proc.stdout
    assert f"cwd {REPO} path0 {os.path.dirname(script)} main __main__" in proc.stdout
    assert proc.stderr.count("to stderr") == 2


def test_a_failing_rank_ends_the_others_with_its_status_and_traceback(script):
    env = {**child_env(), "FAIL_RANK": "1", "SLEEP_RANK": "0"}
    proc = RankJob(LAUNCHER, 2, script, [], env, 29532).wait(timeout=60, grace=1.0)
    assert proc.returncode == 1
    assert "ValueError: rank failed on purpose" in proc.stderr


def test_the_others_get_one_sigterm_and_sigkill_if_they_ignore_it(script):
    """As DeepSpeed's launcher ends a job: one SIGTERM to the ranks still running, SIGKILL ``kill_after`` later."""
    env = {**child_env(), "FAIL_RANK": "1", "SLEEP_RANK": "0", "ON_TERM": "count"}
    proc = RankJob(LAUNCHER, 2, script, [], env, 29533).wait(timeout=60, grace=0.5, kill_after=30)
    assert (proc.returncode, proc.stdout.count("SIGTERM")) == (1, 1)  # the sleeper exits 0 after 2 s
    job = RankJob(LAUNCHER, 2, script, [], {**env, "ON_TERM": "ignore"}, 29534)
    while "asleep" not in job.output():
        time.sleep(0.05)
    assert job.ranks[0].poll() is None  # output read while the job runs
    start = time.time()
    proc = job.wait(timeout=60, grace=0.5, kill_after=1)
    assert proc.returncode == 1 and job.ranks[0].returncode == -signal.SIGKILL and time.time() - start < 20


def test_a_rank_killed_by_a_signal_reports_it_as_popen_does(script):
    env = {**child_env(), "SLEEP_RANK": "0"}
    with open(os.devnull, "w") as out:
        rank = LAUNCHER.start(script, [], {**env, "RANK": "0"}, out, out)
        rank.send_signal(signal.SIGKILL)
        assert rank.wait(timeout=30) == -signal.SIGKILL


def test_run_script_is_subprocess_run(script):
    proc = run_script([script], env={**child_env(), "RANK": "0", "CODE": "0"})
    assert (proc.returncode, proc.args[0]) == (0, sys.executable)
    assert "rank 0" in proc.stdout and proc.stderr == "to stderr\n"


def test_an_environment_read_at_import_gets_a_server_of_its_own():
    env = child_env()
    server = LAUNCHER.server_for(env)
    assert server is not None and LAUNCHER.server_for({**env, "RANK": "3", "FLAVOUR": "x"}) is server
    for name in ("OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "PYTHONPATH", "DS_ACCELERATOR"):
        assert name.startswith(IMPORT_TIME_PREFIXES)
    launcher = Launcher()
    launcher.MAX_SERVERS = 1
    first = launcher.server_for(env)
    assert first.env["OMP_NUM_THREADS"] == env["OMP_NUM_THREADS"] and "RANK" not in first.env
    assert launcher.server_for({**env, "OMP_NUM_THREADS": "2"}) is None  # over the cap: fresh interpreters
    first.close()
    assert Launcher(fork=False).server_for(env) is None


def test_the_server_imports_train_py_s_modules_not_train_py():
    modules = imported_modules("train.py")
    assert "training.build" in modules and "deepspeed.runtime.pipe.topology" in modules
    assert "train" not in modules
