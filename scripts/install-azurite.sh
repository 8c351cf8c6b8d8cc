#!/usr/bin/env bash
# Install Azurite (the Azure Blob emulator the az:// tier's tests run, ckptstore/testing/azurite.py) into
# .azurite/ of this checkout (git-ignored), pinned, with npm; once: again only when the pin changes.
# Needs node and npm on PATH; as root with apt-get and no node, the Debian packages nodejs and npm are installed
# (CKPTSTORE_NO_APT=1: never). Without them it says so and exits 0: the Azure tests then skip (CI: fail).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
AZURITE_VERSION=3.37.0
DEST=.azurite
if [ -x "$DEST/node_modules/.bin/azurite-blob" ] && [ "$(cat "$DEST/.version" 2>/dev/null)" = "$AZURITE_VERSION" ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1 && [ "${CKPTSTORE_NO_APT:-0}" != 1 ] && command -v apt-get >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q nodejs npm >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nodejs npm >/dev/null 2>&1; }) \
    || echo "install-azurite.sh: could not install nodejs/npm" >&2
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "install-azurite.sh: npm not found; the Azure Blob tests will be skipped (install nodejs and npm)" >&2
  exit 0
fi
echo "install-azurite.sh: installing azurite@$AZURITE_VERSION into $DEST/"
mkdir -p "$DEST"
npm install --no-audit --no-fund --loglevel=error --prefix "$DEST" "azurite@$AZURITE_VERSION" >/dev/null
echo "$AZURITE_VERSION" > "$DEST/.version"
