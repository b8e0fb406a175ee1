"""Start the ranks of one node on this machine, as ``deepspeed --num_gpus N script args`` starts them.

Tests and benchmarks launch train.py and the scripts about a hundred times. Each rank of each launch
used to import torch, DeepSpeed and transformers itself: 5-6 s of CPU per rank, four ranks on two
cores, for runs whose training takes a second. ``Launcher`` keeps one process that has imported them
(a fork server, as multiprocessing's ``forkserver`` start method is) and forks each rank from it: the
rank is a fresh process that has done nothing but import, with its own environment, arguments, output
files and exit status, and runs the script as ``python -u script`` would (``runpy`` as ``__main__``).
A launch whose environment differs in a variable read at import time (thread counts, the accelerator, Hugging
Face's settings) is forked from a server started with its values; ``fork=False`` starts fresh interpreters.

``deepspeed`` itself (the launcher and its runner) is not used here: it imports DeepSpeed twice before
any rank starts. Tests of what the launcher itself does run the real command.
"""

from __future__ import annotations

import ast
import atexit
import gc
import glob
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from training.resilience.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Variables read when torch, DeepSpeed or transformers are imported: each set of their values has a server of
# its own (Launcher.server_for).
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "DS_", "TORCH", "HF_", "TRANSFORMERS", "PYTHON", "CUDA", "LD_", "KMP_")
# What DeepSpeed's launcher sets per rank: not part of the server's own environment.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")
RANK_VARIABLES += ("LOCAL_SIZE",)
# What the server imports before it forks: the modules the entry points import (not the entry points
# themselves: their top-level code reads the arguments and sets the environment, so it runs in each rank),
# and DeepSpeed's Muon optimizer, which its optimizer check imports and which calls torch.compile at import:
# 3 s a rank.
PRELOAD_SCRIPTS = ("train.py",)
PRELOAD = ("deepspeed.runtime.zero.muon.muon_optimizer", "peft")


def deepspeed_command(num_ranks: int, script: str, args: list[str], port: int | None = None) -> list[str]:
    """``deepspeed --num_gpus N --master_port P script args``: DeepSpeed's launcher of this environment. Without
    ``port``, one free now: the launcher's own default, 29500, may be another job's (training/resilience/ports.py)."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(num_ranks)]
    return cmd + ["--master_port", str(free_port() if port is None else port), script, *args]


def remove_shm_leftovers(port: int) -> list[str]:
    """Remove the /dev/shm segments that the ranks of a job on ``port`` left (DeepSpeed's CPU shm collectives
    leave 66 MB per rank; train.py removes its own, training/resilience/all_ranks.py, but scripts and killed ranks do
    not); returns their paths."""
    found = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")
    for path in found:
        os.remove(path)
    return found


class ForkedProcess:
    """A process the fork server started, with ``subprocess.Popen``'s ``poll``/``wait``/``terminate``/``kill``."""

    def __init__(self, server: "_Server", pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.call(op="poll", pid=self.pid)["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.server.call(op="signal", pid=self.pid, sig=int(sig))

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """The client side of one fork server: a child process reading one JSON request per line."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "tools.launch", "--serve"],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.proc.stdout.readline()
        if ready.strip() != '{"ready": true}':
            raise RuntimeError(f"the fork server did not start: {ready!r}")

    def call(self, **request) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())

    def spawn(self, argv: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> ForkedProcess:
        reply = self.call(op="spawn", argv=argv, env=env, cwd=cwd, stdout=stdout, stderr=stderr)
        return ForkedProcess(self, reply["pid"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


class Launcher:
    """Starts processes of ``python -u script args`` from a fork server when it may, else as fresh interpreters.

    One server per set of the variables read at import (``IMPORT_TIME_PREFIXES``): a launch is forked from the
    server started with exactly its values, the first launch of new values starting one (at most
    ``MAX_SERVERS``; beyond them, fresh interpreters)."""

    MAX_SERVERS = 4

    def __init__(self, fork: bool = True):
        self.fork = fork
        self._servers: dict[tuple, _Server] = {}

    def server_for(self, env: dict) -> "_Server | None":
        """The fork server whose imports saw ``env``'s import-time variables; None: start fresh interpreters."""
        if not self.fork:
            return None
        key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)))
        if key not in self._servers:
            if len(self._servers) >= self.MAX_SERVERS:
                return None
            server = _Server({k: v for k, v in env.items() if k not in RANK_VARIABLES})
            atexit.register(server.close)
            self._servers[key] = server
        return self._servers[key]

    def start(self, script: str, args: list[str], env: dict, stdout, stderr, cwd: str = REPO):
        """``python -u script args`` with ``env``, its output appended to the open files ``stdout``/``stderr``."""
        server = self.server_for(env)
        if server is not None:
            return server.spawn([script, *args], env, cwd, _path_of(stdout), _path_of(stderr))
        return subprocess.Popen([sys.executable, "-u", script, *args], cwd=cwd, env=env, stdout=stdout, stderr=stderr)


def _path_of(f) -> str:
    return f.name if isinstance(getattr(f, "name", None), str) else f"/proc/{os.getpid()}/fd/{f.fileno()}"


# After SIGTERM, how long a rank may take to exit before SIGKILL (DeepSpeed's launcher waits 30 s too).
KILL_AFTER_S = 30.0


class RankJob:
    """The ranks of one node once started: ``ranks`` (each can be polled and signalled, as the processes
    DeepSpeed's launcher starts), ``output()`` so far, and ``wait()`` for the job's status."""

    def __init__(self, launcher: Launcher, num_ranks: int, script: str, args: list[str], env: dict, port: int):
        world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(num_ranks)}
        world.update(CROSS_RANK="0", CROSS_SIZE="1", LOCAL_SIZE=str(num_ranks))
        self.argv, self.port = [script, *args], port
        # The ranks' output interleaved into one stdout and one stderr, as the launcher's children share its own.
        self._out, self._err = tempfile.NamedTemporaryFile("w+"), tempfile.NamedTemporaryFile("w+")
        self.ranks = [
            launcher.start(
                script,
                [f"--local_rank={r}", *args],
                {**env, **world, "RANK": str(r), "LOCAL_RANK": str(r)},
                self._out,
                self._err,
            )
            for r in range(num_ranks)
        ]

    def output(self) -> str:
        """What the ranks have written so far, stdout then stderr."""
        return _read(self._out.name) + _read(self._err.name)

    def wait(self, timeout: float, grace: float, kill_after: float = KILL_AFTER_S) -> subprocess.CompletedProcess:
        """As DeepSpeed's launcher does: once a rank fails, the others get SIGTERM ``grace`` seconds later (and
        SIGKILL ``kill_after`` seconds after that) and the failed rank's status is the job's. Past ``timeout``
        every rank is killed and ``subprocess.TimeoutExpired`` raised."""
        deadline, status, failed_at, terminated = time.time() + timeout, 0, None, False
        while None in [p.poll() for p in self.ranks]:  # every rank polled: a failed one is seen while others run
            failed = [p.returncode for p in self.ranks if p.returncode not in (None, 0)]
            if failed and failed_at is None:
                status, failed_at = failed[0], time.time()
            # The launcher looks once a second, so ranks failing together still print their own error first.
            if failed_at is not None and not terminated and time.time() > failed_at + grace:
                self._signal_running(signal.SIGTERM)
                terminated = True
            if time.time() > deadline or (terminated and time.time() > failed_at + grace + kill_after):
                self._signal_running(signal.SIGKILL)
                for p in self.ranks:
                    p.wait()
                if time.time() > deadline:
                    self._close()
                    raise subprocess.TimeoutExpired(self.argv, timeout)
            time.sleep(0.05)
        status = status or next((p.returncode for p in self.ranks if p.returncode), 0)
        out, err = _read(self._out.name), _read(self._err.name)
        self._close()
        return subprocess.CompletedProcess(self.argv, status, out, err)

    def _signal_running(self, sig: int) -> None:
        for p in self.ranks:
            if p.poll() is None:
                p.send_signal(sig)

    def _close(self) -> None:
        self._out.close()
        self._err.close()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _run_forked(request: dict) -> None:
    """In the forked child: become ``python -u script args`` and exit with its status."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python itself starts
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        code = 1
    _finish()
    os._exit(code)


def _finish() -> None:
    """What the interpreter does at exit: wait for non-daemon threads, run atexit handlers, flush."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass


def imported_modules(script: str) -> list[str]:
    """The modules ``script`` (a path from the repo root) imports at its top level, in order."""
    with open(os.path.join(REPO, script)) as f:
        tree = ast.parse(f.read())
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            names.append(node.module)
    return names


def serve() -> None:
    """The fork server: import what the entry points import, then answer spawn/poll/signal requests."""
    import importlib

    # Replies go through the stdout pipe alone; whatever the imports print goes to stderr.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for name in [*PRELOAD, *(m for script in PRELOAD_SCRIPTS for m in imported_modules(script))]:
        importlib.import_module(name)
    # What the imports made lives as long as the ranks: kept out of the collector's reach, so that a rank's first
    # full collection does not walk (and copy, page by page) the whole imported heap: with it, the second step of a
    # 4-rank launch of the tiny model took 0.7 s instead of 0.07, and each launch about 1 s longer.
    gc.collect()
    gc.freeze()
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "spawn":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(reply.fileno())
                _run_forked(request)
            answer = {"pid": pid}
        elif op == "poll":
            try:
                done, status = os.waitpid(request["pid"], os.WNOHANG)
                code = os.waitstatus_to_exitcode(status) if done else None
            except ChildProcessError:
                code = -1
            answer = {"code": code}
        elif op == "signal":
            try:
                os.kill(request["pid"], request["sig"])
            except ProcessLookupError:
                pass
            answer = {}
        else:
            answer = {"error": f"unknown op {op}"}
        print(json.dumps(answer), file=reply, flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
