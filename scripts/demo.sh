#!/usr/bin/env bash
# The main job, on CPU: set up, build a tiny Llama (random weights + a sentencepiece tokenizer trained
# offline on Python's bundled docs), convert it to pipeline stages, train pipe 2 x data 2 on 4 CPU ranks
# on the raw-text corpus (tokenized once into a cache, packed), export to Hugging Face, evaluate the
# export and generate text with it. A second run skips set-up, model building, conversion, tokenization
# and training (the run is already at max_steps; resume=auto finds it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK="${WORK:-work/demo}"
PY=.venv/bin/python
# One thread per rank: 4 ranks x 2 threads on 2 cores ran 15-20x slower.
export OMP_NUM_THREADS=1

bash scripts/setup.sh
mkdir -p "$WORK"
if [ ! -f "$WORK/tiny-hf/model.safetensors" ]; then
  $PY scripts/make_tiny_model.py --output "$WORK/tiny-hf" --data "$WORK/corpus.jsonl"
fi
if [ ! -f "$WORK/ckpt/latest" ]; then
  $PY convert2ckpt.py --input "$WORK/tiny-hf" --output "$WORK/ckpt"
fi

# DeepSpeed's launcher ignores MASTER_PORT and takes 29500, which another job on this machine may hold: pass it
# MASTER_PORT when set, else a port free now (training/resilience/ports.py says which).
PORT="$($PY -m training.resilience.ports --who demo)"
.venv/bin/deepspeed --num_gpus 4 --master_port "$PORT" train.py \
  model_name_or_path="$WORK/ckpt" output_dir="$WORK/run" \
  num_stages=2 micro_batch_size=4 gradient_accumulation_steps=4 max_steps=300 save_steps=100 save_total_limit=2 \
  data=text data.train_file="$WORK/corpus.jsonl" data.max_seq_length=128 data.cache_dir="$WORK/cache" \
  data.eval_fraction=0.05 eval_steps=50 log_steps=10 \
  optim.lr=3e-3 optim.warmup_steps=10 optim.scheduler=cosine optim.min_lr=3e-4

$PY scripts/plot_metrics.py "$WORK/run"
$PY convert2ckpt.py --to-hf --input "$WORK/run" --output "$WORK/hf-export" --overwrite
$PY scripts/eval_hf.py --model "$WORK/tiny-hf" --data "$WORK/corpus.jsonl"
$PY scripts/eval_hf.py --model "$WORK/hf-export" --data "$WORK/corpus.jsonl"
$PY scripts/generate.py --model "$WORK/hf-export" --max-new-tokens 48

echo
echo "[demo] Hugging Face model (before):  $WORK/tiny-hf"
echo "[demo] pipeline checkpoint (before): $WORK/ckpt"
echo "[demo] tokenized data cache:        $WORK/cache"
echo "[demo] training run + checkpoint:    $WORK/run (metrics.jsonl, train_config.yaml, $(cat "$WORK/run/latest"))"
echo "[demo] loss and lr curves:          $WORK/run/metrics.png"
echo "[demo] exported Hugging Face model:  $WORK/hf-export (text above from scripts/generate.py)"
