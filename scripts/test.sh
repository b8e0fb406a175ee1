#!/usr/bin/env bash
# The test command: set up (idempotent), lint, then the suite. `--fast` runs the unit tier only: no test
# that starts DeepSpeed ranks, runs an entry point in a subprocess or takes a second or more in this process (the
# `multirank`, `e2e` and `slow` markers, pyproject.toml). CI runs everything. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/ruff check --quiet .
# Compiled modules are cached (__pycache__, gitignored) even where PYTHONDONTWRITEBYTECODE is set: without the cache
# every run compiles the project's modules again and pytest rewrites the asserts of every test module again (about
# 3 s of the fast tier's 40).
unset PYTHONDONTWRITEBYTECODE
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -m "not multirank and not e2e and not slow and not gpu" "$@"
fi
exec .venv/bin/python -m pytest "$@"
