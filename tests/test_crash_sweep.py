"""Kill sweep — SIGKILL a real 2-rank save (or a gc / scrub run) at every named fault point.

For each fault point (``ckptstore/_faults.py``) a real multi-process save is killed there
(``CKPTSTORE_FAULT=POINT[:N][@RANK]``; the other rank dies with it through the peer watchdog of
``crash_ranks``, as under ``torchrun``), then a fresh check in this process
(:func:`crash_ranks.audit`):

* every listed version loads bit-exactly, from each tier on its own;
* the version that was latest before the save still loads;
* the interrupted version is fully committed and loadable, or absent (per tier), and the outcome
  is the one the commit protocol predicts for that point;
* a deep scrub is clean;
* gc past the grace period leaves no garbage (local files, S3 objects, incomplete multipart
  uploads), and everything still loads and scrubs clean afterwards;
* saving the interrupted version again commits (attempt isolation).

A representative subset runs by default; the full sweep is ``@pytest.mark.slow``:
``CKPTSTORE_FULL=1 bash scripts/test.sh -k sweep -s`` (see docs/TESTING.md). The table of
fault point × outcome is written to ``<pytest tmp>/kill_sweep.{json,md}`` and printed at the end
of the module (visible with ``-s``); ``CKPTSTORE_SWEEP_REPORT=path.md`` also copies it there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

import ckptstore
import crash_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
KEY = bytes(range(32))
ROWS: list[dict] = []


@dataclasses.dataclass(frozen=True)
class Case:
    fault: str  # CKPTSTORE_FAULT value
    remote: bool = False
    key: bool = False
    big: bool = False  # 9 MiB per rank, uncompressed: multipart uploads
    overwrite: bool = False  # the save replaces the existing version v0
    kind: str = "save"  # "save" | "gc" | "scrub"
    expect: tuple = ()  # predicted outcome per tier, e.g. (("local", "absent"), ("remote", "absent"))
    default: bool = False

    @property
    def id(self) -> str:
        tags = [self.fault.replace("@", "-r").replace(":", "-n")]
        tags += [t for t, on in (("s3", self.remote), ("enc", self.key), ("big", self.big), ("overwrite", self.overwrite)) if on]
        return "_".join(tags)


L_ABSENT = (("local", "absent"),)
L_COMMITTED = (("local", "committed"),)
LR_ABSENT = (("local", "absent"), ("remote", "absent"))
L_ONLY = (("local", "committed"), ("remote", "absent"))

CASES = [
    # -- local tier: phase 1 (shards), phase 2 (metadata object, manifest) -------------------------
    Case("write.frame:3@1", key=True, expect=L_ABSENT, default=True),
    Case("write.frame:2@0", expect=L_ABSENT),
    Case("write.commit@1", expect=L_ABSENT),
    Case("write.commit@0", key=True, expect=L_ABSENT),
    Case("local.fsync:1@1", expect=L_ABSENT),
    Case("local.fsync:2@0", key=True, expect=L_ABSENT),  # rank 0's 2nd fsync: the metadata object
    Case("write.metadata@0", expect=L_ABSENT),
    Case("local.tmp_write@0", key=True, expect=L_ABSENT),
    Case("commit.manifest@0", expect=L_ABSENT),
    Case("local.link@0", expect=L_ABSENT, default=True),
    Case("commit.after_manifest@0", key=True, expect=L_COMMITTED, default=True),
    # overwrite=True replaces v0 with os.replace: old or new, never a mix
    Case("local.replace@0", overwrite=True, expect=(("local", "old"),)),
    Case("commit.after_manifest@0", overwrite=True, key=True, expect=(("local", "new"),)),
    # -- remote tier (durability="remote") -------------------------------------------------------
    Case("write.frame:2@1", remote=True, expect=LR_ABSENT),
    Case("upload.object@1", remote=True, key=True, expect=LR_ABSENT),
    Case("s3.part:1@0", remote=True, big=True, expect=LR_ABSENT, default=True),
    Case("s3.part:2@1", remote=True, big=True, key=True, expect=LR_ABSENT),
    Case("s3.complete@1", remote=True, big=True, expect=LR_ABSENT),
    Case("commit.after_manifest@0", remote=True, expect=L_ONLY),
    Case("s3.put_if_absent@0", remote=True, key=True, expect=L_ONLY),
    Case("remote.manifest@0", remote=True, expect=L_ONLY, default=True),
    # -- gc and scrub killed mid-run -------------------------------------------------------------
    Case("gc.uncommit:2", kind="gc", expect=(("local", "v0 un-committed"),)),
    Case("gc.delete:3", kind="gc", key=True, expect=(("local", "v0,v1 un-committed"),), default=True),
    Case("gc.uncommit:2", kind="gc", remote=True, expect=()),
    Case("gc.delete:4", kind="gc", remote=True, expect=()),
    Case("scrub.repair", kind="scrub", remote=True, expect=(("local", "committed"), ("remote", "committed"))),
    Case("upload.object@0", remote=True, expect=LR_ABSENT),
    Case("local.fsync:1@0", remote=True, key=True, expect=LR_ABSENT),
]
# every frame of either rank's shard (rank 0 writes 5 frames, rank 1 writes 9 at 4 KiB frames)
_listed = {c.fault for c in CASES if c.kind == "save" and not c.remote}
CASES += [Case(f"write.frame:{n}@{r}", key=bool(n % 2), expect=L_ABSENT)
          for r, frames in ((0, 5), (1, 9)) for n in range(1, frames + 1) if f"write.frame:{n}@{r}" not in _listed]


def _params():
    for c in CASES:
        marks = [] if c.default else [pytest.mark.slow]
        if c.remote:
            marks.append(pytest.mark.s3)
        yield pytest.param(c, id=c.id, marks=marks)


@pytest.fixture(scope="module", autouse=True)
def sweep_report(tmp_path_factory):
    yield
    if not ROWS:
        return
    d = tmp_path_factory.getbasetemp()
    lines = [
        "| fault point | tier(s) | opts | killed | outcome | expected | violations | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        lines.append(
            f"| `{r['fault']}` | {r['tiers']} | {r['opts'] or '-'} | {r['killed']} | {r['outcome']} | "
            f"{r['expected']} | {len(r['violations'])} | {r['seconds']:.1f} |"
        )
    total = sum(len(r["violations"]) for r in ROWS)
    lines.append(f"\n{len(ROWS)} cases, {total} violations, {sum(r['seconds'] for r in ROWS):.0f} s")
    md = "\n".join(lines)
    (d / "kill_sweep.md").write_text(md + "\n")
    (d / "kill_sweep.json").write_text(json.dumps(ROWS, indent=2))
    extra = os.environ.get("CKPTSTORE_SWEEP_REPORT")
    if extra:
        with open(extra, "w") as f:
            f.write(md + "\n")
    print(f"\n\nkill sweep ({d / 'kill_sweep.md'}):\n{md}\n")


def _killed(codes: dict, scratch: str) -> tuple[list, list]:
    by_fault, by_watchdog = [], []
    for r, c in sorted(codes.items()):
        if c == 0:
            continue
        (by_watchdog if os.path.exists(os.path.join(scratch, f"watchdog.r{r}")) else by_fault).append((r, c))
    return by_fault, by_watchdog


def _outcome(state: dict, version: str, overwrite: bool) -> dict:
    out = {}
    for tier, vs in state.items():
        if version not in vs:
            out[tier] = "absent"
        elif overwrite:
            out[tier] = {0: "old", 1: "new"}.get(vs[version], "WRONG")
        else:
            out[tier] = "committed" if vs[version] == 0 else "WRONG"
    return out


_OUT = [0]


def _cli(args: list, env_extra: dict, tmp) -> tuple[int, str]:
    _OUT[0] += 1
    return crash_ranks.run_cli_fast(args, env_extra, str(tmp / f"cli{_OUT[0]}.out"))


@pytest.mark.parametrize("case", list(_params()))
def test_kill_sweep(case: Case, tmp_path, request):
    remote = request.getfixturevalue("s3_url") if case.remote else None
    key = KEY if case.key else None
    root = str(tmp_path / "root")
    t0 = time.monotonic()
    if case.kind == "save":
        outcome, killed, viol, expected = _save_case(case, root, remote, key, tmp_path)
    elif case.kind == "gc":
        outcome, killed, viol, expected = _gc_case(case, root, remote, key, tmp_path)
    else:
        outcome, killed, viol, expected = _scrub_case(case, root, remote, key, tmp_path)
    ROWS.append(
        {
            "fault": case.fault,
            "kind": case.kind,
            "tiers": "local+s3" if remote else "local",
            "opts": ",".join(t for t, on in (("enc", case.key), ("9MiB/rank", case.big), ("overwrite", case.overwrite)) if on),
            "killed": killed,
            "outcome": outcome,
            "expected": expected,
            "violations": viol,
            "seconds": time.monotonic() - t0,
        }
    )
    assert not viol, "\n".join(viol)


def _save_case(case: Case, root, remote, key, tmp_path):
    durability = "remote" if remote else "local"
    common = dict(remote=remote, durability=durability, key=key, frame_size=(1 << 20) if case.big else 4096,
                  compression="none" if case.big else "auto")
    # v0: the latest version before the killed save (same logical content a 2-rank save has)
    crash_ranks.local_save(root, "v0", 0, big=case.big, **common)
    version = "v0" if case.overwrite else "v1"
    scratch = str(tmp_path / "scratch")
    opts = dict(common, scratch=scratch, big=case.big)
    if case.overwrite:
        opts["overwrite"] = True
    env = {"CKPTSTORE_FAULT": case.fault}
    codes = crash_ranks.run_ranks_fast(crash_ranks.crash_save, 2, root, version, 1, opts, env=env, timeout=60)
    by_fault, by_wd = _killed(codes, scratch)
    viol = []
    if not by_fault:
        viol.append(f"fault point {case.fault} was never reached (exit codes {codes}): the sweep does not exercise it")
    killed = ", ".join([f"r{r} at fault" for r, _ in by_fault] + [f"r{r} by watchdog" for r, _ in by_wd]) or "none"
    content_new = (1, 2, case.big)
    content_old = (0, 2, case.big)
    expected = {"v0": [content_old, content_new] if case.overwrite else [content_old]}
    if not case.overwrite:
        expected["v1"] = [content_new]
    state, v2 = crash_ranks.audit(root, remote, key, expected)
    viol += v2
    if not case.overwrite and any("v0" not in s for s in state.values()):
        viol.append(f"the version that was latest before the save is gone: {state}")
    outcome = _outcome(state, version, case.overwrite)
    for tier, want in case.expect:
        if outcome.get(tier) != want:
            viol.append(f"{tier}: outcome {outcome.get(tier)!r}, the commit protocol predicts {want!r} at {case.fault}")
    # a retry of the same version commits (never mixes with the dead attempt)
    if not case.overwrite and all(o == "absent" for o in outcome.values()):
        crash_ranks.local_save(root, "v1", 7, big=case.big, **common)
        for tier, (r, rem) in crash_ranks._tier_stores(root, remote).items():
            idx, why = crash_ranks.match_content(r, rem, "v1", [(7, 2, case.big)], key)
            if idx != 0:
                viol.append(f"retry after the crash: {tier}: {why}")
    # a remote commit cut off after the local one is finished by the next save's writer
    if remote and outcome == {"local": "committed", "remote": "absent"}:
        crash_ranks.local_save(root, "v2", 2, big=case.big, **common)
        for v, seed in (("v1", 1), ("v2", 2)):
            idx, why = crash_ranks.match_content(None, remote, v, [(seed, 2, case.big)], key)
            if idx != 0:
                viol.append(f"after the next save, {v} is not committed remotely: {why}")
        _state, v3 = crash_ranks.audit(root, remote, key, dict(expected, v2=[(2, 2, case.big)]))
        viol += v3
        outcome["remote"] = "absent (staged by the next save)"
    out = " ".join(f"{t}:{o}" for t, o in sorted(outcome.items()))
    exp = " ".join(f"{t}:{o}" for t, o in case.expect)
    return out, killed, viol, exp


def _gc_case(case: Case, root, remote, key, tmp):
    """Three versions; ``gc --keep-last 1 --grace 0`` killed at the point; then a clean audit."""
    common = dict(remote=remote, durability="remote" if remote else "local", key=key)
    for i in range(3):
        crash_ranks.local_save(root, f"v{i}", i, **common)
    args = ["gc", root, "--keep-last", "1", "--grace", "0"] + (["--remote", remote] if remote else [])
    rc, out = _cli(args, {"CKPTSTORE_FAULT": case.fault}, tmp)
    viol = []
    if rc != -9:
        viol.append(f"gc was not killed at {case.fault} (exit {rc}): {out[-800:]}")
    expected = {f"v{i}": [(i, 2, False)] for i in range(3)}
    state, v2 = crash_ranks.audit(root, remote, key, expected)
    viol += v2
    for tier, vs in state.items():
        if "v2" not in vs:
            viol.append(f"{tier}: gc killed mid-run deleted the newest version")
    outcome = " ".join(f"{t}:[{','.join(sorted(vs))}]" for t, vs in sorted(state.items()))
    # finishing the interrupted gc reaches the policy's result
    rc, out = _cli(args, {}, tmp)
    if rc != 0:
        viol.append(f"re-running gc failed: exit {rc}: {out[-800:]}")
    state2, v3 = crash_ranks.audit(root, remote, key, expected)
    viol += v3
    for tier, vs in state2.items():
        if sorted(vs) != ["v2"]:
            viol.append(f"{tier}: after re-running gc --keep-last 1: {sorted(vs)}")
    exp = "v2 always listed; rerun leaves [v2]"
    return outcome, "gc process at fault", viol, exp


def _scrub_case(case: Case, root, remote, key, tmp):
    """v0 on both tiers; damage the local shard; ``scrub --repair`` killed before the repair write."""
    from ckptstore.manifest import layout

    crash_ranks.local_save(root, "v0", 0, remote=remote, durability="remote", key=key)
    m = ckptstore.Store(root).manifest("v0", "local").manifest
    path = os.path.join(root, layout.object_key("v0", m.objects[0].name))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    args = ["scrub", root, "--remote", remote, "--repair"]
    rc, out = _cli(args, {"CKPTSTORE_FAULT": case.fault}, tmp)
    viol = []
    if rc != -9:
        viol.append(f"scrub was not killed at {case.fault} (exit {rc}): {out[-800:]}")
    # killed mid-repair: the version is still committed in both tiers, and a load (which falls
    # back to the remote copy for the damaged frames) is bit-exact
    st = ckptstore.Store(root, remote=remote)
    tiers = sorted(st.get("v0").tiers) if [r.version for r in st.versions()] == ["v0"] else []
    if tiers != ["local", "remote"]:
        viol.append(f"after the killed repair v0 is committed in {tiers}")
    try:
        ok = crash_ranks.load_state(root, "v0", 0, remote=remote, key=key)
    except BaseException as e:  # noqa: BLE001
        ok = f"{type(e).__name__}: {e}"
    if ok is not True:
        viol.append(f"load with fallback to the remote copy: {ok}")
    rc, out = _cli(args, {}, tmp)
    if rc != 11:
        viol.append(f"re-running scrub --repair: exit {rc} (expected 11, repaired): {out[-800:]}")
    state, v2 = crash_ranks.audit(root, remote, key, {"v0": [(0, 2, False)]})
    viol += v2
    outcome = " ".join(f"{t}:{'committed' if 'v0' in vs else 'absent'}" for t, vs in sorted(state.items()))
    return outcome, "scrub process at fault", viol, "local:committed remote:committed; rerun repairs (exit 11)"
