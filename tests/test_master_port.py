"""Every launch of ranks takes a master port that is free, or the one the user gave (MASTER_PORT), and says which.

On a shared machine another job may hold 29500, the port DeepSpeed's launcher takes unless told
(training/resilience/ports.py; scripts/demo.sh, scripts/multinode/, tools/launch.py's ``deepspeed_command``)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess

import pytest

from tests.support import REPO
from tests.support.ranks import child_env
from tests.test_multinode import FAKE_SCONTROL, FAKE_SRUN, LAUNCH, SBATCH, STUB_LAUNCHER, write_executable
from tools.launch import deepspeed_command, remove_shm_leftovers
from training.resilience.ports import PortError, master_port

DEFAULT_PORT = 29500  # DeepSpeed's launcher's (and torch's) when no port is given
FREE_LINE = r"\[{who}\] master port (\d+) \(free on this machine; MASTER_PORT=PORT chooses one\)"
# The scripts that launch ranks with DeepSpeed's command (the Python ones build it with deepspeed_command).
SHELL_LAUNCHERS = ("scripts/demo.sh", "scripts/multinode/launch_hostfile.sh", "scripts/multinode/train_slurm.sbatch")


@pytest.fixture
def default_port_taken():
    """29500 held by a listening socket (or already held by another job on this machine: taken either way)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", DEFAULT_PORT))
            s.listen()
        except OSError:
            pass
        yield


def is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_master_port_is_the_given_one_else_a_free_one(default_port_taken):
    assert master_port({"MASTER_PORT": "29651"}) == (29651, "from MASTER_PORT")
    port, source = master_port({})
    assert port != DEFAULT_PORT and is_free(port) and source.startswith("free on this machine")
    for bad in ("x", "0", "70000"):
        with pytest.raises(PortError, match=f"MASTER_PORT='{bad}' is not a TCP port: set it to a number in 1-65535"):
            master_port({"MASTER_PORT": bad})
    with pytest.raises(PortError, match="MASTER_ADDR 192.0.2.1 is not an address of this machine"):
        master_port({}, host="192.0.2.1")  # TEST-NET-1: never this machine


def test_a_given_master_port_held_here_is_refused_at_once(default_port_taken):
    """MASTER_PORT held by another process on this machine: refused before the launch, with how to take a free one;
    on another machine's MASTER_ADDR it cannot be checked, and is taken as given."""
    with pytest.raises(PortError) as e:
        master_port({"MASTER_PORT": str(DEFAULT_PORT)})
    assert str(e.value) == (
        f"MASTER_PORT={DEFAULT_PORT} is in use on 127.0.0.1 (another process holds it), so rank 0 could not serve the "
        "rendezvous there: unset MASTER_PORT to take a free port, or set it to one free here (`python -m "
        "training.resilience.ports` prints one)"
    )
    assert master_port({"MASTER_PORT": str(DEFAULT_PORT)}, host="192.0.2.1") == (DEFAULT_PORT, "from MASTER_PORT")


def test_every_launch_passes_a_port():
    """DeepSpeed's launcher ignores MASTER_PORT: each launch in the shell scripts passes --master_port, the port
    from training/resilience/ports.py; deepspeed_command without a port passes a free one."""
    for script in SHELL_LAUNCHERS:
        with open(os.path.join(REPO, script)) as f:
            text = f.read()
        assert "--master_port" in text and "-m training.resilience.ports --who" in text, script
    cmd = deepspeed_command(2, "train.py", [])
    port = int(cmd[cmd.index("--master_port") + 1])
    assert port != DEFAULT_PORT and is_free(port)


@pytest.mark.e2e
def test_the_demo_takes_a_free_port_when_29500_is_taken(default_port_taken):
    """The demo's port line, run as the demo runs it (the whole demo takes minutes): a free port, said on stderr;
    MASTER_PORT when set."""
    with open(os.path.join(REPO, "scripts", "demo.sh")) as f:
        line = next(x for x in f if x.startswith("PORT="))

    def demo_port(env: dict) -> subprocess.CompletedProcess:
        script = f'PY=.venv/bin/python\n{line}echo "$PORT"'
        return subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    env = {k: v for k, v in child_env().items() if k != "MASTER_PORT"}
    proc = demo_port(env)
    chosen = re.fullmatch(FREE_LINE.format(who="demo") + "\n", proc.stderr)
    assert proc.returncode == 0 and chosen, proc.stderr
    assert proc.stdout == f"{chosen.group(1)}\n" and int(chosen.group(1)) != DEFAULT_PORT
    proc = demo_port({**env, "MASTER_PORT": "29652"})
    assert (proc.stdout, proc.stderr) == ("29652\n", "[demo] master port 29652 (from MASTER_PORT)\n")


RENDEZVOUS = """import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} port {os.environ['MASTER_PORT']} sum {t.item():.0f}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.multirank
def test_deepspeed_launch_without_a_port_meets_when_29500_is_taken(default_port_taken, tmp_path):
    """DeepSpeed's real launcher, as the benchmark scripts call it without a port (bench_data.py, bench_reshard.py):
    its two ranks meet on a free port."""
    script = tmp_path / "rendezvous.py"
    script.write_text(RENDEZVOUS)
    cmd = deepspeed_command(2, str(script), [])
    port = int(cmd[cmd.index("--master_port") + 1])
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    finally:
        remove_shm_leftovers(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(re.findall(r"rank \d port \d+ sum \d", proc.stdout)) == [
        f"rank {r} port {port} sum 2" for r in range(2)
    ]


@pytest.mark.e2e
def test_multinode_scripts_choose_a_port_on_node_0_or_ask_for_one(tmp_path):
    """train_slurm.sbatch (run by SLURM on node 0) picks a port free there and gives every node's launcher the same;
    launch_hostfile.sh asks for MASTER_PORT where it cannot choose: one node of several, or MASTER_ADDR elsewhere."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(), out.mkdir()
    write_executable(str(bin_dir / "srun"), FAKE_SRUN)
    write_executable(str(bin_dir / "scontrol"), FAKE_SCONTROL)
    write_executable(str(bin_dir / "deepspeed"), STUB_LAUNCHER)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        STUB_OUT=str(out),
        DEEPSPEED=str(bin_dir / "deepspeed"),
        HOSTFILE=str(tmp_path / "hostfile"),
        SLURM_SUBMIT_DIR=REPO,
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-a[01-02]",
        SLURM_NNODES="2",
    )
    # node 0 is 127.0.0.1 here (the stand-in allocation's host names are not this machine's)
    proc = subprocess.run(["bash", SBATCH], env={**env, "MASTER_ADDR": "127.0.0.1"}, capture_output=True, text=True)
    chosen = re.search(FREE_LINE.format(who="train_slurm"), proc.stderr)
    assert proc.returncode == 0 and chosen, proc.stdout + proc.stderr
    for node in range(2):
        argv = json.loads((out / f"node{node}.json").read_text())["argv"]
        assert argv[argv.index("--master_port") + 1] == chosen.group(1)
    proc = subprocess.run(["bash", SBATCH], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and (
        "train_slurm: error: MASTER_ADDR gpu-a01 is not an address of this machine" in proc.stderr
    ), proc.stderr
    proc = subprocess.run(["bash", LAUNCH], env={**env, "NODE_RANK": "1"}, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == (
        "launch_hostfile.sh: error: NODE_RANK=1 without MASTER_PORT: set MASTER_PORT, the same on every node, to a "
        "port free on MASTER_ADDR gpu-a01 (`.venv/bin/python -m training.resilience.ports` run there prints one)\n"
    )
