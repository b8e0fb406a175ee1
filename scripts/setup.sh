#!/usr/bin/env bash
# Idempotent set-up: creates .venv with the pinned dependencies and builds the DeepSpeed ops a job
# loads, so that no training job compiles them. A second run only checks that the packages are installed
# and the ops built, and returns in a second or two.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
TORCH_VERSION=2.13.0  # the local CPU wheel; any other request pulls GBs of CUDA packages
# One torch-extensions cache per virtualenv (train.py picks the same one, training/resilience/op_build_watch.py): torch's
# default is shared by every virtualenv of the user, which then rebuild the ops in turn, and a job killed
# mid-build there leaves a lock that hangs every later job.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
ops() { (cd "$ROOT" && "$VENV/bin/python" -m training.resilience.op_build_watch "$1"); }

# The pinned requirements, one per line, from pyproject.toml (dependencies + the dev extra).
pins() {
  "$1" - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["dev"]))
PY
}

if [ -x "$VENV/bin/python" ] && pins "$VENV/bin/python" | "$VENV/bin/python" -c "
import importlib.metadata as md, sys
want = dict(line.strip().split('==') for line in sys.stdin if line.strip())
want['torch'] = '$TORCH_VERSION'
sys.exit(any(not md.version(p).startswith(v) for p, v in want.items()))" 2>/dev/null
then
  if ops ops-ready; then
    echo "[setup] $VENV is up to date (DeepSpeed ops built in $TORCH_EXTENSIONS_DIR)"
    exit 0
  fi
else
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, so the dependencies below find it satisfied and pull no CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
  pins "$VENV/bin/python" > "$VENV/pins.txt"
  "$VENV/bin/python" -m pip install -q -r "$VENV/pins.txt"
  "$VENV/bin/python" -c "import torch, deepspeed, transformers, hydra; print('[setup] torch', torch.__version__, '| deepspeed', deepspeed.__version__, '| transformers', transformers.__version__, '| hydra', hydra.__version__)"
fi
ops build-ops
