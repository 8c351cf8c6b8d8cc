"""``ckptstore scrub``: verify every committed version's objects in each tier; optionally repair.

Exits with :attr:`ckptstore.scrub.ScrubReport.exit_code`: 0 clean, 10 damage found (not all
repaired), 11 damage found and all repaired, 5 the key given does not fit (or cannot be read),
12 something could not be checked (also: the AWS KMS key refused or did not answer), 13 a version's
tensors hold NaN/Inf values (not damage).
"""

from __future__ import annotations

import sys

import click

from ._common import (emit_json, key_file_option, kms_key_option, master_key, open_store, progress, reported_here,
                      store_options)


@click.command("scrub")
@store_options
@click.option("--version", "version_name", default=None, metavar="V", help="Check only this version.")
@click.option("--deep", is_flag=True, help="Also decrypt and decompress every frame and check the DCP metadata (needs the key when encrypted).")
@click.option("--repair", is_flag=True, help="Restore damaged objects from the other tier; mark versions that cannot be repaired as damaged.")
@click.option("--jobs", type=click.IntRange(min=1), default=None, metavar="N",
              help="Worker threads that verify objects and frames (and run ranged GETs on a remote tier). Default: the "
                   "CPUs available, at most 8 — XXH3 needs a core per stream of a few GB/s and releases the GIL, "
                   "so more threads than cores only contend.")
@key_file_option("--key-file")
@kms_key_option("--kms-key", what="AWS KMS key of the store, for --deep (else CKPTSTORE_KMS_KEY_ID)")
def scrub(root, remote, as_json, version_name, deep, repair, key_file, kms_key, jobs):
    """Verify every committed version's objects in each tier (presence, size, frames, digests).

    On a node-local root that holds one part of a version split over several roots, that part is
    checked (the metadata object and its group's shards; --json: "part"); the remote tier is
    checked whole.

    Exit codes: 0 clean; 10 damage found (not all repaired); 11 damage found and all repaired;
    5 key: the key given (--key-file, CKPTSTORE_KEY, CKPTSTORE_KEY_FILE, --kms-key,
    CKPTSTORE_KMS_KEY_ID) cannot be read or does not fit an encrypted version; 12 something could not
    be checked (key missing for --deep, tier unreachable, the AWS KMS key refused or did not answer);
    13 no damage, but a version's manifest records NaN/Inf values in its tensors (a finding: the bytes
    are intact and never marked; the version is not the default restore point);
    9 no store at ROOT / --remote;
    15 nothing worse than 11/13, but the catalogue chain (checked with the key given or in the
    environment, also without --deep) shows a newest version deleted or an older manifest put back
    without the key (docs/FORMAT.md, "Catalogue chain").
    """
    from .. import scrub as _scrub

    # one behaviour for a key however it is given (docs: docs/operations/cli.md): only --deep reads
    # one; a key that cannot be decoded is exit 5 at once, a key that does not fit is exit 5 after
    # the check, a key that no checked version needs is said to be unused
    key = source = None
    if deep:
        key, source = master_key(key_file, kms_key)
    elif key_file or kms_key:
        given = f"--key-file {key_file}" if key_file else f"--kms-key {kms_key}"
        click.echo(f"warning: {given} is used only to check the catalogue chain: only --deep decrypts", err=True)
    st = open_store(root, remote, key=key)
    with progress("scrub") as (set_total, advance), reported_here():
        report = _scrub.scrub(st, version=version_name, deep=deep, repair=repair, key=key, on_total=set_total, on_bytes=advance,
                               jobs=jobs)
    found = _chain_findings(st, key, key_file, kms_key)
    if key is not None and report.versions and not any(v.encrypted for v in report.versions):
        click.echo(f"warning: the key from {source} is not used: no version checked is encrypted", err=True)
    code = report.exit_code
    if found and code in (0, 11, 13):
        from ..errors import CatalogueRollbackError

        code = CatalogueRollbackError.exit_code
    if as_json:
        emit_json({**report.to_json(), "chain": [f.to_json() for f in found], "exit_code": code})
    else:
        for line in _scrub.format_report(report):
            click.echo(line)
        if not report.versions and not report.unreachable:
            click.echo("no committed versions")
        s = report.to_json()["summary"]
        click.echo(f"{s['versions']} version copies, {s['objects']} objects: {s['damaged']} damaged, "
                   f"{s['repaired']} repaired, {s['unchecked']} not fully checked"
                   + (f", {s['nonfinite']} with NaN/Inf values (not damage)" if s["nonfinite"] else "")
                   + f" (exit {code})")
    for f in found:
        click.echo(f"catalogue chain, {f.tier} tier ({f.kind}): {f.message}", err=True)
    if code:
        sys.exit(code)


def _chain_findings(st, key, key_file, kms_key) -> list:
    """The catalogue chain's findings (docs/FORMAT.md, "Catalogue chain") with the key given or in
    the environment; none without one (or when it cannot be read: the --deep check reports that)."""
    from ..errors import CkptStoreError
    from ..keys import resolve_master
    from ..manifest import chain

    try:
        k = key if key is not None else master_key(key_file, kms_key)[0]
        master = resolve_master(k) if k is not None else None
    except CkptStoreError:
        return []
    return chain.check_store(st.tiers, master) if master is not None else []
