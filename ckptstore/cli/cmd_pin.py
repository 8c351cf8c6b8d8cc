"""``ckptstore pin`` / ``ckptstore unpin``: protect a version from retention, or stop protecting it."""

from __future__ import annotations

import click

from ._common import emit_json, open_store, store_options


@click.command("pin")
@store_options
@click.argument("version")
@click.option("--note", default="", help="Why it is pinned (stored with the pin; shown by show, list --json and gc).")
def pin(root, remote, as_json, version, note):
    """Pin VERSION in every tier that holds it: retention never deletes it."""
    st = open_store(root, remote)
    st.pin(version, note)
    rec = st.get(version)
    if as_json:
        emit_json({"version": version, "pinned": True, "tiers": sorted(rec.tiers)})
    else:
        click.echo(f"pinned {version} ({'+'.join(sorted(rec.tiers))})" + (f": {note}" if note else ""))


@click.command("unpin")
@store_options
@click.argument("version")
def unpin(root, remote, as_json, version):
    """Remove the pin of VERSION (it becomes eligible for retention again).

    Unpinning a version that is not pinned changes nothing, says so, and exits 0.
    """
    st = open_store(root, remote)
    rec = st.get(version)
    was_pinned = rec.pinned
    if was_pinned:
        st.unpin(version)
    if as_json:
        emit_json({"version": version, "pinned": False, "was_pinned": was_pinned, "tiers": sorted(rec.tiers)})
    elif was_pinned:
        click.echo(f"unpinned {version}")
    else:
        click.echo(f"{version} was not pinned; nothing changed")
