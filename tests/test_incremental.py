"""Incremental saves (docs/FORMAT.md, "References"): a tensor that did not change is referenced, not
written or uploaded again. A frozen bf16 base (8 MiB) + a trained adapter and its AdamW state
(tests/incremental_ranks.py), saved 10 times through ``CheckpointManager(incremental=True)``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore import gc
from ckptstore.manifest import catalogue, layout
from ckptstore.testing.dist import run_ranks
from ckptstore.tiers import LocalTier

import incremental_ranks as ir
from store_helpers import cli

PRELOAD = ["torch", "torch.distributed.checkpoint", "ckptstore", "ckptstore.manager", "incremental_ranks"]
FAST = {"start_method": "forkserver", "preload": PRELOAD}


def stored_locally(root: str) -> int:
    total = 0
    for d, _dn, fns in os.walk(os.path.join(root, layout.VERSIONS)):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in fns if f.endswith(".ckd"))
    return total


def full_size(tmp_path) -> int:
    """Stored bytes of one full (non-incremental) save of the same state."""
    root = str(tmp_path / "full")
    state = ir.make()
    from ckptstore import CheckpointManager

    with CheckpointManager(root, state) as m:
        ir.step(state, 1)
        m.save(1)
    return stored_locally(root)


def test_ten_saves_of_a_frozen_base_store_it_once(tmp_path):
    root = str(tmp_path / "inc")
    fps = ir.train(0, 1, root, 10)
    full = full_size(tmp_path)
    assert stored_locally(root) <= 1.3 * full, (stored_locally(root), full)
    st = ckptstore.Store(root)
    recs = st.versions()
    assert [r.version for r in recs] == [f"step-{i}" for i in range(1, 11)]
    for r in recs[1:]:
        assert r.stored_bytes < 0.05 * full and r.ref_bytes > 0.9 * full, (r.version, r.stored_bytes, full)
        m = st.manifest(r.version).manifest
        assert m.format == "ckptstore/2" and {ref.version for ref in m.refs} == {"step-1"}
    for i in (1, 5, 10):  # every version loads bit-exact
        assert ir.load(0, 1, root, f"step-{i}") == fps[i]
    assert cli("scrub", root, "--deep").exit_code == 0
    assert not list(LocalTier(root).list(layout.LEASES + "/"))  # every save's lease went at its commit


def test_two_ranks_incremental_then_resharded_load_on_one(tmp_path):
    root = str(tmp_path)
    outs = run_ranks(ir.train, 2, root, 4, timeout=300, **FAST)
    assert outs[0] == outs[1]
    m = ckptstore.Store(root).manifest("step-4").manifest
    assert m.refs and m.world_size == 2
    assert ir.load(0, 1, root, "step-4") == outs[0][4]  # 2 -> 1 rank, through the references


def test_a_restarted_manager_references_the_version_it_restored(tmp_path):
    root = str(tmp_path)
    ir.train(0, 1, root, 2)
    fps = ir.train(0, 1, root, 2)  # a new process would do the same: resume, then save 3 and 4
    m = ckptstore.Store(root).manifest("step-3").manifest
    assert {r.version for r in m.refs} == {"step-1"}, m.refs  # the restore's baseline
    assert ir.load(0, 1, root, "step-4") == fps[4]


def test_retention_and_drop_keep_what_a_kept_version_references(tmp_path):
    from ckptstore.retention import KeepLast, RetentionPolicy

    root = str(tmp_path)
    ir.train(0, 1, root, 10)
    st = ckptstore.Store(root)
    base_obj = next(r for r in st.manifest("step-10").manifest.refs)
    base_key = layout.object_key(base_obj.version, base_obj.name)
    plan, res = gc.run(st.tiers, RetentionPolicy([KeepLast(2)]), grace=0)
    assert res.ok and [r.version for r in ckptstore.Store(root).versions()] == ["step-9", "step-10"]
    assert LocalTier(root).exists(base_key)  # step-1 is un-committed, its frozen base stays
    assert any("referenced by" in s.reason and s.key == base_key for s in plan.survivors), plan.survivors
    deleted = {a.key for a in plan.actions if a.op == "delete"}
    assert base_key not in deleted
    # exactly what no kept version references is gone
    t = LocalTier(root)
    kept = catalogue.scan(t)
    needed = {layout.object_key(v, o.name) for v, e in kept.items() for o in e.manifest.all_objects()}
    needed |= set(catalogue.referenced(kept))
    left = {i.key for i in t.list(layout.VERSIONS + "/") if i.key.endswith(".ckd")}
    assert left == needed, (left - needed, needed - left)
    assert cli("scrub", root, "--deep").exit_code == 0
    assert ir.load(0, 1, root, "step-10") == ir.load(0, 1, root, "step-10")
    # dropping the newest keeps what the other references; dropping both frees the base
    gc.apply(st.tiers, gc.plan_drop(ckptstore.Store(root), "step-10"))
    assert t.exists(base_key)
    gc.apply(st.tiers, gc.plan_drop(ckptstore.Store(root), "step-9"))
    plan, _ = gc.run(st.tiers, None, grace=0)
    assert not t.exists(base_key)


@pytest.mark.s3
def test_incremental_uploads_only_what_changed_and_loads_from_s3_alone(tmp_path, s3_url):
    root = str(tmp_path / "local")
    fps = ir.train(0, 1, root, 10, s3_url, {"durability": "remote"})
    full = full_size(tmp_path)
    remote = ckptstore.Store(None, remote=s3_url).remote
    per_version: dict = {}
    for info in remote.list(layout.VERSIONS + "/"):
        if info.key.endswith(".ckd"):
            per_version.setdefault(layout.version_of_key(info.key), 0)
            per_version[layout.version_of_key(info.key)] += info.size
    for i in range(2, 11):
        assert per_version[f"step-{i}"] <= 0.05 * full, (i, per_version[f"step-{i}"], full)
    assert not list(remote.list("leases/"))  # each remote commit's lease went with it
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert ir.load(0, 1, empty, "step-10", s3_url) == fps[10]  # from S3 alone


def test_with_a_key_a_spliced_frame_is_refused_and_rekey_keeps_references(tmp_path):
    from ckptstore.rekey import rekey

    k1, k2 = os.urandom(32), os.urandom(32)
    root = str(tmp_path)
    base = torch.randn(1 << 18)
    w = ckptstore.StorageWriter(root, key=k1, incremental=True, frame_size=1 << 16)
    for i in (1, 2):
        dcp.save({"base": base, "a": torch.full((8,), float(i))}, checkpoint_id=f"v{i}", storage_writer=w)
    other = str(tmp_path / "other")  # the same tensor saved in another store
    dcp.save({"base": base, "a": torch.zeros(8)}, checkpoint_id="v1", storage_writer=ckptstore.StorageWriter(other, key=k1))
    m1 = catalogue.read_manifest(LocalTier(root), "v1").manifest
    src = os.path.join(other, *layout.object_key("v1", catalogue.read_manifest(LocalTier(other), "v1").manifest.objects[0].name).split("/"))
    dst = os.path.join(root, *layout.object_key("v1", m1.objects[0].name).split("/"))
    good = open(dst, "rb").read()
    spliced = open(src, "rb").read()
    open(dst, "wb").write(spliced[: len(good)].ljust(len(good), b"\0"))
    tgt = {"base": torch.zeros(1 << 18), "a": torch.zeros(8)}
    with pytest.raises(BaseException) as ei:
        dcp.load(tgt, checkpoint_id="v2", storage_reader=ckptstore.StorageReader(root, key=k1))
    assert "IntegrityError" in repr(ei.value) or "verification" in str(ei.value)
    open(dst, "wb").write(good)
    assert rekey(ckptstore.Store(root), k1, k2).exit_code == 0
    tgt = {"base": torch.zeros(1 << 18), "a": torch.zeros(8)}
    dcp.load(tgt, checkpoint_id="v2", storage_reader=ckptstore.StorageReader(root, key=k2))
    assert torch.equal(tgt["base"], base) and tgt["a"][0].item() == 2.0


# -- the kill sweep with incremental saves on --------------------------------------------------------------
def _unreferenced(tier) -> list[str]:
    """Files under ``versions/`` that no committed manifest references (own objects or ``refs``)."""
    entries = catalogue.scan(tier)
    ref = set(catalogue.referenced(entries))
    for v, e in entries.items():
        d = layout.version_dir(v) + "/"
        ref |= {d + layout.MANIFEST, d + layout.PINNED, d + layout.DAMAGED} | {d + o.name for o in e.manifest.all_objects()}
    return sorted(i.key for i in tier.list(layout.VERSIONS + "/") if i.key not in ref)


def _audit(root, remote, fps) -> list[str]:
    """Every listed version loads bit-exact from each tier alone; scrub --deep clean; gc past the grace
    period leaves nothing unreferenced and deletes no referenced frame (everything still loads)."""
    import datetime as dt

    viol = []
    empty = os.path.join(os.path.dirname(root), "empty")
    os.makedirs(empty, exist_ok=True)

    def loads(phase):
        for tname, (r, rem) in {"local": (root, None), **({"remote": (empty, remote)} if remote else {})}.items():
            st = ckptstore.Store(r if tname == "local" else None, remote=rem)
            for rec in st.versions():
                step = int(rec.version.split("-")[1])
                try:
                    got = ir.load(0, 1, r, rec.version, rem)
                except BaseException as e:  # noqa: BLE001
                    viol.append(f"{phase}: {tname}: {rec.version} does not load: {type(e).__name__}: {str(e)[:300]}")
                    continue
                if got != fps[step]:
                    viol.append(f"{phase}: {tname}: {rec.version} loads other bytes")
            if st.problems:
                viol.append(f"{phase}: {tname}: invalid manifests {st.problems}")

    args = ["scrub", root, "--deep"] + (["--remote", remote] if remote else [])
    loads("after crash")
    r = cli(*args)
    if r.exit_code != 0:
        viol.append(f"after crash: scrub exit {r.exit_code}: {r.output[-600:]}")
    st = ckptstore.Store(root, remote=remote)
    _plan, res = gc.run(st.tiers, None, now=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2), grace=3600)
    if not res.ok:
        viol.append(f"gc failed: {res.failed}")
    for tname, t in st.tiers.items():
        left = [k for k in _unreferenced(t) if not k.endswith(".json")]
        if left:
            viol.append(f"after gc: {tname}: unreferenced objects left: {left[:6]}")
    loads("after gc")
    r = cli(*args)
    if r.exit_code != 0:
        viol.append(f"after gc: scrub exit {r.exit_code}: {r.output[-600:]}")
    return viol


SWEEP = ["write.frame:1@1", "write.commit@0", "write.metadata@0", "commit.manifest@0", "local.link@0",
         "commit.after_manifest@0", "upload.object@1", "s3.put_if_absent@0", "remote.manifest@0"]
S3_POINTS = {"upload.object@1", "s3.put_if_absent@0", "remote.manifest@0"}


def _sweep_params(default=("write.frame:1@1", "commit.after_manifest@0")):
    for f in SWEEP:
        marks = [] if f in default else [pytest.mark.slow]
        if f in S3_POINTS:
            marks.append(pytest.mark.s3)
        yield pytest.param(f, id=f.replace("@", "-r").replace(":", "-n"), marks=marks)


@pytest.mark.parametrize("fault", list(_sweep_params()))
def test_kill_sweep_with_incremental_saves(tmp_path, fault, request):
    """2 ranks, one root: steps 1-2 saved; the next run resumes (its baseline: step-2) and is killed at
    ``fault`` during the incremental save of step 3. Nothing half-visible, nothing referenced deleted."""
    remote = request.getfixturevalue("s3_url") if fault in S3_POINTS else None
    root = str(tmp_path / "root")
    fps = ir.reference(4)
    assert run_ranks(ir.crash_job, 2, root, 2, remote, str(tmp_path / "s0"), timeout=240, **FAST) == [
        {1: fps[1], 2: fps[2]}] * 2
    from ckptstore.testing.dist import run_ranks_raw

    codes = run_ranks_raw(ir.crash_job, 2, root, 1, remote, str(tmp_path / "s1"), env=[{"CKPTSTORE_FAULT": fault}] * 2,
                          timeout=120, **FAST)
    assert -9 in codes.values(), codes  # the fault point was reached
    listed = [r.version for r in ckptstore.Store(root).versions()]
    assert listed in (["step-1", "step-2"], ["step-1", "step-2", "step-3"]), listed
    if "step-3" in listed:
        assert ckptstore.Store(root).manifest("step-3").manifest.refs  # it was an incremental save
    viol = _audit(root, remote, fps)
    assert not viol, "\n".join(viol)
    outs = run_ranks(ir.crash_job, 2, root, 1, remote, str(tmp_path / "s2"), timeout=240, **FAST)  # the job goes on
    assert max(outs[0]) == len(listed) + 1 and outs[0][max(outs[0])] == fps[max(outs[0])]


@pytest.mark.parametrize("fault", ["gc.uncommit:2", pytest.param("gc.delete:2", marks=pytest.mark.slow)])
def test_gc_killed_over_incremental_versions_deletes_no_referenced_frame(tmp_path, fault):
    import subprocess
    import sys

    root = str(tmp_path / "root")
    fps = ir.train(0, 1, root, 3)
    env = dict(os.environ, CKPTSTORE_FAULT=fault, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-m", "ckptstore.cli", "gc", root, "--keep-last", "1", "--grace", "0"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr[-800:]
    assert "step-3" in [r.version for r in ckptstore.Store(root).versions()]
    viol = _audit(root, None, fps)
    assert not viol, "\n".join(viol)
    assert cli("gc", root, "--keep-last", "1", "--grace", "0").exit_code == 0
    assert [r.version for r in ckptstore.Store(root).versions()] == ["step-3"]
    assert ir.load(0, 1, root, "step-3") == fps[3]


def test_dropping_the_first_version_keeps_the_shared_base(tmp_path):
    root = str(tmp_path)
    fps = ir.train(0, 1, root, 3)
    st = ckptstore.Store(root)
    plan = gc.plan_drop(st, "step-1")
    base = next(iter(st.manifest("step-3").manifest.refs))
    key = layout.object_key(base.version, base.name)
    assert key not in {a.key for a in plan.actions} and any(s.key == key for s in plan.survivors)
    assert gc.apply(st.tiers, plan).ok
    assert [r.version for r in ckptstore.Store(root).versions()] == ["step-2", "step-3"]
    assert LocalTier(root).exists(key) and ir.load(0, 1, root, "step-3") == fps[3]
    out = cli("gc", root, "--grace", "0", "--dry-run").output
    assert "referenced by 'step-2', 'step-3'" in out, out


@pytest.mark.s3
def test_read_repair_rewrites_a_damaged_referenced_object_of_an_encrypted_store(tmp_path, s3_url):
    """A referenced object is repaired with its origin's codec (its frames are bound to the origin's
    version, attempt and data key), not the loaded version's: the damaged local copy is rewritten from
    the verified remote one."""
    key = os.urandom(32)
    root = str(tmp_path / "root")
    base = torch.randn(1 << 16)
    w = ckptstore.StorageWriter(root, remote=s3_url, key=key, incremental=True, durability="remote")
    for i in (1, 2):
        dcp.save({"base": base, "a": torch.full((8,), float(i))}, checkpoint_id=f"v{i}", storage_writer=w)
    w.close()
    ref = catalogue.read_manifest(LocalTier(root), "v2").manifest.refs[0]
    path = os.path.join(root, *layout.object_key(ref.version, ref.name).split("/"))
    good = open(path, "rb").read()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF  # inside a frame's payload
    open(path, "wb").write(bytes(bad))
    r = ckptstore.StorageReader(root, remote=s3_url, key=key, read_repair=True)
    tgt = {"base": torch.zeros(1 << 16), "a": torch.zeros(8)}
    dcp.load(tgt, checkpoint_id="v2", storage_reader=r)
    assert torch.equal(tgt["base"], base) and tgt["a"][0].item() == 2.0
    assert r.stats["fallback_reads"] >= 1 and r.stats["repaired"] == 1, r.stats
    assert open(path, "rb").read() == good


# -- an in-flight save's references (docs/FORMAT.md, "References", Delete rule 13) ---------------------------
class _Gated(__import__("torch.distributed.checkpoint.default_planner", fromlist=["x"]).DefaultSavePlanner):
    """Calls ``hook(fqn)`` before DCP hands each write item's data to the writer."""

    def __init__(self, hook):
        super().__init__()
        self._hook = hook

    def resolve_data(self, write_item):
        self._hook(write_item.index.fqn)
        return super().resolve_data(write_item)


def _cli_process(*args) -> subprocess.CompletedProcess:
    """``ckptstore ARGS`` in another process (as an operator or a cron job runs it)."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, "-m", "ckptstore.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("who", ["drop", "gc", "rm"])
def test_gc_or_drop_while_an_incremental_save_references_the_version_it_removes(tmp_path, who):
    """kopia #1949's race: ``step-2`` references ``step-1``'s frozen base; while it is written, another
    process removes ``step-1`` — ``ckptstore drop`` on request, or a cron ``gc --keep-last 1`` (default
    grace) on a root shared with a ``loader-`` writer, whose newest version is the one kept. The save
    in flight holds a lease on what it references: the removal un-commits ``step-1`` and keeps those
    frames; ``step-2`` commits and loads bit for bit; once it is gone too, gc frees them. Something
    that ignores leases (``rm`` of the frozen base's object) is caught when the rank's object is
    written: that rank writes every item whole, and the version commits without references."""
    import datetime as dt

    root = str(tmp_path / "root")
    base = torch.randn(1 << 16)
    w = ckptstore.StorageWriter(root, incremental=True, frame_size=1 << 14)
    dcp.save({"base": base, "adapter": torch.zeros(64)}, checkpoint_id="step-1", storage_writer=w)
    if who == "gc":  # the loader's writer: its newest version is what keep-last 1 keeps
        dcp.save({"pos": torch.tensor([7])}, checkpoint_id="loader-1", storage_writer=ckptstore.StorageWriter(root))
    ran = []

    def hook(fqn):
        if fqn == "base" or ran:
            return
        if who == "rm":
            m1 = catalogue.read_manifest(LocalTier(root), "step-1").manifest
            os.remove(os.path.join(root, *layout.object_key("step-1", m1.objects[0].name).split("/")))
            ran.append(subprocess.CompletedProcess([], 0, "", ""))
            return
        args = ["drop", root, "step-1", "--yes"] if who == "drop" else ["gc", root, "--keep-last", "1"]
        ran.append(_cli_process(*args))  # after 'base' was matched to step-1's frames, before the commit

    adapter = torch.ones(64)
    dcp.save({"base": base, "adapter": adapter}, checkpoint_id="step-2", storage_writer=w, planner=_Gated(hook))
    w.close()
    assert ran and ran[0].returncode == 0, ran[0].stderr[-2000:]
    st = ckptstore.Store(root)
    m = st.manifest("step-2").manifest
    if who == "rm":
        assert not m.refs and m.nbytes == m.objects[0].nbytes  # written whole after the re-check
        gc.apply(st.tiers, gc.plan_drop(st, "step-1"))  # (its object is gone: scrub would say so)
    else:
        assert {r.version for r in m.refs} == {"step-1"}  # it did reference the removed version
    assert "step-1" not in [r.version for r in ckptstore.Store(root).versions()]
    tgt = {"base": torch.zeros(1 << 16), "adapter": torch.zeros(64)}
    dcp.load(tgt, checkpoint_id="step-2", storage_reader=ckptstore.StorageReader(root))
    assert torch.equal(tgt["base"], base) and torch.equal(tgt["adapter"], adapter)
    assert cli("scrub", root, "--deep").exit_code == 0
    assert not list(LocalTier(root).list("leases/"))  # released at the commit
    # nothing is left behind: once step-2 goes, gc past the grace period frees step-1's frames too
    gc.apply(st.tiers, gc.plan_drop(st, "step-2"))
    gc.run(st.tiers, None, now=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2))
    assert not [i.key for i in LocalTier(root).list(layout.VERSIONS + "/") if "step-" in i.key], \
        list(LocalTier(root).list(layout.VERSIONS + "/"))


def _frozen_base_saves(root: str, n: int, *, writer_per_save: bool, incremental: bool = True) -> int:
    """``n`` saves of a frozen 4 MiB base and a changing adapter; returns the bytes stored."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(1 << 20, generator=g)
    w = None
    for i in range(1, n + 1):
        if w is None or writer_per_save:
            w = ckptstore.StorageWriter(root, incremental=incremental)
        dcp.save({"base": base, "adapter": torch.full((256,), float(i))}, checkpoint_id=f"step-{i}", storage_writer=w)
    return stored_locally(root)


def test_a_new_writer_for_every_save_takes_its_baseline_from_the_store(tmp_path):
    """The README's pattern builds a ``StorageWriter`` for every save; with ``incremental=True`` its
    baseline is the newest version of its scope committed in its root (``step-\\d+``), not the writer
    object's memory: six saves store the frozen base once, as one kept writer does, and each loads."""
    one = _frozen_base_saves(str(tmp_path / "one"), 1, writer_per_save=True)
    per_save = _frozen_base_saves(str(tmp_path / "per"), 6, writer_per_save=True)
    kept = _frozen_base_saves(str(tmp_path / "kept"), 6, writer_per_save=False)
    assert per_save <= 1.2 * one and kept <= 1.2 * one, (one, per_save, kept)
    st = ckptstore.Store(str(tmp_path / "per"))
    for i in range(2, 7):
        assert {r.version for r in st.manifest(f"step-{i}").manifest.refs} == {"step-1"}
    tgt = {"base": torch.zeros(1 << 20), "adapter": torch.zeros(256)}
    dcp.load(tgt, checkpoint_id="step-6", storage_reader=ckptstore.StorageReader(str(tmp_path / "per")))
    assert tgt["adapter"][0].item() == 6.0 and torch.equal(tgt["base"], torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)))
