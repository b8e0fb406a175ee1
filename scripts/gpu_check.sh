#!/usr/bin/env bash
# The one command to run on a GPU machine, about 9 minutes on one H100/H200 from a bare machine (parity and bench):
#   bash scripts/gpu_check.sh [parity] [bench] [fp8] [levers] [moe] [layouts] [attention] [grpo] (default: parity bench)
# Every step is bounded (`timeout`, and bench_train.py's --time-limit), the most important numbers first;
# BENCH_BUDGET_S (default 400) is the benchmark's share: the shapes it does not reach are said, not run;
# GPU_CHECK_CASES picks bench_train.py's cases (default a,b,bkl,bc,ac), GPU_CHECK_PLAN the shapes (below).
# 1. set-up: .venv-gpu on top of a python3 whose torch sees CUDA (a CUDA torch is installed where it does
#    not); on a machine without a package index, the wheels in .whl/ (tools/gpu_wheels.sh, run where
#    pip reaches PyPI, then carried there) are installed as they are;
# 2. stage parity on the GPU, fp32 and bf16 (tests/test_gpu_parity.py: every family, document attention,
#    each Liger kernel with kernels=liger, Liger's loss with loss_impl=liger), and the multi-rank tests when
#    there are 4 GPUs or more;
# 3. the GPU benchmark (benchmarks/bench_train.py, bf16, cases a: plain Hugging Face loop, ac: the same with its
#    decoder layers compiled, b: train.py num_stages=1, bc: compile=true, bkl: compile=true kernels=liger
#    loss_impl=liger, the issue's (d); bk, bc with kernels=liger alone, where GPU_CHECK_CASES names it):
#    the llama3.2-3b shape at seq 4096 micro-batch 1 first (activation checkpointing on a card under 100 GiB),
#    then llama3.2-1b at seq 2048, micro-batch 4, 2, 1; per case tokens/s, MFU against the card's dense bf16
#    peak (989 TFLOP/s for an H100 SXM or H200) and against the measured matmul rate, peak GPU memory;
# 3''. fp8 (not in the default run; after bench, whose bc and ac it follows, when both are named): train.py compiled
#    in bf16 (bc) against the same with torchao's FP8 linears, fp8=rowwise (bc8r) and fp8=tensorwise (bc8t), on
#    bench's 3B shape (seq 4096, micro-batch 1 x 2, activation checkpointing under 100 GiB); the goal row asks
#    1.2 x bc (issue 61), MFU against the same bf16 dense peak. FP8_BUDGET_S (default 300) for the three, about 5
#    minutes; GPU_CHECK_FP8 picks the cases (default bc,bc8r,bc8t); its table goes to bench.md after bench's
#    (bench_fp8.json). Compute capability >= 8.9 (H100, H200): `bash scripts/gpu_check.sh fp8`, a call of its own;
# 3'. levers (not in the default run): one knob each against train.py eager (b), the 1B at seq 2048, micro-batch 4:
#    bl: loss_impl=liger (Liger's fused linear cross entropy against the chunked loss), bd: adamw_impl=deepspeed
#    (DeepSpeed's FusedAdam against torch's fused AdamW; its CUDA op is JIT-built at start and needs nvcc),
#    LEVERS_BUDGET_S (default 360) for the three; GPU_CHECK_LEVERS picks the cases (default b,bl,bd). About 7
#    minutes: run it as a call of its own, `bash scripts/gpu_check.sh levers` (the set-up is done by then);
# 4. with 2 GPUs or more, benchmarks/bench_layouts.py: pipe x tensor x data layouts of the same GPUs (tensor
#    parallelism's GPU rows: s/step, tokens/s, memory per rank);
# 5. attention over packed rows, one decoder layer at 8k and 32k tokens in bf16: the dense per-document mask
#    against attention=documents (torch's varlen flash attention), memory and time (benchmarks/bench_attention.py).
# 6. grpo: train.py's GRPO (generation on the pipeline's stages) against TRL's GRPOTrainer, the tiny model
#    (benchmarks/bench_grpo.py; pipe 2 x data 1 or 2 where there are 2 or 4 GPUs, else one stage).
# Without a CUDA GPU it stops at once with exit code 2. What it writes: work/gpu_check.log (everything printed),
# work/gpu_check/parity.log, work/gpu_check/bench.md (the tables, BENCHMARKS.md's source) and one bench_*.json per
# shape (bench_levers.json for the levers), and profile_<shape>_<case>.png for the profiled train.py cases (the 3B
# shape's b, bc and bkl; their kernel summaries, and the plain loop's, in bench.md); with $OUT set (the device tool's
# folder) 8 of them are copied there.
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
if [ -d "$ROOT/.whl" ] && ls "$ROOT"/.whl/liger_kernel-*.whl >/dev/null 2>&1 \
  && ! "$PY" -c "import liger_kernel" 2>/dev/null && "$PY" -c "import deepspeed" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps "$ROOT"/.whl/liger_kernel-*.whl  # a venv made before liger was carried
fi
if ! "$PY" -c "import deepspeed, transformers, hydra, sentencepiece" 2>/dev/null && [ -d "$ROOT/.whl" ]; then
  "$PY" -m pip install -q --no-index --no-deps "$ROOT"/.whl/*.whl  # no package index: tools/gpu_wheels.sh made them
elif ! "$PY" -c "import deepspeed, transformers, hydra, sentencepiece" 2>/dev/null; then
  "$PY" -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['dev']))" > "$VENV/pins.txt"
  "${PIP[@]}" -r "$VENV/pins.txt"
fi
"$PY" -c "import torch; print('[gpu_check]', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(), '| torch', torch.__version__)"

mkdir -p work/gpu_check
LOG=work/gpu_check.log
exec > >(tee "$LOG") 2>&1  # everything from here on is also in the log the lead gets back
status=0
STEPS="${*:-parity bench}"
step() { [[ " $STEPS " == *" $1 "* ]]; }
if step parity; then
  echo "[gpu_check] stage parity on the GPU (fp32, bf16): every family, attention=documents, kernels=liger, loss_impl=liger"
  timeout 90 "$PY" -m pytest tests/test_gpu_parity.py -q -m gpu -rs --durations=5 2>&1 | tee work/gpu_check/parity.log \
    || status=1
fi
if step parity && [ "$GPUS" -ge 4 ]; then
  echo "[gpu_check] multi-rank tests on $GPUS GPUs"
  timeout 300 "$PY" -m pytest tests -q -m multirank || status=1
fi
if step bench; then
  MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  ckpt=""
  [ "${MEM_MIB:-0}" -lt 102400 ] && ckpt="--checkpointing"  # 3B at seq 4096 without recomputation: ~90 GB
  budget=${BENCH_BUDGET_S:-400}
  start=$SECONDS
  : > work/gpu_check/bench.md
  # name | model | seq | micro-batch size | micro-batches per step | seconds at most | extra options, one line per
  # table, in order; GPU_CHECK_PLAN replaces it (the same lines)
  # one shape's five cases take about 6 minutes (train.py's start-up of a 1B model from random weights alone took over
  # 50 s on an H200, each compiled case adds its compile time): the 3B shape first (the issue's 40% MFU goal), its
  # runs profiled at their last step (train.py's b, bc and bkl, the plain loop's a and ac: the kernel summaries, and
  # pictures of the train.py steps, follow its table); the others are said
  plan="3b_s4096_mb1|llama3.2-3b|4096|1|2|300|$ckpt --train-arg b,bc,bkl:profile_steps=[6,6] --plain-trace-step 6
1b_s2048_mb4|llama3.2-1b|2048|4|2|300|
1b_s2048_mb2|llama3.2-1b|2048|2|2|300|
1b_s2048_mb1|llama3.2-1b|2048|1|4|300|"
  while IFS='|' read -r name model seq mbs micro share extra; do
    left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 30 ]; then
      echo "[gpu_check] bench $name: not run (BENCH_BUDGET_S=$budget spent: run 'bash scripts/gpu_check.sh bench' with more)"
      echo "### $name: not run (BENCH_BUDGET_S spent)" >> work/gpu_check/bench.md
      continue
    fi
    limit=$((share < left ? share : left))
    echo "[gpu_check] bench $name: $model, bf16, seq $seq, micro-batch $mbs x $micro per step, $limit s at most ${extra}"
    echo "### $name ($model, seq $seq, micro-batch $mbs x $micro per step ${extra})" >> work/gpu_check/bench.md
    # shellcheck disable=SC2086  # $extra: zero or more options
    timeout $((limit + 30)) "$PY" benchmarks/bench_train.py --model "$model" --precision bf16 --seq "$seq" \
      --micro-batch-size "$mbs" --micro-batches "$micro" --cases "${GPU_CHECK_CASES:-a,b,bkl,bc,ac}" --rounds 1 --warmup 2 --steps 4 \
      --threads 8 --max-wait 0 --time-limit "$limit" --json "work/gpu_check/bench_$name.json" --table work/gpu_check/table.md \
      --work work/gpu_check $extra || status=1
    cat work/gpu_check/table.md >> work/gpu_check/bench.md 2>/dev/null || echo "(no table)" >> work/gpu_check/bench.md
    rm -f work/gpu_check/table.md
    for run in work/gpu_check/run_*/out; do  # a case profiled (profile_steps in the plan's options): where time goes
      [ -d "$run/profile" ] || continue
      case_name=$(basename "$(dirname "$run")")
      echo "[gpu_check] profile of $name ${case_name#run_}: scripts/plot_timeline.py"
      { echo "#### $name ${case_name#run_}: the profiled step (scripts/plot_timeline.py)"; echo '```'
        timeout 120 "$PY" scripts/plot_timeline.py "$run" --out "work/gpu_check/profile_${name}_${case_name#run_}.png" \
          || status=1
        echo '```'; } 2>&1 | tee -a work/gpu_check/bench.md
      rm -rf "$run/profile"
    done
  done <<< "${GPU_CHECK_PLAN:-$plan}"
  echo "[gpu_check] the benchmark tables (work/gpu_check/bench.md):"
  cat work/gpu_check/bench.md
fi
if step fp8; then  # torchao's FP8 linears against train.py compiled in bf16, the 3B shape (issue 61)
  fp8_budget=${FP8_BUDGET_S:-300}
  step bench || : > work/gpu_check/bench.md
  if ! "$PY" -c "import torchao" 2>/dev/null; then  # a venv made before torchao was a pin
    "${PIP[@]}" "$(grep -o 'torchao==[0-9.]*' pyproject.toml)"
  fi
  MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  ckpt=""
  [ "${MEM_MIB:-0}" -lt 102400 ] && ckpt="--checkpointing"  # as bench's 3B shape
  echo "[gpu_check] fp8: llama3.2-3b, bf16, seq 4096, micro-batch 1 x 2, ${GPU_CHECK_FP8:-bc,bc8r,bc8t} $ckpt"
  echo "### fp8 (llama3.2-3b, seq 4096, micro-batch 1 x 2 per step $ckpt)" >> work/gpu_check/bench.md
  # shellcheck disable=SC2086  # $ckpt: zero or one option
  timeout $((fp8_budget + 30)) "$PY" benchmarks/bench_train.py --model llama3.2-3b --precision bf16 --seq 4096 \
    --micro-batch-size 1 --micro-batches 2 --cases "${GPU_CHECK_FP8:-bc,bc8r,bc8t}" --rounds 1 --warmup 2 --steps 4 \
    --threads 8 --max-wait 0 --time-limit "$fp8_budget" --json work/gpu_check/bench_fp8.json \
    --table work/gpu_check/table.md --work work/gpu_check $ckpt || status=1
  cat work/gpu_check/table.md >> work/gpu_check/bench.md 2>/dev/null || echo "(no table)" >> work/gpu_check/bench.md
  rm -f work/gpu_check/table.md
fi
if step levers; then  # one knob at a time against b: Liger's loss (bl), DeepSpeed's FusedAdam (bd)
  levers=${LEVERS_BUDGET_S:-360}
  step bench || step fp8 || : > work/gpu_check/bench.md
  echo "[gpu_check] levers: llama3.2-1b, bf16, seq 2048, micro-batch 4 x 2 per step, ${GPU_CHECK_LEVERS:-b,bl,bd}, $levers s at most"
  echo "### levers (llama3.2-1b, seq 2048, micro-batch 4 x 2 per step)" >> work/gpu_check/bench.md
  timeout $((levers + 30)) "$PY" benchmarks/bench_train.py --model llama3.2-1b --precision bf16 --seq 2048 \
    --micro-batch-size 4 --micro-batches 2 --cases "${GPU_CHECK_LEVERS:-b,bl,bd}" --rounds 1 --warmup 2 --steps 3 \
    --threads 8 --max-wait 0 --time-limit "$levers" --json work/gpu_check/bench_levers.json \
    --table work/gpu_check/table.md --work work/gpu_check || status=1
  cat work/gpu_check/table.md >> work/gpu_check/bench.md 2>/dev/null || echo "(no table)" >> work/gpu_check/bench.md
  rm -f work/gpu_check/table.md
fi
if step moe; then  # a MoE model's GPU row (issue 44): expert parallelism needs 2 GPUs or more, so ep 1 on one
  eps=1
  [ "$GPUS" -ge 2 ] && eps=1,2
  [ "$GPUS" -ge 4 ] && eps=1,2,4
  echo "[gpu_check] MoE: Qwen3-MoE 0.6 B (16 experts of 1024, top 2), bf16 ZeRO-1, seq 2048, expert_parallel $eps"
  timeout 120 "$PY" benchmarks/bench_moe.py --gpus "$(( GPUS < 4 ? GPUS : 4 ))" --eps "$eps" --precision bf16 --ds zero1 \
    --hidden 1024 --layers 8 --experts 16 --moe-intermediate 1024 --vocab 32000 --seq 2048 --grad-accum 4 --steps 6 \
    --warmup 2 --work-dir work/gpu_check/moe 2>&1 | grep -v "^\[convert\]" | tee work/gpu_check/moe.md || status=1
fi
if step layouts && [ "$GPUS" -ge 2 ]; then  # tensor parallelism's GPU rows: pipe x tensor x data layouts of the same GPUs
  n=2 layouts="2x1,1x2,1x1"
  [ "$GPUS" -ge 4 ] && n=4 layouts="4x1,2x2,1x4,1x1"
  echo "[gpu_check] layouts on $n GPUs: $layouts (bf16, 1.3 B parameters, seq 2048)"
  timeout 300 "$PY" benchmarks/bench_layouts.py --gpus "$n" --layouts "$layouts" --precision bf16 --hidden-size 2048 \
    --intermediate-size 8192 --num-hidden-layers 16 --num-attention-heads 16 --num-key-value-heads 8 \
    --vocab-size 32000 --seq 2048 --global-batch 16 || status=1
fi
if step attention; then
  echo "[gpu_check] attention over packed rows (one layer, bf16, documents of 1024 tokens)"
  timeout 60 "$PY" benchmarks/bench_attention.py --seqs 8192,32768 --dtype bf16 --hidden 1024 --heads 16 || status=1
  timeout 60 "$PY" benchmarks/bench_attention.py --seqs 32768 --dtype bf16 --hidden 1024 --heads 16 --doc 8192 \
    --window 4096 || status=1
fi
if step grpo; then s=$(( GPUS >= 2 ? 2 : 1 )); timeout 300 "$PY" benchmarks/bench_grpo.py --stages "$s" \
  --gpus "$(( GPUS >= 4 ? 4 : s ))" --work-dir work/gpu_check/grpo || status=1; fi
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then  # the device tool's folder: these come back to the lead (7 files at most)
  n=0  # the tool brings back 8 files at most: the most useful first
  for f in work/gpu_check/bench.md "$LOG" work/gpu_check/parity.log work/gpu_check/profile_*.png \
    work/gpu_check/moe.md work/gpu_check/bench_*.json; do
    [ -f "$f" ] && [ "$n" -lt 8 ] && cp -f "$f" "$OUT"/ && n=$((n + 1))
  done
  echo "[gpu_check] copied to $OUT: $(ls "$OUT" | tr '\n' ' ')"
fi
echo "[gpu_check] done in $SECONDS s, exit $status"
exit $status
