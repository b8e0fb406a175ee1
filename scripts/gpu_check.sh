#!/usr/bin/env bash
# The one command to run on a GPU machine:
#   bash scripts/gpu_check.sh [parity] [bench] [layouts] [attention]    (no step named: all of them)
# 1. set-up: .venv-gpu on top of a python3 whose torch sees CUDA (a CUDA torch is installed where it does
#    not); on a machine without a package index, the wheels in .whl/ (scripts/gpu_wheels.sh, run where
#    pip reaches PyPI, then carried there) are installed as they are;
# 2. stage parity on the GPU, fp32 and bf16 (tests/test_gpu_parity.py), and the multi-rank tests when
#    there are 4 GPUs or more (they launch 4 ranks);
# 3. the GPU benchmark: llama3.2-1b, bf16, seq 2048 (scripts/bench_train.py: a plain Hugging Face loop and
#    train.py with num_stages=1; num_stages=2 with 2 GPUs or more): one table with tokens/s, MFU and the
#    largest rank's peak GPU memory per case;
# 4. with 2 GPUs or more, scripts/bench_layouts.py: pipe x tensor x data layouts of the same GPUs (tensor
#    parallelism's GPU rows: s/step, tokens/s, memory per rank);
# 5. attention over packed rows, one decoder layer at 8k and 32k tokens in bf16: the dense per-document mask
#    against attention=documents (torch's varlen flash attention), memory and time (scripts/bench_attention.py).
# Without a CUDA GPU it stops at once with exit code 2.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${GPUS:-0}" -eq 0 ]; then
  echo "gpu_check.sh: error: no CUDA GPU on this machine (nvidia-smi lists none): run it where there is one" >&2
  exit 2
fi
VENV="${VENV:-$ROOT/.venv-gpu}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv --system-site-packages "$VENV"
  # python3 may itself be a virtualenv holding the CUDA torch (GPU images often are), whose packages
  # --system-site-packages does not reach: its site-packages follow the venv's own on the path.
  python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
    > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/outer.pth"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)
[ -d "$ROOT/.whl" ] && PIP+=(--no-index --find-links "$ROOT/.whl")
if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  "${PIP[@]}" torch
fi
if ! "$PY" -c "import deepspeed, transformers, hydra, sentencepiece" 2>/dev/null && [ -d "$ROOT/.whl" ]; then
  "$PY" -m pip install -q --no-index --no-deps "$ROOT"/.whl/*.whl  # no package index: scripts/gpu_wheels.sh made them
elif ! "$PY" -c "import deepspeed, transformers, hydra, sentencepiece" 2>/dev/null; then
  "$PY" -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['dev']))" > "$VENV/pins.txt"
  "${PIP[@]}" -r "$VENV/pins.txt"
fi
"$PY" -c "import torch; print('[gpu_check]', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(), '| torch', torch.__version__)"

mkdir -p work/gpu_check
status=0
STEPS="${*:-parity bench layouts attention}"
step() { [[ " $STEPS " == *" $1 "* ]]; }
if step parity; then
echo "[gpu_check] stage parity on the GPU (fp32, bf16), attention=documents against the dense mask"
"$PY" -m pytest tests/test_gpu_parity.py -q -m gpu || status=1
fi
if step parity && [ "$GPUS" -ge 4 ]; then
  echo "[gpu_check] multi-rank tests on $GPUS GPUs"
  "$PY" -m pytest tests -q -m multirank || status=1
fi
cases="a,b"
[ "$GPUS" -ge 2 ] && cases="a,b,c"
if step bench; then
echo "[gpu_check] benchmark: llama3.2-1b, bf16, seq 2048, cases $cases"
"$PY" scripts/bench_train.py --model llama3.2-1b --precision bf16 --seq 2048 --micro-batches 8 --cases "$cases" \
  --rounds 1 --json work/gpu_check/bench.json --work work/gpu_check | tee work/gpu_check.log || status=1
fi
if step layouts && [ "$GPUS" -ge 2 ]; then  # tensor parallelism's GPU rows: pipe x tensor x data layouts of the same GPUs
  n=2 layouts="2x1,1x2,1x1"
  [ "$GPUS" -ge 4 ] && n=4 layouts="4x1,2x2,1x4,1x1"
  echo "[gpu_check] layouts on $n GPUs: $layouts (bf16, 1.3 B parameters, seq 2048)"
  "$PY" scripts/bench_layouts.py --gpus "$n" --layouts "$layouts" --precision bf16 --hidden-size 2048 \
    --intermediate-size 8192 --num-hidden-layers 16 --num-attention-heads 16 --num-key-value-heads 8 \
    --vocab-size 32000 --seq 2048 --global-batch 16 | tee -a work/gpu_check.log || status=1
fi
if step attention; then
  echo "[gpu_check] attention over packed rows (one layer, bf16, documents of 1024 tokens)"
  "$PY" scripts/bench_attention.py --seqs 8192,32768 --dtype bf16 --hidden 1024 --heads 16 | tee -a work/gpu_check.log || status=1
  "$PY" scripts/bench_attention.py --seqs 32768 --dtype bf16 --hidden 1024 --heads 16 --doc 8192 --window 4096 \
    | tee -a work/gpu_check.log || status=1
fi
exit $status
