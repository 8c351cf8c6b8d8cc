"""``ckptstore show``: one committed version in detail (gathered per tier, then printed)."""

from __future__ import annotations

import json

import click

from ._common import emit_json, human, one_note, open_store, pin_note, plural, store_options


@click.command("show")
@store_options
@click.argument("version")
@click.option("--objects", "list_objects", is_flag=True, help="Also list every stored object.")
@click.option("--manifest", "raw_manifest", is_flag=True,
              help="Print the version's manifest body instead (JSON, checked: framing, XXH3 seal, fields; "
                   "docs/FORMAT.md, \"Manifest\").")
def show(root, remote, as_json, version, list_objects, raw_manifest):
    """Summarise one committed VERSION: step, time, ranks, tiers, sizes, codecs, encryption, pin
    (with its note), damage marks, NaN/Inf values its tensors hold (count and first keys), metadata,
    and — from the root's event log — its save's durable lag (seconds from ``save()`` to the remote
    commit)."""
    st = open_store(root, remote)
    rec = st.get(version)
    pm = st.manifest(version, next(n for n in st.tiers if n in rec.tiers))
    m = pm.manifest
    if raw_manifest:  # the body's exact sealed bytes, parsed (the file itself: versions/<v>/manifest.json)
        click.echo(json.dumps(json.loads(pm.body), indent=1 if not as_json else None, sort_keys=True, ensure_ascii=False))
        return
    per_tier = _per_tier(st, version, rec.attempt)
    if "local" in per_tier:
        part = rec.local_part  # set for a split version only
        per_tier["local"]["part"] = None if part is None or part.whole else part.to_json()
    info = _info(version, rec, m, per_tier)
    ev = None
    if st.root is not None:
        from .. import events

        ev = events.last_save(events.tail(events.default_path(st.root)), version)
    info["save_event"] = None if ev is None else {k: ev.get(k) for k in (
        "step", "outcome", "durability", "blocked_s", "local_commit_s", "remote_commit_s", "durable_lag_s", "t_call", "t")}
    info["durable_lag_s"] = None if ev is None else ev.get("durable_lag_s")
    if as_json:
        if list_objects:
            info["object_list"] = [o.to_json() for o in m.all_objects()]
        emit_json(info)
        return
    for k, v in _rows(info, m):
        click.echo(f"{k + ':':<15} {v}")
    if ev is not None:
        import time

        from ..events import durable_lag_text

        click.echo(f"{'durable lag:':<15} {durable_lag_text(ev, time.time())}; blocked {ev.get('blocked_s') or 0:.3f} s"
                   + (f", local commit {ev['local_commit_s']:.2f} s" if isinstance(ev.get("local_commit_s"), (int, float)) else "")
                   + " (event log)")
    for n, d in per_tier.items():
        click.echo(f"{n + ' tier:':<15} " + _tier_line(d))
    if list_objects:
        objs = m.all_objects()
        rows = [(o.name, human(o.size), plural(o.frames, "frame"), "-" if o.rank is None else str(o.rank), o.digest)
                for o in objs]
        heads = ("OBJECT", "SIZE", "FRAMES", "RANK", "XXH3")
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(heads)]
        right = (False, True, True, True, False)
        for r in [heads, *rows]:
            click.echo("  " + "  ".join(c.rjust(w) if rj else c.ljust(w) for c, w, rj in zip(r, widths, right)).rstrip())


def _per_tier(st, version: str, current_attempt: str) -> dict[str, dict]:
    """What each tier holds of ``version``: attempt, pin (and note), damage mark (and reason)."""
    from ..manifest import catalogue, layout

    out = {}
    for n, t in st.tiers.items():
        try:
            pm = catalogue.read_manifest(t, version).manifest
        except Exception:  # noqa: BLE001 - not committed (or unreadable) there
            continue
        note = pin_note(t, version)
        damaged = t.exists(layout.damaged_key(version))
        out[n] = {
            "attempt": pm.attempt,
            "current": pm.attempt == current_attempt,
            "pinned": note is not None,
            "pin_note": note,
            "damaged": damaged,
            "damage_reason": catalogue.damage_note(t, version) if damaged else None,
        }
    return out


def _info(version: str, rec, m, per_tier: dict) -> dict:
    """The JSON form of ``show`` (also the source of the text rows)."""
    own = sum(o.nbytes for o in m.all_objects())  # logical bytes of what it stored itself (not its references)
    ratio = (own / m.stored_bytes) if m.stored_bytes else None
    return {
        "version": version,
        "attempt": m.attempt,
        "step": m.step,
        "created": m.created,
        "world_size": m.world_size,
        "tiers": sorted(rec.tiers),
        "tier_labels": rec.tier_labels,
        "parts": {} if rec.local_part is None or rec.local_part.whole else {"local": rec.local_part.to_json()},
        "nbytes": m.nbytes,
        "stored_bytes": m.stored_bytes,
        "compression_ratio": round(ratio, 4) if ratio else None,
        "encrypted": m.encrypted,
        "key_id": (m.encryption or {}).get("key_id"),
        "encryption": (m.encryption or {}).get("alg"),
        "kms_key_arn": ((m.encryption or {}).get("kms") or {}).get("key_arn"),
        "codecs": sorted(m.codecs),
        "user": m.user,
        "format": m.format,
        "writer": m.writer,
        "objects": len(m.all_objects()),
        "pinned": rec.pinned,
        "pin_note": one_note({n: d["pin_note"] for n, d in per_tier.items() if d["pinned"]}),
        "damaged": rec.damaged,
        "seq": m.seq,
        "unique_bytes": rec.unique_bytes,
        "refs": [r.to_json() for r in m.refs],
        "supersedes": list(m.supersedes or ()),
        "nonfinite": m.nonfinite,
        "stale": [{"tier": t, "attempt": a} for t, a in rec.stale],
        "in_future": rec.in_future,
        "per_tier": per_tier,
    }


def _rows(info: dict, m) -> list[tuple[str, object]]:
    ratio = info["compression_ratio"]
    if info["pinned"]:
        pinned = "yes" + (f" ({info['pin_note']})" if info["pin_note"] else "") + ": retention never deletes it"
    else:
        pinned = "no"
    return [
        ("version", info["version"]),
        ("attempt", m.attempt),
        ("step", "-" if m.step is None else m.step),
        ("created", m.created),
        ("world size", m.world_size),
        ("tiers", "+".join(info["tier_labels"])),
        ("logical size", f"{human(m.nbytes)} ({m.nbytes} bytes)"),
        ("stored size", f"{human(m.stored_bytes)} ({m.stored_bytes} bytes)"),
        ("unique size", "-" if info["unique_bytes"] is None else
         f"{human(info['unique_bytes'])} ({info['unique_bytes']} bytes): what deleting it frees"),
        ("references", "; ".join(f"{r['name'].split('/')[-1]} of {r['version']} ({human(r['size'])})" for r in info["refs"])
         or "-"),
        ("compression", f"{ratio:.2f}x" if ratio else "-"),
        ("encryption", _encryption_text(m, info)),
        ("codec chains", ", ".join(sorted(m.codecs)) or "raw"),
        ("objects", f"{len(m.objects)} shard(s) + DCP metadata"),
        ("writer", m.writer or "-"),
        ("user metadata", json.dumps(m.user, sort_keys=True) if m.user else "-"),
        ("pinned", pinned),
        ("integrity", "marked DAMAGED by scrub (see the tier lines)" if info["damaged"] else "not marked damaged"),
        ("non-finite", _nonfinite_row(m.nonfinite)),
        ("order", f"step {'-' if m.step is None else m.step}, commit sequence {'-' if m.seq is None else m.seq}"
                  + (" (commit time in the future of this host's clock)" if info["in_future"] else "")),
        ("supersedes", "; ".join(f"attempt {d['attempt']} ({d.get('reason', '')})" for d in info["supersedes"]) or "-"),
    ]


def _nonfinite_row(nf) -> str:
    from ..manifest.schema import nonfinite_text

    if nf is None:
        return "unknown (not counted: an older release or count_nonfinite=False)"
    if not nf["count"]:
        return "none (every floating value finite)"
    return nonfinite_text(nf) + "; not the default restore point (load it by name, or allow_nonfinite=True)"


def _encryption_text(m, info: dict) -> str:
    if not m.encrypted:
        return "none (not encrypted)"
    text = f"{m.encryption['alg']}, key id {m.encryption['key_id']}"
    if info.get("kms_key_arn"):
        text += f", data key wrapped by AWS KMS key {info['kms_key_arn']}"
    return text


def _tier_line(d: dict) -> str:
    parts = [f"attempt {d['attempt']}" + ("" if d["current"] else " (older copy)")]
    if d.get("part"):
        p = d["part"]
        dom = f", failure domain {p['domain']}" if p.get("domain") else ""
        parts.append(f"part {p['index']}/{p['count']} (ranks {', '.join(map(str, p['ranks']))}{dom}; the other parts live on other roots)")
    if d["pinned"]:
        parts.append("pinned" + (f" ({d['pin_note']})" if d["pin_note"] else ""))
    if d["damaged"]:
        parts.append(f"DAMAGED: {d['damage_reason']}")
    return ", ".join(parts)
