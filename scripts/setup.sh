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
# Environment: PYTHON (interpreter for a new venv, default python3), VENV (default .venv),
# CKPTSTORE_REINSTALL=1 (install even when nothing changed).
#
# Installs once: a stamp ($VENV/.ckptstore-setup: the hash of pyproject.toml and of the C source
# ckptstore/codec/_planes.c and _huff.c, which the install compiles when a C compiler is present; the extras, the torch version
# and index) is written after a successful install, and a later run with the same stamp and an intact
# install (torch, ckptstore pointing at this checkout) does nothing, also when it asks for fewer extras than
# were installed. Editing pyproject.toml (new dependencies) or the C source installs again; asking for other extras installs
# the union of those and the ones installed before.
set -euo pipefail
EXTRAS="${1:-test,demo}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_VERSION="${CKPTSTORE_TORCH_VERSION:-2.13.0}"
TORCH_INDEX="${CKPTSTORE_TORCH_INDEX:-}"
PIP=(python -m pip install -q --disable-pip-version-check)

STAMP="$VENV/.ckptstore-setup"
BASE="pyproject=$("$PY" -c 'import hashlib,sys; print(hashlib.sha256(b"".join(open(p,"rb").read() for p in sys.argv[1:])).hexdigest())' pyproject.toml ckptstore/codec/_planes.c ckptstore/codec/_huff.c) torch=$TORCH_VERSION index=$TORCH_INDEX"
# the stamp is "BASE extras=a,b,c": a later run asking for a subset of those extras installs nothing, and one
# asking for others installs the union (so demo.sh and test.sh, alternating, install once each at most)
HAVE="$(cat "$STAMP" 2>/dev/null || true)"
HAVE_EXTRAS=""
case "$HAVE" in "$BASE extras="*) HAVE_EXTRAS="${HAVE#"$BASE extras="}" ;; esac
ALL_EXTRAS="$(printf '%s\n' "${HAVE_EXTRAS//,/$'\n'}" "${EXTRAS//,/$'\n'}" | sed '/^$/d' | sort -u | paste -sd, -)"
if [ "${CKPTSTORE_REINSTALL:-0}" != 1 ] && [ -x "$VENV/bin/python" ] && [ -n "$HAVE_EXTRAS" ] && [ "$ALL_EXTRAS" = "$(printf '%s\n' "${HAVE_EXTRAS//,/$'\n'}" | sort -u | paste -sd, -)" ] \
   && "$VENV/bin/python" - "$TORCH_VERSION" "$PWD" >/dev/null 2>&1 <<'PYEOF'
import importlib.metadata as md, os, sys
assert md.version("torch").split("+")[0] == sys.argv[1]
import ckptstore  # the editable install of this checkout, not a copy
assert os.path.dirname(os.path.dirname(os.path.abspath(ckptstore.__file__))) == os.path.abspath(sys.argv[2])
PYEOF
then
  exit 0  # installed, and pyproject.toml unchanged since
fi
echo "setup.sh: installing torch and ckptstore[${ALL_EXTRAS}] into $VENV (once; again only when pyproject.toml changes or other extras are asked for)"
# a C compiler builds ckptstore/codec/_planes.c (the one-pass byte-group split/merge) and _huff.c (the exponent
# planes' Huffman coder); without one the install uses the numpy code (same bytes, slower) and zstd. As root with apt-get and no cc, the Debian package gcc is installed
# (CKPTSTORE_NO_APT=1: never)
if [ "${CKPTSTORE_NO_APT:-0}" != 1 ] && ! command -v cc >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q gcc libc6-dev >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q gcc libc6-dev >/dev/null 2>&1; }) \
    || echo "setup.sh: could not install gcc; ckptstore's byte-group codec will use numpy" >&2
fi
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
"${PIP[@]}" -e ".[${ALL_EXTRAS}]"
echo "$BASE extras=$ALL_EXTRAS" > "$STAMP"
