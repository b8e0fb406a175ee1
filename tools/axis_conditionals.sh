#!/usr/bin/env bash
# Conditional lines on a parallel axis (tensor, sequence, the pipeline schedule) in the project's non-test
# Python files: an if/elif/while naming one, or a conditional expression. Issue 43 counts those outside
# parallel/, where each axis's plan lives:  bash tools/axis_conditionals.sh [--outside-parallel]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PAT='tensor_parallel|sequence_parallel|pipeline_schedule|dualpipe|\btp\b|\bsp\b|\.schedule\b|seq_slice|ColumnParallel|RowParallel|Vocab\w*Parallel'
git ls-files --cached --others --exclude-standard '*.py' | grep -v '^tests/' | xargs grep -nE "^\s*(if|elif|while)\b.*($PAT)|\bif\b.*($PAT).*\belse\b" \
  | { if [ "${1:-}" = "--outside-parallel" ]; then grep -v '^parallel/'; else cat; fi; } || true
