#!/usr/bin/env bash
# The test command: set up (idempotent), then the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
