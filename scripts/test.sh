#!/usr/bin/env bash
# README command 2: install everything into .venv and run the test suite.
# Extra arguments go to pytest (e.g. -k core). CKPTSTORE_FULL=1 also runs the slow sweeps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,demo
. .venv/bin/activate
MARK=(-m "not slow")
if [ "${CKPTSTORE_FULL:-0}" = "1" ]; then MARK=(); fi
exec python -m pytest -q -p no:logging "${MARK[@]}" "$@"
