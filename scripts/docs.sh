#!/usr/bin/env bash
# Build the docs site (mkdocs.yml: mkdocs-material, mkdocstrings for the API reference from the
# docstrings, mkdocs-click for the CLI reference) into site/ with --strict: a broken link, a missing
# anchor, an unresolved reference or a docstring griffe cannot read fails the build.
# `bash scripts/docs.sh` builds; `bash scripts/docs.sh serve` serves it on http://127.0.0.1:8000/
# with live reload. Installs the `docs` extra into .venv once (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh docs
. .venv/bin/activate
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's banner about its successor: not a warning of this site
if [ "${1:-build}" = serve ]; then
  shift
  exec mkdocs serve --strict "$@"
fi
[ "${1:-}" = build ] && shift
exec mkdocs build --strict "$@"
