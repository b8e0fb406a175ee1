#!/usr/bin/env bash
# Wheels for a GPU machine that has CUDA torch but no package index (scripts/gpu_check.sh installs
# them from .whl/ with --no-deps): what such an image lacks of our pins. Run here, where pip reaches PyPI:
#   bash tools/gpu_wheels.sh [python-version, default 3.12]
# DeepSpeed is published as a source archive only; its wheel is built here (no ops compiled: they are
# JIT-built where they run), with this project's .venv for torch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYV="${1:-3.12}"
OUT="$ROOT/.whl"
mkdir -p "$OUT"
pins() { "$ROOT/.venv/bin/python" -c "import tomllib; d = tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']['dependencies']; print(next(p for p in d if p.startswith('$1==')))"; }
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp "${platforms[@]}" -d "$OUT" \
  "$(pins transformers)" "$(pins hydra-core)" "$(pins accelerate)" "$(pins torchao)" omegaconf==2.3.0 hjson pydantic pydantic-core annotated-types typing-inspection typing_extensions \
  liger-kernel==0.8.5  # kernels=liger, a GPU extra (not a pin of pyproject.toml): needs torch and triton, both in the CUDA image
python3 -m pip wheel -q --no-deps -w "$OUT" antlr4-python3-runtime==4.9.3  # hydra's parser: a source archive only
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "$(pins deepspeed)"
tar xzf "$tmp"/deepspeed-*.tar.gz -C "$tmp"
(cd "$tmp"/deepspeed-*/ && "$ROOT/.venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" .)
rm -rf "$tmp"
ls -1 "$OUT"
