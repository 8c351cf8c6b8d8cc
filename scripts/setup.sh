#!/usr/bin/env bash
# Create .venv (if missing) and install ckptstore with the CPU build of torch and the extras given
# as $1 (default "test,demo"). Sourced by scripts/test.sh and scripts/demo.sh.
set -euo pipefail
EXTRAS="${1:-test,demo}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check --upgrade pip
# Pin the CPU build here (a bare "torch" pulls a multi-GB CUDA build); pyproject keeps torch>=2.6.
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -e ".[${EXTRAS}]"
