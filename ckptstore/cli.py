"""The ``ckptstore`` command line: thin — parse, call the library, print, exit with the error's code.

Exit codes are those of :mod:`ckptstore.errors` (0 success; 3 version not found; 4 integrity;
5 key; 6 exists; 7 storage; 8 unsupported format; 10/11/12 scrub outcomes; 2 usage).
"""

from __future__ import annotations

import functools
import json
import sys

import click

from . import __version__
from .errors import CkptStoreError


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def store_options(f):
    """``ROOT``, ``--remote URL``, ``--endpoint-url``, ``--json`` shared by every command."""
    f = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")(f)
    f = click.option("--endpoint-url", default=None, help="S3 endpoint (default: the boto3 chain, e.g. AWS_ENDPOINT_URL).")(f)
    f = click.option("--remote", default=None, metavar="URL", help="S3 tier, s3://bucket/prefix.")(f)
    f = click.argument("root", type=click.Path(file_okay=False))(f)
    return f


def handle_errors(f):
    @functools.wraps(f)
    def wrapper(*a, **kw):
        try:
            return f(*a, **kw)
        except CkptStoreError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)

    return wrapper


def open_store(root, remote, endpoint_url, key=None):
    from .store import Store

    return Store(root, remote=remote, endpoint_url=endpoint_url, key=key)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptstore")
def main():
    """ckptstore: list, inspect, prune and verify DCP checkpoints on local disk and S3."""


@main.command("list")
@store_options
@handle_errors
def list_cmd(root, remote, endpoint_url, as_json):
    """List committed versions, oldest first, with the tiers that hold each."""
    st = open_store(root, remote, endpoint_url)
    recs = st.versions()
    if as_json:
        click.echo(json.dumps({"versions": [r.to_json() for r in recs], "problems": [list(p) for p in st.problems]}, indent=2))
        return
    if not recs:
        click.echo("no committed versions")
    else:
        click.echo(f"{'VERSION':<24} {'STEP':>8} {'CREATED (UTC)':<20} {'RANKS':>5} {'LOGICAL':>10} {'STORED':>10} {'TIERS':<13} FLAGS")
        for r in recs:
            flags = ",".join(x for x, on in (("pinned", r.pinned), ("damaged", r.damaged), ("encrypted", r.encrypted)) if on)
            click.echo(
                f"{r.version:<24} {('-' if r.step is None else r.step):>8} {r.created.strftime('%Y-%m-%d %H:%M:%S'):<20} "
                f"{r.world_size:>5} {_human(r.nbytes):>10} {_human(r.stored_bytes):>10} {'+'.join(sorted(r.tiers)):<13} {flags}"
            )
    for tier, key, why in st.problems:
        click.echo(f"warning: {tier} tier: ignored invalid manifest {key}: {why}", err=True)


def _attach_optional() -> None:
    """Commands living in their own modules (added when present)."""
    import importlib

    for mod, names in (("ckptstore.ops_cli", None), ("ckptstore.demo.cli", ("demo",)), ("ckptstore.rekey_cli", None)):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if names is None:
            names = getattr(m, "COMMANDS", ())
        for n in names:
            cmd = getattr(m, n, None)
            if isinstance(cmd, click.Command):
                main.add_command(cmd)


_attach_optional()

if __name__ == "__main__":
    main()
