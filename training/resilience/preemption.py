"""What a shared cluster asks of the training loop: stop on a signal with a checkpoint, and save on the clock.

SLURM signals a job ahead of its time limit or a preemption (``--signal=USR1@300``; SIGTERM at the end).
Every rank catches SIGTERM and SIGUSR1; the signal may reach one rank or all. After each step the ranks
agree in one all-reduce (``StopAndSave.after_step``) whether any rank was signalled and whether the
``save_every_minutes`` clock (rank 0's) is due, so all ranks save, and stop, after the same step. A stopped
run's checkpoint is complete (``latest`` is written after every rank's files) and the process exits with
``PREEMPTED_EXIT_CODE``; ``resume=auto`` continues it exactly.

A second signal, or no agreement within ``preempt_grace_s`` of the first (a rank stuck in a collective, a
step longer than the grace), exits at once with ``UNSAVED_EXIT_CODE``: the last complete checkpoint is
untouched (a save in progress never moved ``latest``), and ``resume=auto`` continues from it. So does SIGINT
(Ctrl-C), and any of these during start-up (``stop_at_once_on_signals``: nothing trained yet to save). The first
rank of the job to exit at once says why and writes ``output_dir/.stopping``; its peers, ended by the launcher
or failing in a collective with it, exit with the same code quietly (``exit_if_exiting``).

Only the ranks act on signals: DeepSpeed's ``deepspeed`` command dies of SIGUSR1 or SIGTERM without forwarding
them. Ranks started by DeepSpeed's launcher watch it: once it is gone, they stop as on a stop signal
(docs/checkpoints.md#which-process-to-signal).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from training.resilience.all_ranks import release_cpu_comm_buffer

PREEMPTED_EXIT_CODE = 75  # BSD's EX_TEMPFAIL: saved, stopped, resume to continue (requeue)
UNSAVED_EXIT_CODE = 76  # stopped without saving this step: resume continues from the last complete checkpoint
STOP_SIGNALS = ("SIGTERM", "SIGUSR1")
STOPPING_FILE = ".stopping"  # in output_dir: a link to the exit code of the job's first rank to exit at once
_exiting: list[
    int
] = []  # set when this rank is already on its way out (training/resilience/hang.py): signals end it quietly
_job: dict = {"marker": None, "cleanup": [], "handler": None, "watching": False, "peers": None}


def exit_quietly_on_signals(code: int) -> None:
    """From now on a stop signal ends this rank at once with ``code``, saying nothing (it is exiting anyway)."""
    _exiting.append(code)


def peers_exiting() -> int | None:
    """The exit code when this rank, or another rank of the job (``output_dir/.stopping``), is on its way out."""
    if _exiting:
        return _exiting[0]
    marker = _job["marker"]
    if marker and os.path.lexists(marker):
        try:
            if os.path.islink(marker):  # _first_to_exit's: the code is the link's target
                return int(os.readlink(marker))
            with open(marker) as f:
                return int(f.read().strip() or UNSAVED_EXIT_CODE)
        except (OSError, ValueError):
            return UNSAVED_EXIT_CODE
    return None


def exit_now(code: int) -> None:
    """End this rank at once with ``code``: rank 0's output_dir lock released (a requeued job on another node
    would otherwise wait for its heartbeat to go stale), the CPU accelerator's /dev/shm segment removed (66 MB a
    rank, left behind otherwise), output flushed, no teardown."""
    for cleanup in (*_job["cleanup"], release_cpu_comm_buffer):
        try:
            cleanup()
        except Exception:  # noqa: BLE001 (exiting anyway)
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_if_exiting() -> None:
    """Called with an exception in hand: a rank whose job is already on its way out (its peers gone first: a hang,
    or a peer that exited at once on a signal) exits quietly with the job's code instead of a traceback."""
    code = peers_exiting()
    if code is not None:
        exit_now(code)


def _first_to_exit(code: int) -> bool:
    """Marks this rank, and the job (``output_dir/.stopping``), as exiting with ``code``; True for the job's first
    rank to do so, which says why: its peers, signalled too or failing in a collective with it, exit quietly."""
    _exiting.append(code)
    marker = _job["marker"]
    if marker is None:
        return True
    try:
        # A symbolic link to the code: made at once with its code (a peer never reads it empty), and on a full
        # disk too (no data block to write; a file's write of the code fails there, and its peers said 76).
        os.symlink(str(code), marker)
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def mark_exiting(code: int = 1) -> None:
    """This rank is failing with an error of its own (its traceback follows): its peers, failing in a collective
    with it or ended by the launcher, exit quietly."""
    _first_to_exit(code)


def last_checkpoint() -> str:
    """What a run ended at once resumes from: ``latest names global_step4 (resume=auto continues from it)``."""
    marker = _job["marker"]
    if marker is None:
        return "resume=auto continues from the last complete checkpoint"
    output_dir = os.path.dirname(marker)
    tag = _latest(output_dir)
    if tag is None:
        return f"no checkpoint of this run in {output_dir} yet"
    return f"latest names {os.path.join(output_dir, tag)} (resume=auto continues from it)"


def exit_alone(message: str, code: int = 1) -> None:
    """End the job from a rank that failed where its peers cannot learn of it (they wait in a collective, or will):
    the job's first rank to exit at once prints ``train.py: error: <message>``, and the last complete checkpoint;
    its peers, failing in a collective with it or ended by the launcher, exit quietly (``exit_if_exiting``)."""
    if _first_to_exit(code):
        sys.stderr.write(f"train.py: error: {message}; the job stops: {last_checkpoint()}\n")
        sys.stderr.flush()
    exit_now(code)


def record_peers() -> None:
    """Collective, once the process group exists: every rank's (host, pid), so a rank that finds a peer gone can
    name it (``lost_peers``)."""
    if not dist.is_initialized():
        return
    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    _job["peers"] = peers


def lost_peers() -> list[tuple[int, int]]:
    """(rank, pid) of every rank of this job on this node that is no longer running; ranks on other nodes cannot
    be seen from here."""
    import psutil

    host, me = socket.gethostname(), os.getpid()
    lost = []
    for rank, (peer_host, pid) in enumerate(_job.get("peers") or []):
        if peer_host != host or pid == me:
            continue
        try:
            alive = _alive(psutil.Process(pid))
        except psutil.Error:
            alive = False
        if not alive:
            lost.append((rank, pid))
    return lost


PEER_EXIT_S = 2.0  # how long a rank that lost its connection to a peer looks for a process of the job gone
# How a collective fails when a peer is gone: gloo's socket errors, c10d's store and backend errors.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def exit_if_peer_lost(rank: int, error: BaseException | None = None, why: str = "") -> None:
    """This rank's collective failed (``error``) or the launcher stopped it (``why``) with a peer of the job gone
    without a word (``kill -9``, the out-of-memory killer, a crash): the job ends in one line naming the lost rank
    where it ran on this node, else the rank that noticed, and the cause. Returns when no peer is known lost and
    ``error`` is not a lost connection."""
    lost = lost_peers()
    text = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else ""
    gone = isinstance(error, dist.DistError) or any(p in text for p in PEER_GONE)
    if not lost and not gone:
        return
    deadline = time.monotonic() + PEER_EXIT_S  # a killed peer's sockets close before its process is gone
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
        lost = lost_peers()
    # gloo's own line: "[.../pair.cc:537] Read error [127.0.0.1]:58021: Connection reset by peer. This is typically..."
    cause = next((p for p in PEER_GONE if p in text), text[:200]) or why
    if lost:
        names = ", ".join(f"rank {r} (pid {pid})" for r, pid in lost)
        message = (
            f"{names} of this job ended without a word (killed: kill -9, the out-of-memory killer, or a crash); "
            f"rank {rank} noticed: {cause}"
        )
    else:
        message = f"rank {rank} lost a peer of this job (a rank on another node, or its node, is gone): {cause}"
    exit_alone(message)


def exit_unsaved(rank: int, why: str, what: str = " without a checkpoint of this step") -> None:
    """Exit this rank at once with ``UNSAVED_EXIT_CODE``; the job's first rank to do so prints the one line."""
    if _first_to_exit(UNSAVED_EXIT_CODE):
        # one write with its newline: print's two (text, then end) let the launcher's own line land between them
        sys.stderr.write(
            f"[train] rank {rank}: {why}: exiting now{what} (exit code {UNSAVED_EXIT_CODE}); resume=auto continues "
            "from the last complete checkpoint\n"
        )
        sys.stderr.flush()
    exit_now(UNSAVED_EXIT_CODE)


def _latest(output_dir: str) -> str | None:
    """The tag ``output_dir/latest`` names (models.files.pipeline_dir.latest_tag, read here without importing
    DeepSpeed)."""
    try:
        with open(os.path.join(output_dir, "latest")) as f:
            return f.read().strip()
    except OSError:
        return None


def exit_saved(rank: int, why: str, tag: str) -> None:
    """Exit this rank at once with ``PREEMPTED_EXIT_CODE``: checkpoint ``tag`` of the step is complete, though the
    loop had not yet said so. The job's first rank to do so prints the one line."""
    if _first_to_exit(PREEMPTED_EXIT_CODE):
        sys.stderr.write(
            f"[train] rank {rank}: {why}: checkpoint {tag} is complete (latest names it); exiting now (exit code "
            f"{PREEMPTED_EXIT_CODE}); resume=auto continues from it exactly\n"
        )
        sys.stderr.flush()
    exit_now(PREEMPTED_EXIT_CODE)


def clear_stale_marker(output_dir: str) -> None:
    """Rank 0, inside a start-up step every rank waits for: an earlier job's ``.stopping`` is not this job's."""
    try:
        os.unlink(os.path.join(output_dir, STOPPING_FILE))
    except FileNotFoundError:
        pass


def _deliver(name: str) -> None:
    code = peers_exiting()
    if code is not None:  # the job is ending already (a hang, a peer gone at once): the launcher ending this rank
        exit_now(code)
    if name == "SIGTERM":  # DeepSpeed's launcher ending the ranks of a node after one of them died
        exit_if_peer_lost(int(os.environ.get("RANK", "0")), why="stopped by the launcher (SIGTERM)")
    _job["handler"](name)


def _install(handler) -> None:
    """``handler(name)`` gets every stop signal (SIGTERM, SIGUSR1), SIGINT (Ctrl-C) and the launcher's exit."""
    _job["handler"] = handler
    for name in (*STOP_SIGNALS, "SIGINT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), lambda signum, frame: _deliver(signal.Signals(signum).name))
    if not _job["watching"]:
        chain = launcher_chain()
        if chain:
            _job["watching"] = True
            threading.Thread(target=_watch_launcher, args=(chain,), daemon=True, name="launcher-watch").start()


def launcher_chain() -> list:
    """DeepSpeed's launcher processes above this rank: its parent ``deepspeed.launcher.launch`` and, above that,
    the ``deepspeed`` command (runner.py) when it runs on this node; [] under any other launcher."""
    import psutil  # DeepSpeed's own dependency: its launcher uses it

    try:
        parent = psutil.Process().parent()
        if parent is None or "deepspeed.launcher.launch" not in parent.cmdline():
            return []
        chain = [parent]
        runner = parent.parent()
        if runner is not None and any(
            os.path.basename(a) == "deepspeed" or "deepspeed.launcher.runner" in a for a in runner.cmdline()[:3]
        ):
            chain.append(runner)
        return chain
    except psutil.Error:
        return []


def _watch_launcher(chain: list) -> None:
    """SIGUSR1 or SIGTERM sent to the ``deepspeed`` command kills it (DeepSpeed's runner catches neither, and its
    ``launch.py`` catches SIGTERM/SIGINT only to kill the ranks): the ranks would train on, orphaned. A launcher
    gone is taken as a stop signal; local rank 0 of each node says so, once."""
    while all(_alive(p) for p in chain):
        time.sleep(1.0)
    gone = next(p for p in chain if not _alive(p))
    if os.environ.get("LOCAL_RANK", "0") == "0" and peers_exiting() is None:
        print(
            f"[train] the DeepSpeed launcher (pid {gone.pid}) exited before its ranks (a SIGUSR1 or SIGTERM sent to "
            "the deepspeed command kills it, unforwarded): the ranks stop as on a stop signal, and nobody "
            "collects their exit code. Signal the ranks instead (docs/checkpoints.md#which-process-to-signal)",
            file=sys.stderr,
            flush=True,
        )
    _deliver("launcher-exit")


def _alive(process) -> bool:
    """Running, and not a zombie: a dead process its parent has not reaped yet is gone as well."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_at_once_on_signals(output_dir: str, rank: int, cleanup=None) -> None:
    """Start-up, from the moment output_dir exists on every rank (rank 0 has removed an earlier job's
    ``.stopping``) until ``StopAndSave`` takes over in the training loop: nothing trained yet to save, so a stop
    signal, SIGINT or the launcher's exit ends the job at once with ``UNSAVED_EXIT_CODE``, said once, the other
    ranks quiet. ``cleanup`` (rank 0's lock release) runs before any exit at once."""
    _job["marker"] = os.path.join(output_dir, STOPPING_FILE)
    if cleanup is not None:
        _job["cleanup"].append(cleanup)
    record_peers()

    def handler(name: str) -> None:
        exit_unsaved(rank, f"{_said(name)} during start-up, before the first step", ", nothing trained yet to save")

    _install(handler)


def _said(name: str) -> str:
    if name == "launcher-exit":
        return "the DeepSpeed launcher exited"
    return "SIGINT (Ctrl-C)" if name == "SIGINT" else name


class Preempted(Exception):
    """Raised on every rank alike once the checkpoint of the step is saved after a stop signal."""

    def __init__(self, message: str):
        super().__init__(message)


class StopAndSave:
    """The stop-signal handlers of this rank and the per-step agreement of all ranks (see the module)."""

    def __init__(self, save_every_minutes: float, grace_s: float, rank: int, device: str, output_dir: str = ""):
        self.save_every_s, self.grace_s, self.rank, self.device = save_every_minutes * 60, grace_s, rank, device
        self.output_dir = output_dir  # where ``latest`` says whether the checkpoint being saved is complete
        self.saving_tag: str | None = None  # the checkpoint being saved (``saving``)
        self.received: str | None = None
        self.timer: threading.Timer | None = None
        self.last_save = time.monotonic()
        _install(self._handle)

    def _handle(self, name: str) -> None:
        if name == "SIGINT":  # Ctrl-C: at once (DeepSpeed's launch.py sends SIGTERM to the ranks right after)
            self._exit_unsaved("SIGINT (Ctrl-C)", "SIGINT (Ctrl-C)")
        if self.received is not None and self.timer is None:  # the checkpoint after the first is complete
            exit_now(PREEMPTED_EXIT_CODE)
        if self.received is not None and name == "launcher-exit":  # e.g. SLURM's signal reached it too: stopping
            return
        if self.received is not None:
            self._exit_unsaved(
                f"a second {name} arrived", f"a second {name} arrived before the checkpoint was complete"
            )
        self.received = name
        grace = f"preempt_grace_s={self.grace_s:g} of {_said(name)}"
        self.timer = threading.Timer(
            self.grace_s, self._exit_unsaved, [f"{grace} ran out", f"no checkpoint within {grace}"]
        )
        self.timer.daemon = True
        self.timer.start()

    def _exit_unsaved(self, event: str, why: str) -> None:
        """Exit at once on ``event``: as saved when the checkpoint being saved is complete (``latest`` names it; only
        ``saved`` was still to come), otherwise as unsaved, saying ``why``."""
        tag = self.saving_tag
        if tag is not None and self.output_dir and _latest(self.output_dir) == tag:
            exit_saved(self.rank, event, tag)
        exit_unsaved(self.rank, why)

    def saving(self, tag: str) -> None:
        """Checkpoint ``tag`` is being saved: an exit at once before ``saved`` checks whether it is complete."""
        self.saving_tag = tag

    def saved(self) -> None:
        """A checkpoint was written: the clock starts again, and a stop signal's deadline is met."""
        self.snapshot_taken()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def snapshot_taken(self) -> None:
        """A checkpoint was copied to host memory (save_async), not yet written: only the clock starts again."""
        self.last_save = time.monotonic()
        self.saving_tag = None  # not this step's any more, if a stop signal comes

    def after_step(self, compute_s: float = 0.0, writing: bool = False) -> tuple[list[int], bool, list[float], int]:
        """Collective, every rank after each step: (ranks that received a stop signal, whether rank 0's
        save_every_minutes clock is due, every rank's ``compute_s``: training/observation/straggler.py, how many ranks'
        checkpoint writers are still ``writing``: training/checkpoints/async_save.py), the same on every rank."""
        world = dist.get_world_size()
        values = torch.zeros(2 * world + 2, dtype=torch.float64, device=self.device)  # [2W+2]: each rank's slots
        values[self.rank] = float(self.received is not None)
        values[world + 1 + self.rank] = compute_s
        values[2 * world + 1] = float(writing)
        if self.rank == 0 and self.save_every_s > 0:
            values[world] = float(time.monotonic() - self.last_save >= self.save_every_s)
        dist.all_reduce(values)
        values = values.tolist()
        return (
            [r for r in range(world) if values[r]],
            bool(values[world]),
            values[world + 1 : 2 * world + 1],
            round(values[2 * world + 1]),
        )
