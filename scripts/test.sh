#!/usr/bin/env bash
# The test command: set up (idempotent), lint, then the suite. `--fast` runs the unit tier only: no test
# that starts DeepSpeed ranks or runs an entry point in a subprocess (the `multirank` and `e2e` markers,
# pyproject.toml). CI runs everything. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/ruff check --quiet .
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -m "not multirank and not e2e and not gpu" "$@"
fi
exec .venv/bin/python -m pytest "$@"
