"""``ckptstore rekey``: rotate the master key of a store.

Exits with :attr:`ckptstore.rekey.RekeyReport.exit_code` (0 done; 4 a damaged wrapped key or
manifest; 5 a version wrapped by another key; 7 storage error; 1 a version changed meanwhile —
run again; 2 usage).
"""

from __future__ import annotations

import sys

import click

from ._common import emit_json, key_file_option, load_key, open_store, store_options


@click.command("rekey")
@store_options
@key_file_option("--key-file", "old_key_file", required=True, what="The current master key")
@key_file_option("--new-key-file", required=True, what="The new master key (e.g. from 'ckptstore keygen')")
@click.option("--version", "version_name", default=None, metavar="V", help="Only this version.")
@click.option("--dry-run", is_flag=True, help="Check every version and say what would be re-wrapped; write nothing.")
def rekey(root, remote, endpoint_url, as_json, old_key_file, new_key_file, version_name, dry_run):
    """Re-wrap the data keys of every committed version under a new master key.

    The data is not re-encrypted: only each manifest's wrapped data key and key id change, and the
    manifest is re-sealed and replaced atomically, in every tier. Afterwards the old key is refused
    and the new key reads every version. Versions whose wrapped key or manifest is damaged are
    reported (exit 4) and left unchanged.
    """
    from .. import rekey as _rekey

    old = load_key(old_key_file)
    new = load_key(new_key_file)
    st = open_store(root, remote, endpoint_url)
    report = _rekey.rekey(st, old, new, version=version_name, dry_run=dry_run)
    if as_json:
        emit_json(report.to_json())
    else:
        click.echo(f"master key {report.old_key_id} -> {report.new_key_id}" + (" (dry run: nothing written)" if dry_run else ""))
        for e in report.entries:
            line = f"  {e.tier:<6} {e.version:<24} {e.status}"
            if e.detail:
                line += f": {e.detail}"
            click.echo(line, err=e.status not in _rekey.OK_STATUSES)
        for t, key, why in report.problems:
            click.echo(f"  {t:<6} {key}: invalid manifest: {why}", err=True)
        counts = report.to_json()["counts"]
        click.echo(", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no committed versions")
    if report.exit_code:
        sys.exit(report.exit_code)
