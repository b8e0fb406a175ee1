#!/usr/bin/env bash
# Idempotent set-up: creates .venv with the pinned dependencies and builds the DeepSpeed ops a job
# loads, so that no training job compiles them. A second run only checks that the packages are installed
# and the ops built, and returns in a second or two.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
TORCH_VERSION=2.13.0  # the local CPU wheel; any other request pulls GBs of CUDA packages
# One torch-extensions cache per virtualenv (train.py picks the same one, training/startup.py): torch's
# default is shared by every virtualenv of the user, which then rebuild the ops in turn, and a job killed
# mid-build there leaves a lock that hangs every later job.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
ops() { (cd "$ROOT" && "$VENV/bin/python" -m training.startup "$1"); }

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as md, sys
want = {"torch": "2.13.0", "deepspeed": "0.19.8", "transformers": "5.23.0", "hydra-core": "1.3.8"}
for pkg in ["safetensors", "sentencepiece", "protobuf", "pytest", "ninja", "tensorboard", "matplotlib"]:
    md.version(pkg)
sys.exit(any(not md.version(p).startswith(v) for p, v in want.items()))
PY
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
  "$VENV/bin/python" -m pip install -q -r "$ROOT/requirements.txt"
  "$VENV/bin/python" -c "import torch, deepspeed, transformers, hydra; print('[setup] torch', torch.__version__, '| deepspeed', deepspeed.__version__, '| transformers', transformers.__version__, '| hydra', hydra.__version__)"
fi
ops build-ops
