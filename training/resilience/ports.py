"""The master port of a launch: where rank 0 serves the rendezvous.

DeepSpeed's launcher uses 29500 unless given ``--master_port`` (it ignores ``MASTER_PORT``), and on a shared machine
another job may hold 29500. So every launch here passes a port: the one the user gave (``MASTER_PORT``; refused at
once when another process holds it on this machine), else one the OS says is free now. The shell scripts
(scripts/demo.sh, scripts/multinode/) ask ``python -m training.resilience.ports``, which prints the port and says on
stderr where it came from. Standard library only: a script calls it in
a fraction of a second, before any rank imports torch.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys


class PortError(ValueError):
    """No port can be chosen as asked; the message says what to set."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` (an address of this machine) now, chosen by the OS: for a job's master port,
    since a fixed one collides with other jobs on a shared machine."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_taken(host: str, port: int) -> str | None:
    """Why ``port`` cannot be bound on ``host`` when that is this machine (words to follow the port: another process
    listens on it, or a port below 1024 without root), else None: free, or ``host`` is another machine's, which
    cannot be checked from here. A port left in TIME_WAIT counts as free, as the rendezvous reuses such addresses."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"is in use on {host} (another process holds it)"
            if e.errno == errno.EACCES:
                return f"cannot be bound on {host} ({e.strerror}: a port below 1024 needs root)"
    return None


def master_port(environ: dict | None = None, host: str = "127.0.0.1") -> tuple[int, str]:
    """(port, where it came from): ``MASTER_PORT`` when set (refused when ``host`` is this machine and the port cannot
    be bound there: the rendezvous would fail after the launch), else a port free on ``host``, which must be this
    machine (a free port elsewhere cannot be chosen from here)."""
    given = (os.environ if environ is None else environ).get("MASTER_PORT", "").strip()
    if given:
        if not given.isdigit() or not 0 < int(given) < 65536:
            raise PortError(f"MASTER_PORT={given!r} is not a TCP port: set it to a number in 1-65535, or unset it")
        taken = port_taken(host, int(given))
        if taken:
            raise PortError(
                f"MASTER_PORT={given} {taken}, so rank 0 could not serve the rendezvous there: unset MASTER_PORT to "
                "take a free port, or set it to one free here (`python -m training.resilience.ports` prints one)"
            )
        return int(given), "from MASTER_PORT"
    try:
        port = free_port(host)
    except OSError as e:  # not an address of this machine (EADDRNOTAVAIL), or not a host name at all
        raise PortError(
            f"MASTER_ADDR {host} is not an address of this machine ({e.strerror or e}), so no port free there can be "
            "chosen here: set MASTER_PORT to a port free on it (`python -m training.resilience.ports` run there prints "
            "one)"
        ) from None
    return port, "free on this machine; MASTER_PORT=PORT chooses one"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print the master port of a launch: MASTER_PORT, else a free one.")
    p.add_argument("--who", default="ports", help="the script asking, which starts the line on stderr")
    p.add_argument("--host", default="127.0.0.1", help="the master address the port must be free on")
    args = p.parse_args(argv)
    try:
        port, source = master_port(host=args.host)
    except PortError as e:
        print(f"{args.who}: error: {e}", file=sys.stderr)
        return 2
    print(f"[{args.who}] master port {port} ({source})", file=sys.stderr)
    print(port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
