"""Multi-node launch recipes (scripts/multinode/), exercised on one machine.

- Two simulated nodes: ``scripts/multinode/launch_hostfile.sh`` started twice at once, with
  ``NODE_RANK=0`` and ``NODE_RANK=1`` (what each SLURM task of ``train_slurm.sbatch`` runs), i.e.
  ``deepspeed --hostfile H --master_addr 127.0.0.1 --master_port P --no_ssh --node_rank R train.py ...``,
  each starting 2 local CPU ranks (LOCAL_RANK 0..1 on each node, RANK 0..3 overall), train pipe 2 x
  data 2 on fixed data; the per-step losses equal those of the one-node ``deepspeed --num_gpus 4`` run.
  The hostfile's names are labels only: with ``--no_ssh`` DeepSpeed never resolves them.
- ``train_slurm.sbatch`` under a stand-in ``srun``/``scontrol``, with a stand-in launcher that records
  its arguments: one launcher per node, the hostfile from the allocation, the same flags as above.
- ``launch_hostfile.sh`` in pdsh mode through DeepSpeed's real runner, with stand-in ``pdsh``/``ssh``
  that record the command: the environment file reaches the remote command as exports.

On DeepSpeed's CPU accelerator the shared-memory allreduce (one /dev/shm segment per rank) is set up
only when every rank is on one node (WORLD_SIZE == LOCAL_SIZE); two simulated nodes (LOCAL_SIZE 2,
WORLD_SIZE 4) use gloo over loopback only, so the two "nodes" cannot collide on segment names.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from models.files.pipeline_dir import load_layer_file, read_tag
from tests.support import REPO
from tests.support.parity import OPTIM as PARITY_OPTIM
from tests.support.parity import PIPE, STEPS
from tests.support.parity import train_args as parity_train_args
from tests.support.ranks import RANK_ENV
from tests.support.runs import read_metrics
from tools.launch import remove_shm_leftovers
from training.resilience.ports import free_port

LAUNCH = os.path.join(REPO, "scripts", "multinode", "launch_hostfile.sh")
SBATCH = os.path.join(REPO, "scripts", "multinode", "train_slurm.sbatch")
SCRIPTS = (LAUNCH, SBATCH)
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
# fp32 losses of the same layout: the two launches reduce in the same order; the parity tests' bound.
REL_TOL = 1e-6
NODES, RANKS_PER_NODE = 2, 2
# Seconds for both simulated nodes together (measured ~25 s alone on 2 cores): a hang fails the test.
TWO_NODE_TIMEOUT_S = 300
KILL_GRACE_S = 10  # after SIGTERM, before SIGKILL


def train_args(ckpt: str, data: str, out: str) -> list[str]:
    """The parity tests' fp32 fixed-data run as pipe 2 x data 2 (conftest's parity_pipe: global batch 8 =
    micro 2 x grad_acc 2 x dp 2): the same arguments but ``out`` and the tokenized cache beside it."""
    return parity_train_args(ckpt, data, out, **PIPE)


def kill_group(proc: subprocess.Popen) -> None:
    """End a launcher started with start_new_session=True, with every rank it started."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass


def launch_two_nodes(args: list[str], root: str) -> dict:
    """Run launch_hostfile.sh once per simulated node, concurrently; stop both if one fails or time runs out."""
    hostfile = os.path.join(root, "hostfile")
    with open(hostfile, "w") as f:
        f.writelines(f"node{n} slots={RANKS_PER_NODE}\n" for n in range(NODES))
    port = free_port()
    procs, logs = [], []
    start = time.time()
    try:
        for node in range(NODES):
            env = {
                **os.environ,
                **RANK_ENV,
                "HOSTFILE": hostfile,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "NODE_RANK": str(node),
                "DEEPSPEED": DEEPSPEED,
            }
            log_path = os.path.join(root, f"node{node}.log")
            logs.append(log_path)
            with open(log_path, "w") as log:
                procs.append(
                    subprocess.Popen(
                        ["bash", LAUNCH, *args],
                        cwd=REPO,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        timed_out = False
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one node failed: the other would wait for it until the collective timeout
            if time.time() - start > TWO_NODE_TIMEOUT_S:
                timed_out = True
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            kill_group(p)
        segments = [os.path.basename(p) for p in remove_shm_leftovers(port)]  # those of this job's port only
    outputs = []
    for path in logs:
        with open(path) as f:
            outputs.append(f.read())
    return dict(
        returncodes=[p.returncode for p in procs],
        timed_out=timed_out,
        outputs=outputs,
        seconds=time.time() - start,
        shm_segments=segments,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_ckpt, parity_pipe):
    """The one-node run is conftest's parity_pipe (4 ranks, launched and checked to succeed there, shared with
    tests/test_train_parity.py); the two-node run trains the same on its data and the same checkpoint."""
    root = tmp_path_factory.mktemp("multinode")
    one_node_s = parity_pipe["seconds"]
    two = launch_two_nodes(train_args(tiny_ckpt, parity_pipe["data"], str(root / "two")), str(root))
    tails = "\n".join(
        f"--- node {n} (rc {rc}) ---\n{out[-3000:]}"
        for n, (rc, out) in enumerate(zip(two["returncodes"], two["outputs"]))
    )
    assert not two["timed_out"], f"two-node run still running after {TWO_NODE_TIMEOUT_S} s\n{tails}"
    assert two["returncodes"] == [0] * NODES, tails
    print(f"one node: {one_node_s:.1f} s, two simulated nodes: {two['seconds']:.1f} s")
    return dict(root=root, one=parity_pipe["root"] / "pipe", two=two)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.multirank
def test_two_nodes_train_the_same_losses_as_one_node(runs):
    one = read_metrics(str(runs["one"]))
    two = read_metrics(str(runs["root"] / "two"))
    assert [m["step"] for m in two] == [m["step"] for m in one] == list(range(1, STEPS + 1))
    diffs = [rel(t["loss"], o["loss"]) for t, o in zip(two, one)]
    print(f"max relative loss difference, 2 nodes x 2 ranks vs 1 node x 4 ranks: {max(diffs):.2e}")
    assert max(diffs) < REL_TOL, list(zip([t["loss"] for t in two], [o["loss"] for o in one]))
    assert [t["lr"] for t in two] == [o["lr"] for o in one]
    assert len({round(m["loss"], 6) for m in one}) > 1  # the model trained: the loss moved


@pytest.mark.multirank
def test_two_nodes_save_the_same_weights_as_one_node(runs):
    one, two = str(runs["one"]), str(runs["root"] / "two")
    tag = read_tag(two)
    assert tag == read_tag(one) == f"global_step{STEPS}"
    files = sorted(f for f in os.listdir(os.path.join(one, tag)) if f.startswith("layer_"))
    assert files == sorted(f for f in os.listdir(os.path.join(two, tag)) if f.startswith("layer_")) and files
    worst = 0.0
    for name in files:
        a, b = load_layer_file(os.path.join(one, tag, name)), load_layer_file(os.path.join(two, tag, name))
        assert a.keys() == b.keys(), name
        worst = max([worst, *((a[k] - b[k]).abs().max().item() for k in a)])
    print(f"max abs weight difference after {STEPS} steps, 2 nodes vs 1 node: {worst:.2e}")
    # Same reduction order, so measured 0; Adam can turn fp32 rounding noise into weight differences
    # near eps (see test_train_parity), bounded here at 5% of one step's lr.
    assert worst < 0.05 * PARITY_OPTIM["lr"], worst


@pytest.mark.multirank
def test_each_node_launched_its_own_ranks(runs):
    node0, node1 = runs["two"]["outputs"]
    for node, out in enumerate((node0, node1)):
        # the flags train_slurm.sbatch's tasks use, from the shipped script
        assert f"--no_ssh --node_rank {node} train.py" in out
        assert f"nnodes={NODES}, num_local_procs={RANKS_PER_NODE}, node_rank={node}" in out
        # LOCAL_RANK 0..1 on each node
        assert "'--local_rank=0'" in out and "'--local_rank=1'" in out
    # RANK: node 0 holds global ranks 0, 1 and node 1 ranks 2, 3 (the second pipeline stage)
    assert "'node0': [0, 1], 'node1': [2, 3]" in node1
    assert "world 4 = pipe 2 x data 2" in node0
    for rank in range(4):
        assert f"rank {rank}: stage {rank // 2} specs" in node0
    # rank 0 (node 0) logs the steps; node 1's ranks log nothing of their own
    assert sum(line.startswith("step ") for line in node0.splitlines()) == STEPS
    assert not any(line.startswith("step ") for line in node1.splitlines())
    # no shared-memory allreduce across "nodes": DeepSpeed sets it up only when WORLD_SIZE == LOCAL_SIZE
    assert runs["two"]["shm_segments"] == []


def test_scripts_parse():
    for script in SCRIPTS:
        proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert proc.returncode == 0, (script, proc.stderr)
    if shutil.which("shellcheck"):
        proc = subprocess.run(["shellcheck", "-s", "bash", *SCRIPTS], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


def write_executable(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)


# A stand-in for the DeepSpeed launcher: records its arguments, node rank, working directory and the
# environment the ranks would get, in $STUB_OUT/node<NODE_RANK>.json.
# It exits with $STUB_EXIT (0 by default): 75 is a job stopped by a signal with its checkpoint saved.
STUB_LAUNCHER = f"""#!{sys.executable}
import json, os, signal, sys
keys = ("OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "DEEPSPEED_TIMEOUT", "NCCL_DEBUG", "PYTHONUNBUFFERED",
        "MASTER_ADDR", "MASTER_PORT", "HOSTFILE")
record = dict(argv=sys.argv[1:], cwd=os.getcwd(), env={{k: os.environ.get(k) for k in keys}},
              usr1_ignored=signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)
with open(os.path.join(os.environ["STUB_OUT"], "node%s.json" % os.environ["NODE_RANK"]), "w") as f:
    json.dump(record, f)
sys.exit(int(os.environ.get("STUB_EXIT", "0")))
"""

# A stand-in for srun: records its options, then runs the command once per node, concurrently,
# with that node's SLURM_NODEID (as srun --ntasks-per-node=1 does).
FAKE_SRUN = """#!/usr/bin/env bash
opts=()
while [[ "$1" == --* ]]; do opts+=("$1"); shift; done
printf '%s\\n' "${opts[@]}" > "$STUB_OUT/srun_options"
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
if [ "$1 $2" = "requeue 4242" ]; then echo requeued > "$STUB_OUT/requeue"; exit 0; fi
[ "$1 $2 $3" = "show hostnames gpu-a[01-02]" ] || { echo "unexpected: scontrol $*" >&2; exit 1; }
printf 'gpu-a01\\ngpu-a02\\n'
"""


@pytest.mark.e2e
def test_slurm_script_runs_one_launcher_per_node(tmp_path):
    """train_slurm.sbatch as SLURM would run it on node 0, with srun, scontrol and deepspeed stood in for."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(), out.mkdir()
    write_executable(str(bin_dir / "srun"), FAKE_SRUN)
    write_executable(str(bin_dir / "scontrol"), FAKE_SCONTROL)
    write_executable(str(bin_dir / "deepspeed"), STUB_LAUNCHER)
    hostfile = str(tmp_path / "hostfile")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_OUT": str(out),
        "DEEPSPEED": str(bin_dir / "deepspeed"),
        "HOSTFILE": hostfile,
        "GPUS_PER_NODE": "2",
        "SLURM_SUBMIT_DIR": REPO,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-a[01-02]",
        "SLURM_NNODES": "2",
        "SLURM_CPUS_PER_TASK": "16",
        "MASTER_PORT": "29555",  # unset, a port free on node 0 (tests/test_master_port.py)
    }
    for key in ("MASTER_ADDR", "NODE_RANK", "OMP_NUM_THREADS"):
        env.pop(key, None)
    overrides = ["num_stages=4", "data.train_file=my data.jsonl"]  # one with a space: passed through intact
    proc = subprocess.run(
        ["bash", SBATCH, *overrides], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(hostfile) as f:
        assert f.read() == "gpu-a01 slots=2\ngpu-a02 slots=2\n"
    srun_options = (out / "srun_options").read_text().split()
    assert {"--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=16", "--kill-on-bad-exit=1"} <= set(srun_options)
    port = "29555"
    for node in range(2):
        record = json.loads((out / f"node{node}.json").read_text())
        assert record["argv"] == [
            "--hostfile",
            hostfile,
            "--master_addr",
            "gpu-a01",
            "--master_port",
            port,
            "--no_ssh",
            "--node_rank",
            str(node),
            "train.py",
            *overrides,
        ]
        assert record["cwd"] == REPO
        assert record["usr1_ignored"]  # the launchers ignore SLURM's SIGUSR1; train.py's ranks catch it
        assert record["env"] == {
            "OMP_NUM_THREADS": "1",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "DEEPSPEED_TIMEOUT": "30",
            "NCCL_DEBUG": "WARN",
            "PYTHONUNBUFFERED": "1",
            "MASTER_ADDR": "gpu-a01",
            "MASTER_PORT": port,
            "HOSTFILE": hostfile,
        }
    assert not (out / "requeue").exists()
    # A job stopped by a signal (75: saved; 76: not this step) requeues itself; any other failure does not.
    for code, requeued, status in ((75, True, 0), (76, True, 0), (1, False, 1)):
        proc = subprocess.run(
            ["bash", SBATCH, *overrides],
            cwd=str(tmp_path),
            env={**env, "STUB_EXIT": str(code)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == status and (out / "requeue").exists() == requeued, proc.stdout + proc.stderr
        if requeued:
            assert f"stopped by a signal (exit {code}): requeued" in proc.stdout
            (out / "requeue").unlink()


# Stand-ins for pdsh (records its arguments) and ssh (DeepSpeed's reachability check passes).
FAKE_PDSH = f"""#!{sys.executable}
import json, os, sys
with open(os.path.join(os.environ["STUB_OUT"], "pdsh.json"), "w") as f:
    json.dump(sys.argv[1:], f)
"""


@pytest.mark.e2e
def test_pdsh_launch_forwards_the_environment(tmp_path):
    """launch_hostfile.sh without NODE_RANK: DeepSpeed's real runner builds the pdsh command; the
    variables this script sets, and the KEY=VALUE lines of ~/.deepspeed_env (its comments and blank
    lines dropped, which would stop DeepSpeed), become exports of the remote command."""
    bin_dir, out, home = tmp_path / "bin", tmp_path / "out", tmp_path / "home"
    for d in (bin_dir, out, home):
        d.mkdir()
    write_executable(str(bin_dir / "pdsh"), FAKE_PDSH)
    write_executable(str(bin_dir / "ssh"), "#!/bin/sh\nexit 0\n")
    (home / ".deepspeed_env").write_text("# cache of the shared filesystem\n\nHF_HOME=/shared/hf\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=8\nnode1 slots=8\n")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_OUT": str(out),
        "HOME": str(home),
        "HOSTFILE": str(hostfile),
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "29555",
        "DEEPSPEED": DEEPSPEED,
    }
    for key in ("NODE_RANK", "OMP_NUM_THREADS", "DEEPSPEED_TIMEOUT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        env.pop(key, None)
    proc = subprocess.run(
        ["bash", LAUNCH, "num_stages=4"], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = json.loads((out / "pdsh.json").read_text())
    assert argv[argv.index("-w") + 1] == "node0,node1"
    exports = next(a for a in argv if a.startswith("export "))
    for assignment in (
        "OMP_NUM_THREADS=1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "DEEPSPEED_TIMEOUT=30",
        "HF_HOME=/shared/hf",
        "PYTHONUNBUFFERED=1",
    ):
        assert f"export {assignment};" in exports, exports
    assert f"cd {REPO};" in argv
    assert {"--node_rank=%n", "--master_addr=10.1.2.3", "--master_port=29555"} <= set(argv)
    assert argv[-2:] == ["train.py", "num_stages=4"]
