"""The master port of a launch: where rank 0 serves the rendezvous.

DeepSpeed's launcher uses 29500 unless given ``--master_port`` (it ignores ``MASTER_PORT``), and on a shared machine
another job may hold 29500. So every launch here passes a port: the one the user gave (``MASTER_PORT``), else one
the OS says is free now. The shell scripts (scripts/demo.sh, scripts/multinode/) ask ``python -m training.ports``,
which prints the port and says on stderr where it came from. Standard library only: a script calls it in
a fraction of a second, before any rank imports torch.
"""

from __future__ import annotations

import argparse
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


def master_port(environ: dict | None = None, host: str = "127.0.0.1") -> tuple[int, str]:
    """(port, where it came from): ``MASTER_PORT`` when set, else a port free on ``host``, which must be this
    machine (a free port elsewhere cannot be chosen from here)."""
    given = (os.environ if environ is None else environ).get("MASTER_PORT", "").strip()
    if given:
        if not given.isdigit() or not 0 < int(given) < 65536:
            raise PortError(f"MASTER_PORT={given!r} is not a TCP port: set it to a number in 1-65535, or unset it")
        return int(given), "from MASTER_PORT"
    try:
        port = free_port(host)
    except OSError as e:  # not an address of this machine (EADDRNOTAVAIL), or not a host name at all
        raise PortError(
            f"MASTER_ADDR {host} is not an address of this machine ({e.strerror or e}), so no port free there can be "
            "chosen here: set MASTER_PORT to a port free on it (`python -m training.ports` run there prints one)"
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
