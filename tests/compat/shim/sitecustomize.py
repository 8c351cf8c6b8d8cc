"""Swap DCP's FileSystemWriter/FileSystemReader for ckptstore in every process of a test run.

Loaded at interpreter start (this directory is put first on ``PYTHONPATH`` by
``tests/compat/run_torch_dcp_tests.py``), so ranks spawned by PyTorch's multi-process test bases
get the swap too. Active only with ``CKPTSTORE_DCP_SHIM=1``.
"""

import os

if os.environ.get("CKPTSTORE_DCP_SHIM") == "1":
    try:
        import ckptstore_dcp_shim

        ckptstore_dcp_shim.install()
    except Exception as e:  # never break interpreter start-up; the runner reports it
        import sys

        print(f"ckptstore DCP shim not installed: {type(e).__name__}: {e}", file=sys.stderr)
