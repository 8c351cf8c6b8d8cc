"""``ckptstore drop``: remove one version on request — also the newest or a damaged one.

Retention never deletes the newest committed version, and ``scrub --repair`` needs another tier that
holds a good copy; ``drop`` is the way out when the newest version is damaged beyond repair. It runs
:func:`ckptstore.gc.plan_drop` through :func:`ckptstore.gc.apply`: every un-commit (manifest) first,
then the objects (docs/FORMAT.md, Delete rules). It asks for confirmation unless ``--yes``.
"""

from __future__ import annotations

import sys

import click

from ._common import emit_json, human, open_store, plural, reported_here, store_options


@click.command("drop")
@store_options
@click.argument("version")
@click.option("--tier", "tiers", type=click.Choice(["local", "remote"]), multiple=True,
              help="Drop it from this tier only (repeatable; default: every tier of the store).")
@click.option("--force", is_flag=True, help="Drop it even when it is pinned (the pin goes too).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--dry-run", is_flag=True, help="Print what would be removed; remove nothing.")
def drop(root, remote, as_json, version, tiers, force, yes, dry_run):
    """Remove VERSION (un-commit, then delete its objects), even the newest or a damaged one.

    Exit codes: 0 done (or dry run / declined), 3 no tier holds VERSION, 1 VERSION is pinned and
    --force was not given, 7 a storage action failed.

    On a keyed store give the key (CKPTSTORE_KEY, CKPTSTORE_KEY_FILE or CKPTSTORE_KMS_KEY_ID): drop then
    moves the catalogue head off VERSION, so list, scrub and restores accept the deletion; without it
    a dropped newest version is reported as missing (docs/FORMAT.md, "Catalogue chain").
    """
    from .. import gc as _gc

    st = open_store(root, remote)
    with reported_here():
        p = _gc.plan_drop(st, version, tiers=tiers or None, force=force)
    n_bytes = sum(a.size or 0 for a in p.actions)
    # off a terminal without --yes nothing is removed: the listing below is a plan, said before it
    refuse = bool(p.actions) and not (yes or dry_run) and not sys.stdin.isatty()
    if not as_json:
        note = (" (dry run: nothing is removed)" if dry_run else
                " (plan only: nothing is removed without --yes off a terminal)" if refuse else
                " (plan: asks before removing anything)" if not yes and p.actions else "")
        click.echo(f"drop {version}: {plural(len(p.actions), 'action')} ({human(n_bytes)}){note}")
        for a in p.actions:
            size = f" ({human(a.size)})" if a.size else ""
            click.echo(f"  {a.op:<12} {a.tier:<6} {a.key}{size}")
    if dry_run or not p.actions:
        if as_json:
            emit_json({"dry_run": dry_run, "plan": p.to_json(), "result": None})
        return
    if not yes:
        if refuse:
            raise click.UsageError("drop removes data: nothing was removed; confirm with --yes when not attached "
                                   "to a terminal (the plan above is what it would remove)")
        if not click.confirm(f"Remove version {version!r}? This cannot be undone", default=False):
            click.echo("nothing removed")
            return
    result = _gc.apply(st.tiers, p)
    # a keyed store's catalogue heads move off the dropped version, so the deletion is not reported
    # as a missing newest version (docs/FORMAT.md, "Catalogue chain"); the key from the environment
    from ..manifest import chain

    for w in chain.after_drop(st.tiers, version, st.master_key()):
        click.echo(f"warning: {w}", err=True)
    if as_json:
        emit_json({"dry_run": False, "plan": p.to_json(), "result": result.to_json()})
    else:
        for a, e in result.failed:
            click.echo(f"error: {a.op} {a.tier} {a.key} failed: {e}", err=True)
        click.echo(f"dropped {version}: {len(result.applied)} applied, {len(result.skipped)} skipped, "
                   f"{len(result.failed)} failed")
    if result.failed:
        sys.exit(result.exit_code())
