"""Operator commands: ``show``, ``gc``, ``scrub``, ``pin``, ``unpin`` (attached to ``ckptstore``).

Thin: parse, call :mod:`ckptstore.retention` / :mod:`ckptstore.gc` / :mod:`ckptstore.scrub`, print,
exit. Every command takes ``ROOT``, ``--remote URL``, ``--endpoint-url`` and ``--json``
(machine-readable output on stdout); long work shows a progress bar on stderr when stderr is a
terminal.

Exit codes: those of :mod:`ckptstore.errors` (3 version not found, 7 storage error, ...; 2 usage);
``gc`` exits 0 when every action succeeded (or was skipped for a safety re-check), else the exit
code of the first failure; ``scrub`` exits with :attr:`ckptstore.scrub.ScrubReport.exit_code`:
0 clean, 10 damage found (not all repaired), 11 damage found and all repaired, 12 something could
not be checked.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import sys

import click

from . import gc as _gc
from . import retention as _ret
from . import scrub as _scrub
from .cli import _human, handle_errors, open_store, store_options

COMMANDS = ("show", "gc", "scrub", "pin", "unpin")


def _emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


@contextlib.contextmanager
def _progress(description: str, unit: str = "bytes"):
    """Yields ``(set_total, advance)``; draws a rich progress bar only when stderr is a TTY."""
    if not sys.stderr.isatty():
        yield (lambda n: None), (lambda n: None)
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    cols = [TextColumn("{task.description}"), BarColumn()]
    cols += [DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn()]
    cols.append(TimeRemainingColumn())
    with Progress(*cols, console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task(description, total=None)
        yield (lambda n: prog.update(task, total=n)), (lambda n: prog.advance(task, n))


# -- show ----------------------------------------------------------------------------------------------
@click.command("show")
@store_options
@click.argument("version")
@click.option("--objects", "list_objects", is_flag=True, help="Also list every stored object.")
@handle_errors
def show(root, remote, endpoint_url, as_json, version, list_objects):
    """Summarise one committed VERSION: step, time, ranks, tiers, sizes, codecs, encryption, metadata."""
    from .manifest import catalogue, layout

    st = open_store(root, remote, endpoint_url)
    rec = st.get(version)
    tier_name = next(n for n in st.tiers if n in rec.tiers)
    m = st.manifest(version, tier_name).manifest
    per_tier = {}
    for n, t in st.tiers.items():
        try:
            pm = catalogue.read_manifest(t, version).manifest
        except Exception:  # noqa: BLE001 - not committed (or unreadable) there
            continue
        damaged = t.exists(layout.damaged_key(version))
        per_tier[n] = {
            "attempt": pm.attempt,
            "current": pm.attempt == rec.attempt,
            "pinned": t.exists(layout.pin_key(version)),
            "damaged": damaged,
            "damage_reason": catalogue.damage_note(t, version) if damaged else None,
        }
    ratio = (m.nbytes / m.stored_bytes) if m.stored_bytes else None
    info = {
        "version": version,
        "attempt": m.attempt,
        "step": m.step,
        "created": m.created,
        "world_size": m.world_size,
        "tiers": sorted(rec.tiers),
        "nbytes": m.nbytes,
        "stored_bytes": m.stored_bytes,
        "compression_ratio": round(ratio, 4) if ratio else None,
        "encrypted": m.encrypted,
        "key_id": (m.encryption or {}).get("key_id"),
        "encryption": (m.encryption or {}).get("alg"),
        "codecs": sorted(m.codecs),
        "user": m.user,
        "format": m.format,
        "writer": m.writer,
        "objects": len(m.all_objects()),
        "pinned": rec.pinned,
        "damaged": rec.damaged,
        "per_tier": per_tier,
    }
    if as_json:
        if list_objects:
            info["object_list"] = [o.to_json() for o in m.all_objects()]
        _emit_json(info)
        return
    rows = [
        ("version", version),
        ("attempt", m.attempt),
        ("step", "-" if m.step is None else m.step),
        ("created", m.created),
        ("world size", m.world_size),
        ("tiers", "+".join(sorted(rec.tiers))),
        ("logical size", f"{_human(m.nbytes)} ({m.nbytes} bytes)"),
        ("stored size", f"{_human(m.stored_bytes)} ({m.stored_bytes} bytes)"),
        ("compression", f"{ratio:.2f}x" if ratio else "-"),
        ("encryption", f"{m.encryption['alg']}, key id {m.encryption['key_id']}" if m.encrypted else "none (not encrypted)"),
        ("codec chains", ", ".join(sorted(m.codecs)) or "raw"),
        ("objects", f"{len(m.objects)} shard(s) + DCP metadata"),
        ("writer", m.writer or "-"),
        ("user metadata", json.dumps(m.user, sort_keys=True) if m.user else "-"),
    ]
    state = [s for s, on in (("pinned", rec.pinned), ("damaged", rec.damaged)) if on]
    rows.append(("retention", ", ".join(state) or "not pinned"))
    for k, v in rows:
        click.echo(f"{k + ':':<15} {v}")
    for n, d in per_tier.items():
        flags = [f"attempt {d['attempt']}" + ("" if d["current"] else " (older copy)")]
        if d["pinned"]:
            flags.append("pinned")
        if d["damaged"]:
            flags.append(f"DAMAGED: {d['damage_reason']}")
        click.echo(f"{n + ' tier:':<15} " + ", ".join(flags))
    if list_objects:
        for o in m.all_objects():
            click.echo(f"  {o.name}  {_human(o.size)}  {o.frames} frames  rank {'-' if o.rank is None else o.rank}  xxh3 {o.digest}")


# -- pin / unpin -------------------------------------------------------------------------------------------
@click.command("pin")
@store_options
@click.argument("version")
@click.option("--note", default="", help="Why it is pinned (stored with the pin).")
@handle_errors
def pin(root, remote, endpoint_url, as_json, version, note):
    """Pin VERSION in every tier that holds it: retention never deletes it."""
    st = open_store(root, remote, endpoint_url)
    st.pin(version, note)
    rec = st.get(version)
    if as_json:
        _emit_json({"version": version, "pinned": True, "tiers": sorted(rec.tiers)})
    else:
        click.echo(f"pinned {version} ({'+'.join(sorted(rec.tiers))})")


@click.command("unpin")
@store_options
@click.argument("version")
@handle_errors
def unpin(root, remote, endpoint_url, as_json, version):
    """Remove the pin of VERSION (it becomes eligible for retention again)."""
    st = open_store(root, remote, endpoint_url)
    rec = st.get(version)
    st.unpin(version)
    if as_json:
        _emit_json({"version": version, "pinned": False, "tiers": sorted(rec.tiers)})
    else:
        click.echo(f"unpinned {version}")


# -- gc -------------------------------------------------------------------------------------------------
def _rule_options(tier: str | None):
    """``--keep-last`` & co., or their ``--<tier>-`` variants."""
    pre = f"{tier}-" if tier else ""
    dest = f"{tier}_" if tier else ""
    what = f"{tier.capitalize()} tier only: k" if tier else "K"

    def deco(f):
        f = click.option(f"--{pre}keep-best", f"{dest}keep_best", type=click.IntRange(min=0), default=None, metavar="N",
                         help=f"{what}eep the N best versions by --metric.")(f)
        f = click.option(f"--{pre}keep-within", f"{dest}keep_within", default=None, metavar="DURATION",
                         help=f"{what}eep versions committed within DURATION (7d, 12h, 1d12h).")(f)
        f = click.option(f"--{pre}keep-every-steps", f"{dest}keep_every_steps", type=click.IntRange(min=1), default=None,
                         metavar="N", help=f"{what}eep the first version of every N training steps.")(f)
        f = click.option(f"--{pre}keep-last", f"{dest}keep_last", type=click.IntRange(min=0), default=None, metavar="N",
                         help=f"{what}eep the N newest versions.")(f)
        return f

    return deco


def _policy_from(kw: dict) -> _ret.RetentionPolicy:
    metric, mode = kw.get("metric"), kw.get("mode") or "min"
    try:
        general = _ret.rules_from_options(
            keep_last=kw.get("keep_last"), keep_every_steps=kw.get("keep_every_steps"), keep_within=kw.get("keep_within"),
            keep_best=kw.get("keep_best"), metric=metric, mode=mode,
        )
        per = {}
        for t in ("local", "remote"):
            per[t] = _ret.rules_from_options(
                keep_last=kw.get(f"{t}_keep_last"), keep_every_steps=kw.get(f"{t}_keep_every_steps"),
                keep_within=kw.get(f"{t}_keep_within"), keep_best=kw.get(f"{t}_keep_best"), metric=metric, mode=mode,
            )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return _ret.RetentionPolicy(rules=general, per_tier=per)


def _parse_now(text: str | None) -> _dt.datetime:
    if not text:
        return _dt.datetime.now(_dt.timezone.utc)
    try:
        t = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"not an ISO 8601 time: {text!r}", param_hint="--now") from None
    return t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)


def _print_plan(p: _gc.GcPlan, dry_run: bool) -> None:
    click.echo(f"gc plan at {p.now.isoformat(timespec='seconds')}, grace {_ret.format_duration(p.grace)}"
               + (" (dry run: nothing is removed)" if dry_run else ""))
    for t in p.tiers:
        ds = p.decisions.get(t, [])
        click.echo(f"{t} tier: {len(ds)} committed version(s); rules: {p.policy.describe(t)}")
        for d in ds:
            verb = "keep  " if d.keep else "DELETE"
            click.echo(f"  {verb} {d.version}  - {'; '.join(d.reasons)}")
    if p.actions:
        click.echo("would remove:" if dry_run else "removing:")
        for a in p.actions:
            size = f" ({_human(a.size)})" if a.size else ""
            click.echo(f"  {a.op:<12} {a.tier:<6} {a.key}{size}  - {a.reason}")
    for s in p.survivors:
        click.echo(f"  keep         {s.tier:<6} {s.key}  - {s.reason}")
    for t, key, why in p.problems:
        click.echo(f"warning: {t} tier: {key}: {why}", err=True)
    c = p.counts()
    click.echo(f"{c['uncommit']} version(s) un-committed, {c['delete']} object(s) ({_human(p.bytes_removed)}), "
               f"{c['abort-upload']} upload(s) aborted, {c['rmdir']} empty dir(s)"
               + (" would be removed" if dry_run else ""))


@click.command("gc")
@store_options
@_rule_options(None)
@_rule_options("local")
@_rule_options("remote")
@click.option("--metric", default=None, metavar="NAME", help="User-metadata number ranked by --keep-best (dotted for nested).")
@click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True, help="Best is the lowest (min) or highest (max) metric.")
@click.option("--grace", default="1h", show_default=True, metavar="DURATION",
              help="Unreferenced objects (and multipart uploads) younger than this are left alone.")
@click.option("--dry-run", is_flag=True, help="Print the plan (what would be removed and why survivors are kept); remove nothing.")
@click.option("--now", "now_text", default=None, hidden=True, help="Plan as of this ISO 8601 time (tests).")
@handle_errors
def gc(root, remote, endpoint_url, as_json, metric, mode, grace, dry_run, now_text, **rule_kw):
    """Apply retention rules and remove garbage (objects no committed version references).

    With no rule every committed version is kept. Per-tier rules (--local-*, --remote-*) are added
    to the general ones for that tier. The newest committed version and pinned versions are never
    deleted; retention un-commits a version (manifest first) before deleting its objects.
    """
    rule_kw.update(metric=metric, mode=mode)
    policy = _policy_from(rule_kw)
    try:
        grace_s = _ret.parse_duration(grace)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--grace") from None
    now = _parse_now(now_text)
    st = open_store(root, remote, endpoint_url)
    tiers = st.tiers
    for t in policy.per_tier:
        if t not in tiers:
            click.echo(f"warning: --{t}-* rules given, but this store has no {t} tier (use --remote URL)", err=True)
    snaps = [_gc.collect(t, n) for n, t in tiers.items()]
    p = _gc.plan(snaps, policy, now, grace_s)
    result = None
    if not dry_run:
        with _progress("gc", unit="actions") as (set_total, advance):
            set_total(len(p.actions))
            result = _gc.apply(tiers, p, on_action=lambda a, outcome: advance(1))
    if as_json:
        _emit_json({"dry_run": dry_run, "plan": p.to_json(), "result": None if result is None else result.to_json()})
    else:
        _print_plan(p, dry_run)
        if result is not None:
            for a, why in result.skipped:
                click.echo(f"skipped {a.op} {a.tier} {a.key}: {why}")
            for a, e in result.failed:
                click.echo(f"error: {a.op} {a.tier} {a.key} failed: {e}", err=True)
            click.echo(f"done: {len(result.applied)} applied, {len(result.skipped)} skipped, {len(result.failed)} failed")
    if result is not None and result.failed:
        sys.exit(result.exit_code())


# -- scrub ----------------------------------------------------------------------------------------------
@click.command("scrub")
@store_options
@click.option("--version", "version_name", default=None, metavar="V", help="Check only this version.")
@click.option("--deep", is_flag=True, help="Also decrypt and decompress every frame and check the DCP metadata (needs the key when encrypted).")
@click.option("--repair", is_flag=True, help="Restore damaged objects from the other tier; mark versions that cannot be repaired as damaged.")
@click.option("--key-file", default=None, type=click.Path(dir_okay=False), help="Master key file (else CKPTSTORE_KEY / CKPTSTORE_KEY_FILE).")
@handle_errors
def scrub(root, remote, endpoint_url, as_json, version_name, deep, repair, key_file):
    """Verify every committed version's objects in each tier (presence, size, frames, digests).

    Exit codes: 0 clean; 10 damage found (not all repaired); 11 damage found and all repaired;
    12 something could not be checked (key missing for --deep, tier unreachable).
    """
    key = None
    if key_file:
        from .codec.crypto import load_key_file

        key = load_key_file(key_file)
    st = open_store(root, remote, endpoint_url, key=key)
    with _progress("scrub") as (set_total, advance):
        report = _scrub.scrub(st, version=version_name, deep=deep, repair=repair, key=key, on_total=set_total, on_bytes=advance)
    if as_json:
        _emit_json(report.to_json())
    else:
        for line in _scrub.format_report(report):
            click.echo(line)
        if not report.versions and not report.unreachable:
            click.echo("no committed versions")
        s = report.to_json()["summary"]
        click.echo(f"{s['versions']} version copies, {s['objects']} objects: {s['damaged']} damaged, "
                   f"{s['repaired']} repaired, {s['unchecked']} not fully checked (exit {report.exit_code})")
    if report.exit_code:
        sys.exit(report.exit_code)


def _attach() -> None:
    """Attach to ``ckptstore.cli.main`` also when this module is imported before ``cli``."""
    from . import cli

    for n in COMMANDS:
        if n not in cli.main.commands:
            cli.main.add_command(globals()[n])


_attach()
