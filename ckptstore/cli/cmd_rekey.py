"""``ckptstore rekey``: rotate the master key of a store — raw key or AWS KMS key, either way.

Exits with :attr:`ckptstore.rekey.RekeyReport.exit_code` (0 done; 4 a damaged wrapped key or
manifest; 5 a version wrapped by another key; 14 the AWS KMS key refused or did not answer;
7 storage error; 1 a version changed meanwhile — run again; 2 usage).
"""

from __future__ import annotations

import sys

import click

from ._common import emit_json, key_file_option, kms_key_option, load_key, open_store, store_options


@click.command("rekey")
@store_options
@key_file_option("--key-file", "old_key_file", what="The current master key (or --kms-key)", env=False)
@kms_key_option("--kms-key", "old_kms_key", what="The current master key, in AWS KMS (or --key-file)")
@key_file_option("--new-key-file", what="The new master key, e.g. from 'ckptstore keygen' (or --new-kms-key)", env=False)
@kms_key_option("--new-kms-key", what="The new master key, in AWS KMS (or --new-key-file)")
@click.option("--version", "version_name", default=None, metavar="V", help="Only this version.")
@click.option("--dry-run", is_flag=True, help="Check every version and say what would be re-wrapped; write nothing.")
def rekey(root, remote, as_json, old_key_file, old_kms_key, new_key_file, new_kms_key, version_name, dry_run):
    """Re-wrap the data keys of every committed version under a new master key.

    The data is not re-encrypted: only each manifest's wrapped data key and key id change, and the
    manifest is re-sealed and replaced atomically, in every tier. Afterwards the old key is refused
    and the new key reads every version. Versions whose wrapped key or manifest is damaged are
    reported (exit 4) and left unchanged.

    Either key may live in AWS KMS (--kms-key / --new-kms-key: raw to KMS, KMS to KMS, KMS to raw);
    KMS wraps the data key with Encrypt and the result is checked with Decrypt before anything is
    replaced (--dry-run makes those requests too, and writes nothing).
    """
    from .. import rekey as _rekey

    old = _one_key(old_key_file, old_kms_key, "--key-file", "--kms-key", "current")
    new = _one_key(new_key_file, new_kms_key, "--new-key-file", "--new-kms-key", "new")
    st = open_store(root, remote)
    report = _rekey.rekey(st, old, new, version=version_name, dry_run=dry_run)
    if as_json:
        emit_json(report.to_json())
    else:
        old_name = report.old_key_id if report.old_key.startswith("master key id") else report.old_key
        new_name = report.new_key_id if report.new_key.startswith("master key id") else report.new_key
        click.echo(f"master key {old_name} -> {new_name}" + (" (dry run: nothing written)" if dry_run else ""))
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


def _one_key(key_file: str | None, kms_key: str | None, file_opt: str, kms_opt: str, which: str):
    """The key one pair of options names: a key file (32 bytes) or an AWS KMS key; exactly one."""
    if key_file and kms_key:
        raise click.UsageError(f"give {file_opt} or {kms_opt} for the {which} key, not both")
    if not key_file and not kms_key:
        raise click.UsageError(f"Missing option '{file_opt}' (or '{kms_opt}'): the {which} master key")
    if kms_key:
        from ..kms import KmsKey

        return KmsKey(kms_key)
    return load_key(key_file)
