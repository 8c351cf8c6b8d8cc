#!/usr/bin/env bash
# Create $VENV (default .venv) if missing and install torch and ckptstore (editable) with the extras
# given as $1 (default "test,demo"). Run it: `bash scripts/setup.sh [EXTRAS]`; scripts/test.sh and
# scripts/demo.sh run it too, so this is the one place that chooses the torch build.
#
# Which torch build (torch==$CKPTSTORE_TORCH_VERSION, default 2.13.0; pyproject only needs >=2.6):
#   CKPTSTORE_TORCH_INDEX=URL  torch comes from that index only (pip --index-url URL), e.g.
#                              https://download.pytorch.org/whl/cpu for the CPU build, or a CUDA index.
#   not set                    plain `pip install torch==2.13.0` from pip's configured sources. On a
#                              stock PyPI set-up on Linux that is the CUDA build (several GB). A
#                              machine whose pip config points at a local wheel directory holding the
#                              +cpu wheel (find-links, as on the project's build machines) gets that.
# Environment: PYTHON (interpreter for a new venv, default python3), VENV (default .venv).
set -euo pipefail
EXTRAS="${1:-test,demo}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_VERSION="${CKPTSTORE_TORCH_VERSION:-2.13.0}"
TORCH_INDEX="${CKPTSTORE_TORCH_INDEX:-}"
PIP=(python -m pip install -q --disable-pip-version-check)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
"${PIP[@]}" --upgrade pip || echo "setup.sh: could not upgrade pip; continuing" >&2
if [ -n "$TORCH_INDEX" ]; then
  echo "setup.sh: torch==$TORCH_VERSION from $TORCH_INDEX"
  "${PIP[@]}" "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX"
else
  echo "setup.sh: torch==$TORCH_VERSION from pip's configured sources (set CKPTSTORE_TORCH_INDEX to choose the build)"
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
"${PIP[@]}" -e ".[${EXTRAS}]"
