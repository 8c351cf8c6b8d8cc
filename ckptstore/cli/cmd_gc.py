"""``ckptstore gc``: apply retention rules and remove garbage; ``--dry-run`` prints the plan only.

Exits 0 when every action succeeded (or was skipped for a safety re-check), else the exit code of
the first failure.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys

import click

from ._common import DURATION, emit_json, human, open_store, pin_note, plural, progress, reported_here, store_options


def _rule_options(tier: str | None):
    """``--keep-last`` & co., or their ``--<tier>-`` variants."""
    pre = f"{tier}-" if tier else ""
    dest = f"{tier}_" if tier else ""
    what = f"{tier.capitalize()} tier only: k" if tier else "K"

    def deco(f):
        f = click.option(f"--{pre}keep-best", f"{dest}keep_best", type=click.IntRange(min=0), default=None, metavar="N",
                         help=f"{what}eep the N best versions by --metric.")(f)
        f = click.option(f"--{pre}keep-within", f"{dest}keep_within", type=DURATION, default=None, metavar="DURATION",
                         help=f"{what}eep versions committed within DURATION (7d, 12h, 1d12h).")(f)
        f = click.option(f"--{pre}keep-every-steps", f"{dest}keep_every_steps", type=click.IntRange(min=1), default=None,
                         metavar="N", help=f"{what}eep the first version of every N training steps.")(f)
        f = click.option(f"--{pre}keep-last", f"{dest}keep_last", type=click.IntRange(min=0), default=None, metavar="N",
                         help=f"{what}eep the N newest versions.")(f)
        return f

    return deco


def _policy_from(kw: dict):
    from .. import retention as _ret

    metric, mode = kw.get("metric"), kw.get("mode") or "min"

    def rules(pre: str) -> tuple:
        return _ret.rules_from_options(
            keep_last=kw.get(f"{pre}keep_last"), keep_every_steps=kw.get(f"{pre}keep_every_steps"),
            keep_within=kw.get(f"{pre}keep_within"), keep_best=kw.get(f"{pre}keep_best"), metric=metric, mode=mode,
        )

    try:
        return _ret.RetentionPolicy(rules=rules(""), per_tier={t: rules(f"{t}_") for t in ("local", "remote")})
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _parse_now(text: str | None) -> _dt.datetime:
    if not text:
        return _dt.datetime.now(_dt.timezone.utc)
    try:
        t = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"not an ISO 8601 time: {text!r}", param_hint="--now") from None
    return t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)


def _pin_notes(st, p) -> dict[str, dict[str, str]]:
    """``{tier: {version: note}}`` for the pinned versions the plan decided on (notes that are set)."""
    out: dict[str, dict[str, str]] = {}
    for t, ds in p.decisions.items():
        for d in ds:
            if d.pinned:
                note = pin_note(st.tiers[t], d.version)
                if note:
                    out.setdefault(t, {})[d.version] = note
    return out


def _summary(p, dry_run: bool) -> str:
    from .. import gc as _gc

    per_tier: dict[str, int] = {}
    for a in p.actions:
        if a.op == _gc.UNCOMMIT:
            per_tier[a.tier] = per_tier.get(a.tier, 0) + 1
    c = p.counts()
    n = sum(per_tier.values())
    uncommitted = plural(n, "version copy", "version copies") + " un-committed"
    if per_tier:
        uncommitted += " (" + ", ".join(f"{k} in the {t} tier" for t, k in per_tier.items()) + ")"
    return (f"{uncommitted}, {plural(c[_gc.DELETE], 'object')} ({human(p.bytes_removed)}), "
            f"{plural(c[_gc.ABORT_UPLOAD], 'upload')} aborted, {plural(c[_gc.RMDIR], 'empty dir')}"
            + (" would be removed" if dry_run else " removed"))


def _print_plan(p, notes: dict, dry_run: bool) -> None:
    from ..retention import format_duration

    click.echo(f"gc plan at {p.now.isoformat(timespec='seconds')}, grace {format_duration(p.grace)}"
               + (" (dry run: nothing is removed)" if dry_run else ""))
    for t in p.tiers:
        ds = p.decisions.get(t, [])
        click.echo(f"{t} tier: {plural(len(ds), 'committed version')}; rules: {p.policy.describe(t)}")
        for d in ds:
            verb = "keep  " if d.keep else "DELETE"
            click.echo(f"  {verb} {d.version}  - {'; '.join(d.reasons)}")
            if t in notes and d.version in notes[t]:
                click.echo(f"         pin note: {notes[t][d.version]}")
    if p.actions:
        click.echo("would remove:" if dry_run else "removing:")
        for a in p.actions:
            size = f" ({human(a.size)})" if a.size else ""
            click.echo(f"  {a.op:<12} {a.tier:<6} {a.key}{size}  - {a.reason}")
    if p.survivors:
        click.echo("left alone (not removed):")
        for s in p.survivors:
            click.echo(f"  keep         {s.tier:<6} {s.key}  - {s.reason}")
    for t, key, why in p.problems:
        click.echo(f"warning: {t} tier: {key}: {why}", err=True)
    click.echo(_summary(p, dry_run))


def _log_gc(st, p, result, t0: float) -> None:
    """One ``gc`` line in the local root's event log (docs/FORMAT.md, "Event log"), when the root has one."""
    if st.root is None:
        return
    import time

    from .. import events

    path = events.default_path(st.root)
    if not os.path.exists(path):  # only a root a CheckpointManager writes its log into
        return
    deleted = p.deleted_versions
    try:
        events.append(path, "gc", source="cli", tiers=sorted(deleted), deleted=sorted({v for vs in deleted.values() for v in vs}),
                      deleted_per_tier=deleted, actions=len(result.applied), failed=len(result.failed),
                      freed_bytes=p.bytes_removed, t0=t0, seconds=time.time() - t0, outcome="ok" if result.ok else "failed",
                      error="; ".join(f"{a.op} {a.tier} {a.key}: {e}" for a, e in result.failed[:3]) or None)
    except OSError as e:
        click.echo(f"warning: could not append to the event log {path}: {e}", err=True)


def _print_result(result) -> None:
    for a, why in result.skipped:
        click.echo(f"skipped {a.op} {a.tier} {a.key}: {why}")
    for a, e in result.failed:
        click.echo(f"error: {a.op} {a.tier} {a.key} failed: {e}", err=True)
    click.echo(f"done: {len(result.applied)} applied, {len(result.skipped)} skipped, {len(result.failed)} failed")


@click.command("gc")
@store_options
@_rule_options(None)
@_rule_options("local")
@_rule_options("remote")
@click.option("--metric", default=None, metavar="NAME", help="User-metadata number ranked by --keep-best (dotted for nested).")
@click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True, help="Best is the lowest (min) or highest (max) metric.")
@click.option("--grace", type=DURATION, default="1h", show_default=True, metavar="DURATION",
              help="Unreferenced objects (and multipart uploads) younger than this are left alone.")
@click.option("--dry-run", is_flag=True, help="Print the plan (what would be removed and why survivors are kept); remove nothing.")
@click.option("--prefix", default=None, metavar="P",
              help="Apply the rules only to versions whose name starts with P (the others are kept), e.g. one "
                   "CheckpointManager's prefix on a root that several share.")
@click.option("--now", "now_text", default=None, hidden=True, help="Plan as of this ISO 8601 time (tests).")
def gc(root, remote, as_json, metric, mode, grace, dry_run, now_text, prefix, **rule_kw):
    """Apply retention rules and remove garbage (objects no committed version references).

    With no rule every committed version is kept. Per-tier rules (--local-*, --remote-*) are added
    to the general ones for that tier. The newest committed version and pinned versions are never
    deleted; retention un-commits a version (manifest first) before deleting its objects.
    """
    from .. import gc as _gc

    rule_kw.update(metric=metric, mode=mode)
    policy = _policy_from(rule_kw)
    if prefix:
        import dataclasses
        import re

        policy = dataclasses.replace(policy, match=re.escape(prefix) + ".*")
    now = _parse_now(now_text)
    st = open_store(root, remote)
    tiers = st.tiers
    for t in policy.per_tier:
        if t not in tiers:
            click.echo(f"warning: --{t}-* rules given, but this store has no {t} tier (use --remote URL)", err=True)
    with reported_here():
        p = _gc.plan([_gc.collect(t, n) for n, t in tiers.items()], policy, now, grace)
    notes = _pin_notes(st, p)
    result = None
    if not dry_run:
        import time

        t0 = time.time()
        with progress("gc", unit="actions") as (set_total, advance):
            set_total(len(p.actions))
            result = _gc.apply(tiers, p, on_action=lambda a, outcome: advance(1))
        _log_gc(st, p, result, t0)
    if as_json:
        emit_json({"dry_run": dry_run, "plan": p.to_json(), "pin_notes": notes,
                   "result": None if result is None else result.to_json()})
    else:
        _print_plan(p, notes, dry_run)
        if result is not None:
            _print_result(result)
    if result is not None and result.failed:
        sys.exit(result.exit_code())
