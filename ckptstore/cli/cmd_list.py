"""``ckptstore list``: the committed versions, oldest first, with the tiers that hold each."""

from __future__ import annotations

import sys
import time

import click

from ._common import emit_json, human, one_note, open_store, pin_notes, reported_here, store_options


@click.command("list")
@store_options
def list_cmd(root, remote, as_json):
    """List committed versions, oldest first, with the tiers that hold each.

    On a node-local root that holds one part of a version split over several roots the local tier
    reads ``local(part k/n)`` (in --json: ``"parts": {"local": {"index", "count", "ranks",
    "whole", "domain"}}``; empty for a version held whole). In --json, ``"domains"`` lists each root
    group of a split version with its failure domain (``{"ranks", "domain"}``, where replicas are
    placed by).

    Invalid manifests are reported once each on stderr (in --json also under "problems"). FLAGS:
    ``supersedes`` (the commit replaced an earlier attempt of the name: ``ckptstore show``),
    ``future-time`` (committed at a time ahead of this host's clock), ``stale:TIER`` (that tier holds
    another copy of the name, which is not loaded), ``nonfinite`` (its tensors hold NaN/Inf values:
    not the default restore point; ``ckptstore show`` names them; in --json ``"nonfinite"``: the count,
    null when not counted).

    With a key (CKPTSTORE_KEY, CKPTSTORE_KEY_FILE, CKPTSTORE_KMS_KEY_ID) the catalogue chain is
    checked (docs/FORMAT.md, "Catalogue chain"): a newest version deleted or an older manifest put
    back without the key is warned about (in --json under "chain") and list exits 15.

    The last line gives the last save's durable lag (seconds from its ``save()`` call to its remote
    commit) from the root's event log, when there is one (in --json: ``"last_save"``).
    """
    st = open_store(root, remote)
    with reported_here():
        recs = st.versions()
    last = _last_save(st)
    from ..manifest import chain

    found = chain.check_store(st.tiers, st.master_key())  # with a key only (docs/FORMAT.md, "Catalogue chain")
    if as_json:
        versions = []
        for r in recs:
            d = r.to_json()
            d["pin_note"] = one_note(pin_notes(st, r.version, r.tiers)) if r.pinned else None
            versions.append(d)
        emit_json({"versions": versions, "problems": [list(p) for p in st.problems],
                   "chain": [f.to_json() for f in found],
                   "last_save": None if last is None else {k: last.get(k) for k in (
                       "version", "step", "outcome", "durability", "durable_lag_s", "local_commit_s", "t_call", "t")}})
    else:
        _print_table(recs)
        if last is not None:
            from ..events import durable_lag_text

            click.echo(f"last save: {last.get('version')} ({last.get('outcome')}), durable lag "
                       f"{durable_lag_text(last, time.time())}")
    for tier, key, why in st.problems:
        click.echo(f"warning: {tier} tier: ignored invalid manifest {key}: {why}", err=True)
    for r in recs:
        for t, a in r.stale:
            click.echo(f"warning: {r.version}: the {t} tier holds another copy (attempt {a}) than the one listed "
                       f"(attempt {r.attempt}); it is stale and is never loaded ('ckptstore scrub' reports it)", err=True)
        if r.in_future:
            click.echo(f"warning: {r.version} was committed at {r.created:%Y-%m-%d %H:%M:%S} UTC, in the future of this "
                       "host's clock (a skewed clock on the saving host); its order comes from its step and commit "
                       "sequence, not from that time", err=True)
    for f in found:
        click.echo(f"warning: catalogue chain, {f.tier} tier ({f.kind}): {f.message}", err=True)
    if found:
        from ..errors import CatalogueRollbackError

        sys.exit(CatalogueRollbackError.exit_code)


def _last_save(st):
    """The last ``save`` line of the local root's event log (docs/FORMAT.md, "Event log"), or None."""
    if st.root is None:
        return None
    from .. import events

    return events.last_save(events.tail(events.default_path(st.root)))


def _print_table(recs) -> None:
    if not recs:
        click.echo("no committed versions")
        return
    tw = max([13] + [len("+".join(r.tier_labels)) for r in recs])
    click.echo(f"{'VERSION':<24} {'STEP':>8} {'CREATED (UTC)':<20} {'RANKS':>5} {'LOGICAL':>10} {'STORED':>10} {'UNIQUE':>10} "
               f"{'TIERS':<{tw}} FLAGS")
    for r in recs:
        flags = ",".join(x for x, on in (("pinned", r.pinned), ("damaged", r.damaged), ("encrypted", r.encrypted),
                                         ("supersedes", bool(r.supersedes)), ("future-time", r.in_future),
                                         ("references", bool(r.ref_bytes)), ("nonfinite", bool(r.nonfinite))) if on)
        flags += "".join(f",stale:{t}" for t, _a in r.stale)
        click.echo(
            f"{r.version:<24} {('-' if r.step is None else r.step):>8} {r.created.strftime('%Y-%m-%d %H:%M:%S'):<20} "
            f"{r.world_size:>5} {human(r.nbytes):>10} {human(r.stored_bytes):>10} "
            f"{human(r.unique_bytes if r.unique_bytes is not None else r.stored_bytes):>10} {'+'.join(r.tier_labels):<{tw}} {flags}"
        )
