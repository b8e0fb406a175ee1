"""The entry points (train.py's neighbours: convert2ckpt.py, scripts/*.py) run as scripts or loaded in-process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

from tests.support import REPO
from tests.support.ranks import LAUNCH_TIMEOUT_S, LAUNCHER, child_env


def run_script(argv: list[str], env: dict | None = None, timeout: float = LAUNCH_TIMEOUT_S):
    """``python argv`` (a script from the repo root, and its arguments) as ``subprocess.run`` would run it with
    ``cwd=REPO, capture_output=True, text=True``: forked from the session's fork server when ``env`` (by
    default this process's, one thread, the repo on the module path) allows it (tools/launch.py)."""
    env = child_env() if env is None else env
    with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
        proc = LAUNCHER.start(argv[0], list(argv[1:]), env, out, err)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([sys.executable, *argv], code, out.read(), err.read())


def load_entry_point(path: str):
    """An entry-point script (``convert2ckpt.py``, ``scripts/<name>.py``: a path from the repo root) as a module,
    to call its ``main(argv)`` or its own functions in-process. Entry points are scripts, not modules to import:
    nothing else in the repo imports them."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
