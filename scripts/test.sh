#!/usr/bin/env bash
# README command 2: install everything into .venv (the test, demo, torchft and lightning extras; once: again only when
# pyproject.toml changed, see scripts/setup.sh) and run the test suite.
# Extra arguments go to pytest (e.g. tests/test_cli.py -k json). CKPTSTORE_FULL=1 also runs the slow sweeps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,demo,torchft,lightning
# libfaketime runs one save under a clock 2 h ahead (tests/test_recovery.py, the clock-skew case):
# when it is missing and this runs as root with apt-get, the Debian package faketime is installed
# (docs/getting-started.md; CKPTSTORE_NO_APT=1: never); otherwise that one test is skipped with a message
if [ "${CKPTSTORE_NO_APT:-0}" != 1 ] && ! command -v faketime >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q faketime >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q faketime >/dev/null 2>&1; }) \
    || echo "test.sh: could not install faketime; the clock-skew test will be skipped" >&2
fi
# Azurite (npm, pinned) for the az:// tier's tests, into .azurite/; the GCS emulator comes with the test extra
bash scripts/install-azurite.sh || echo "test.sh: could not install Azurite; the Azure Blob tests will be skipped" >&2
. .venv/bin/activate
MARK=(-m "not slow")
if [ "${CKPTSTORE_FULL:-0}" = "1" ]; then MARK=(); fi
exec python -m pytest -q -p no:logging --durations=25 "${MARK[@]}" "$@"
