"""Numerical health: NaN/Inf values are counted while a save encodes, recorded per version
(docs/FORMAT.md, "Manifest": ``nonfinite``), shown by ``list``/``show``/``scrub``, skipped by the
restore choice ("Restore choice", rule 8) and left behind by ``CheckpointManager.rollback()``.

A save whose tensors hold NaN is bytes-perfect — every checksum matches — and still no restore point
(NVIDIA/nvidia-resiliency-ext #349, NVIDIA/Megatron-LM #5281: a job restarted 44 times from one).
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore.choice import NONFINITE, decide
from ckptstore.codec.numerics import RULES, count_nonfinite, rule_for
from ckptstore.errors import VersionNotFoundError
from ckptstore.manifest import catalogue, layout
from ckptstore.manifest.catalogue import VersionRecord
from ckptstore.manifest.objsets import ObjSet
from ckptstore.retention import REASON_FINITE, KeepLast, evaluate
from ckptstore.testing.dist import run_ranks
from ckptstore.tiers import LocalTier

import nonfinite_ranks as nr
from store_helpers import cli, cli_json

NAN, INF = float("nan"), float("inf")


def manifest(root, version):
    return catalogue.read_manifest(LocalTier(str(root)), version).manifest


def _reference(t: torch.Tensor) -> int:
    """NaN/Inf elements by torch's own isfinite; the 8-bit formats through float32 (every value is
    exact there): torch 2.13 has no isfinite for float8_e4m3fn/fnuz, and its isfinite calls the NaN of
    float8_e8m0fnu (0xFF) finite while its conversion to float32 gives NaN."""
    if t.element_size() == 1:
        return int((~torch.isfinite(t.float())).sum())
    return int((~torch.isfinite(t)).sum())


# -- counting -------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", sorted(RULES))
def test_count_equals_torch_isfinite_for_every_floating_dtype(name):
    """Every bit pattern class (random bytes: NaNs with any payload and sign, ±Inf, denormals, -0)."""
    dtype = getattr(torch, name)
    width = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(len(name))
    raw = torch.randint(0, 256, ((1 << 15) * width,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype)
    assert count_nonfinite(raw.numpy(), rule_for(name)) == _reference(t) > 0
    finite = torch.zeros(1 << 12, dtype=dtype)  # the fast path: nothing to count
    assert count_nonfinite(finite.view(torch.uint8).numpy(), rule_for(name)) == 0


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float64", "complex64"])
def test_count_finds_one_value_anywhere_of_either_sign(name):
    dtype = getattr(torch, name)
    for where in (0, 4095, 70_000, (1 << 17) - 1):  # across the blocks of the exact count
        for v in (NAN, INF, -INF, -NAN):
            t = torch.randn(1 << 17).to(dtype)
            t[where] = v
            assert count_nonfinite(t.view(torch.uint8).numpy(), rule_for(name)) == 1, (where, v)
    real = torch.float32 if name == "complex64" else dtype
    t = torch.full((10,), torch.finfo(real).max, dtype=real).to(dtype)
    t[3] = -t[3]  # the largest finite values, both signs: the bounds are exclusive
    assert count_nonfinite(t.view(torch.uint8).numpy(), rule_for(name)) == 0


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=4096).map(lambda b: b[: len(b) - len(b) % 8]),
       st.sampled_from(["bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2fnuz"]))
def test_count_of_any_bytes_equals_torch(data, name):
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, name)) if data else \
        torch.empty(0, dtype=getattr(torch, name))
    assert count_nonfinite(data, rule_for(name)) == _reference(t)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float64"])
@pytest.mark.parametrize("transform_none", [False, True])
def test_the_count_the_split_makes_while_encoding_equals_torch(name, transform_none):
    """A frame of more than 64 Ki floats is counted by the byte-grouping split as it reads each element
    (codec/_planes.c): the count the writer records equals torch's, at block edges (65,535 elements)
    and at either end, for NaN, -NaN, +Inf, -Inf, and for both transforms; the largest finite values
    (just below the bound) are not counted."""
    from ckptstore.codec import bytegroup
    from ckptstore.codec.frame import FrameCodec
    from ckptstore.dcp._frames import Scan, _encode

    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(7)
    n = (2 << 20) // torch.empty(0, dtype=dtype).element_size()
    t = (torch.randn(n, generator=g) * 0.02).to(dtype)
    if transform_none:  # zero low bits (an upcast): the sample picks no rotation
        t = (torch.randn(n, generator=g) * 0.02).to(torch.float16 if dtype.itemsize > 2 else dtype).to(dtype)
    for i, v in ((0, NAN), (65534, INF), (65535, -INF), (65536, -NAN), (131070, NAN), (n - 1, INF)):
        t[i] = v
    t[100] = torch.finfo(dtype).max
    t[101] = -torch.finfo(dtype).max
    raw = t.view(torch.uint8).numpy().tobytes()
    want = _reference(t)
    assert want == 6
    codec = FrameCodec("v1", "a1", None)
    width = t.element_size()
    _h, payload, _x, bad = _encode(codec, "obj", 0, memoryview(raw), width, bytegroup.PlanCell(), Scan(rule_for(name)))
    assert bad == want
    if bytegroup.NATIVE:  # the count came from the split, not from a second pass
        counted = []
        codec.encode("obj", 0, memoryview(raw), width, bytegroup.PlanCell(), rule_for(name).exp, counted)
        assert counted == [want]


def test_integers_bool_and_fp4_are_not_counted():
    for name in ("int32", "uint8", "bool", "float4_e2m1fn_x2", None):
        assert rule_for(name) is None and count_nonfinite(b"\xff" * 16, rule_for(name)) == 0


# -- recorded, listed, shown, scrubbed ------------------------------------------------------------------
def _poisoned(seed: int, nan_at=(), inf_at=()) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {"model": {"w": torch.randn(20_000, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g)},
          "optim": {"m": torch.randn(3000, generator=g, dtype=torch.float64)}, "ids": torch.arange(100), "meta": {"s": seed}}
    for i in nan_at:
        sd["model"]["w"][i] = NAN
    for i in inf_at:
        sd["optim"]["m"][i] = -INF
    return sd


def test_a_version_with_nan_is_recorded_listed_shown_and_scrubbed_but_not_damaged(tmp_path):
    root = str(tmp_path)
    dcp.save(_poisoned(1), checkpoint_id="v1", storage_writer=ckptstore.StorageWriter(root, step=1, frame_size=4096))
    w = ckptstore.StorageWriter(root, step=2, frame_size=4096)
    dcp.async_save(_poisoned(2, nan_at=(5, 19_999, 7000), inf_at=(0,)), checkpoint_id="v2", storage_writer=w).result()
    assert manifest(root, "v1").nonfinite == {"count": 0, "items": 0, "first": []}
    assert manifest(root, "v2").nonfinite == {"count": 4, "items": 2, "first": [{"key": "model.w", "count": 3},
                                                                             {"key": "optim.m", "count": 1}]}
    code, out = cli_json("list", root)
    assert code == 0 and [(v["version"], v["nonfinite"]) for v in out["versions"]] == [("v1", 0), ("v2", 4)]
    text = cli("list", root).output.splitlines()
    assert "nonfinite" not in text[1] and text[2].rstrip().endswith("nonfinite")
    code, out = cli_json("show", root, "v2")
    assert code == 0 and out["nonfinite"]["count"] == 4 and out["nonfinite"]["first"][0] == {"key": "model.w", "count": 3}
    shown = cli("show", root, "v2").output
    assert "4 NaN/Inf values in 2 items: model.w (3), optim.m (1)" in shown and "not the default restore point" in shown
    assert "none (every floating value finite)" in cli("show", root, "v1").output
    # scrub: a finding, exit 13; the bytes verify, nothing is marked damaged, also with --repair
    for args in ((), ("--repair",), ("--deep",)):
        code, out = cli_json("scrub", root, *args)
        assert code == 13, out
        v2 = next(v for v in out["versions"] if v["version"] == "v2")
        assert v2["status"] == "ok" and [(i["kind"], i["status"]) for i in v2["issues"]] == [("nonfinite", "finding")]
        assert out["summary"]["damaged"] == 0 and out["summary"]["nonfinite"] == 1
        assert not os.path.exists(os.path.join(root, *layout.damaged_key("v2").split("/")))
    r = cli("scrub", root)
    assert r.exit_code == 13 and "finding: nonfinite" in r.output and "1 with NaN/Inf values (not damage)" in r.output
    # the latest restore point is the finite one; by name (or allowed) the NaN version loads as saved
    st_ = ckptstore.Store(root)
    assert st_.latest().version == "v1" and st_.latest(allow_nonfinite=True).version == "v2"
    assert [r.damaged for r in st_.versions()] == [False, False]
    tgt = _poisoned(0)
    r1 = ckptstore.StorageReader(root)
    dcp.load(tgt, storage_reader=r1)
    assert r1.version == "v1" and [s.kind for s in r1.view.skipped] == [NONFINITE]
    tgt = _poisoned(0)
    dcp.load(tgt, checkpoint_id="v2", storage_reader=ckptstore.StorageReader(root))
    want = _poisoned(2, nan_at=(5, 19_999, 7000), inf_at=(0,))
    assert torch.equal(tgt["model"]["w"].view(torch.int16), want["model"]["w"].view(torch.int16))  # NaN bits too
    tgt = _poisoned(0)
    r2 = ckptstore.StorageReader(root, allow_nonfinite=True)
    dcp.load(tgt, storage_reader=r2)
    assert r2.version == "v2"


def test_counting_off_records_unknown_which_restores_like_an_older_manifest(tmp_path):
    """count_nonfinite=False writes what older releases wrote (no field): unknown, never skipped."""
    root = str(tmp_path)
    dcp.save(_poisoned(1), checkpoint_id="v1", storage_writer=ckptstore.StorageWriter(root, step=1))
    dcp.save(_poisoned(2, nan_at=(3,)), checkpoint_id="v2", storage_writer=ckptstore.StorageWriter(root, step=2,
                                                                                                   count_nonfinite=False))
    m = manifest(root, "v2")
    assert m.nonfinite is None and "nonfinite" not in json.loads(m.to_bytes(None))["body"]
    assert ckptstore.Store(root).latest().version == "v2"
    assert cli_json("list", root)[1]["versions"][1]["nonfinite"] is None
    assert "unknown (not counted" in cli("show", root, "v2").output
    assert cli("scrub", root).exit_code == 0


def test_an_incremental_reference_keeps_its_count(tmp_path):
    """An unchanged item is referenced, not written: the new version still counts its NaN values."""
    root = str(tmp_path)
    frozen = torch.randn(50_000)
    frozen[[10, 20, 30]] = NAN
    w = ckptstore.StorageWriter(root, incremental=True, frame_size=4096)
    for s in (1, 2):
        dcp.save({"frozen": frozen, "head": torch.full((100,), float(s))}, checkpoint_id=f"v{s}", storage_writer=w)
    m = manifest(root, "v2")
    assert [r.version for r in m.refs] == ["v1"]  # the frozen block is a reference
    assert m.nonfinite == manifest(root, "v1").nonfinite == {"count": 3, "items": 1, "first": [{"key": "frozen", "count": 3}]}


def test_the_manifest_field_is_checked_on_read(tmp_path):
    from ckptstore.errors import ManifestError
    from ckptstore.manifest.schema import canonical, parse, seal

    root = str(tmp_path)
    dcp.save(_poisoned(1, nan_at=(1,)), checkpoint_id="v1", storage_writer=ckptstore.StorageWriter(root))
    body = json.loads(manifest(root, "v1").to_bytes(None))["body"]
    for bad in ({"count": -1}, {"count": 1, "first": "w"}, {"count": 1, "first": [{"key": 3, "count": 1}]}, [1]):
        with pytest.raises(ManifestError):
            parse(seal(canonical({**body, "nonfinite": bad}), None))


# -- the restore choice (pure) and retention --------------------------------------------------------------
def _entry(v, step, nonfinite):
    a = f"20261201T100000-{step:012d}-00001"
    return {"attempt": a, "created": "2026-12-01T10:00:00.000000Z", "seq": None, "step": step, "damaged": False,
            "objects": [f"attempts/{a}/metadata.ckd", f"attempts/{a}/r00000.ckd"], "world_size": 1, "nbytes": 1,
            "supersedes": [], "groups": 1, "nonfinite": nonfinite}


def _reports(versions):
    """The job report (ckptstore/choice.py) of one rank whose root holds ``versions`` whole."""
    manifests, committed, held = {}, {}, {}
    for v, e in versions.items():
        a = e["attempt"]
        digest = "md5-" + a
        objs = ObjSet.of_names(a, e["objects"]).to_json()
        manifests[digest] = {**{k: e[k] for k in ("attempt", "created", "seq", "step", "world_size", "nbytes", "supersedes",
                                                  "groups", "nonfinite")}, "objects": objs, "refs": []}
        committed[v] = [digest, e["damaged"]]
        held[v] = {a: objs}
    return {"ranks": [[0, 0]], "roots": [{"root": "/r", "leader": 0, "committed": committed, "held": held, "invalid": {}}],
            "manifests": manifests, "remote": None, "remote_error": None, "invalid": {}, "restores": []}


def test_choice_skips_nonfinite_versions_unless_allowed_or_named():
    nf = {"count": 2, "items": 1, "first": [{"key": "model.w", "count": 2}]}
    vs = {"s1": _entry("s1", 1, None), "s2": _entry("s2", 2, {"count": 0, "items": 0, "first": []}),
          "s3": _entry("s3", 3, nf), "s4": _entry("s4", 4, nf)}
    v = decide(_reports(vs), None)
    assert v.version == "s2" and [(s.version, s.kind) for s in v.skipped] == [("s4", NONFINITE), ("s3", NONFINITE)]
    assert "2 NaN/Inf values in 1 item: model.w (2)" in v.skipped[0].reason
    assert set(v.newer) == {"s3", "s4"}  # the next saves of those names supersede them
    assert decide(_reports(vs), None, allow_nonfinite=True).version == "s4"
    assert decide(_reports(vs), "s3").version == "s3"  # named: loaded as it is
    del vs["s2"]
    assert decide(_reports(vs), None).version == "s1"  # not counted (an older release): not skipped
    del vs["s1"]
    with pytest.raises(VersionNotFoundError, match="NaN/Inf"):
        decide(_reports(vs), None)


def test_retention_keeps_the_newest_finite_version():
    now = dt.datetime(2026, 12, 2, tzinfo=dt.timezone.utc)

    def rec(v, step, nonfinite):
        return VersionRecord(v, now - dt.timedelta(hours=10 - step), step, 1, 1, 1, frozenset({"local"}), False, False,
                             f"a{step}", False, None, {}, nonfinite=nonfinite)

    recs = [rec("s1", 1, 0), rec("s2", 2, 0), rec("s3", 3, 5), rec("s4", 4, 5)]
    keep = {d.version: d.reasons for d in evaluate(recs, [KeepLast(1)], now) if d.keep}
    assert set(keep) == {"s2", "s4"} and keep["s2"] == (REASON_FINITE,)


# -- CheckpointManager: resume skips, rollback goes back ---------------------------------------------------
def test_resume_skips_a_nonfinite_version_with_the_reason_and_loads_it_by_name(tmp_path):
    from ckptstore import CheckpointManager

    root = str(tmp_path)
    model = torch.nn.Linear(16, 16)
    with CheckpointManager(root, {"model": model}, save_on_signal=None) as mgr:
        for s in (1, 2, 3):
            with torch.no_grad():
                model.weight.fill_(s)
                if s == 3:
                    model.bias[4] = NAN
            mgr.save(s)
    fresh = torch.nn.Linear(16, 16)
    with CheckpointManager(root, {"model": fresh}, save_on_signal=None) as mgr:
        assert mgr.resume() == 3 and torch.all(fresh.weight == 2)
        [sk] = mgr.last_restore.skipped
        assert (sk.version, sk.kind) == ("step-3", NONFINITE) and "model.bias (1)" in sk.reason
        assert mgr.latest() == "step-2"
        assert mgr.restore(version="step-3") == 3 and torch.isnan(fresh.bias[4]) and not mgr.last_restore.skipped
        assert mgr.restore(allow_nonfinite=True) == 3
        assert mgr.rollback() == 3 and torch.all(fresh.weight == 2) and torch.isfinite(fresh.bias).all()
        mgr.save(3)  # supersedes the NaN version (skipped at restore)
    rec = ckptstore.Store(root).get("step-3")
    assert rec.nonfinite == 0 and "nonfinite" in rec.supersedes[0][1]
    events = [json.loads(x) for x in open(os.path.join(root, "events.jsonl"))]
    assert [e["nonfinite"] for e in events if e["kind"] == "save"] == [0, 0, 1, 0]
    restores = [e for e in events if e["kind"] == "restore"]
    assert [e.get("rollback", False) for e in restores] == [False, False, False, True]
    assert restores[0]["skipped"][0]["kind"] == NONFINITE
    with CheckpointManager(str(tmp_path / "empty"), {"model": fresh}, save_on_signal=None) as mgr:
        with pytest.raises(VersionNotFoundError, match="nothing to roll back to"):
            mgr.rollback()


FAST = {"start_method": "forkserver", "preload": nr.PRELOAD}


def test_two_rank_loop_rolls_back_from_a_nan_and_ends_as_a_run_that_skipped_that_batch(tmp_path):
    """The batch at position 5 (step 6) holds a NaN on rank 0: the all-reduced gradients poison both
    ranks' parameters, step 6 is saved (recorded: NaN), the loss shows it, every rank calls
    rollback() — step-6 is skipped (nonfinite), step-4 restored — and the loop goes on without that
    batch. Its final state is bit for bit that of a run that skipped batch 5 from the start."""
    steps = 10
    hurt = run_ranks(nr.loop, 2, str(tmp_path / "hurt"), steps, 5, (), timeout=240, **FAST)
    clean = run_ranks(nr.loop, 2, str(tmp_path / "clean"), steps, None, (5,), timeout=240, **FAST)
    for rank, (h, c) in enumerate(zip(hurt, clean)):
        [rb] = h["rollbacks"]
        assert (rb["at"], rb["next"], rb["version"]) == (6, 5, "step-4"), rb
        assert [(s["version"], s["kind"]) for s in rb["skipped"]] == [("step-6", NONFINITE)]
        assert c["rollbacks"] == []
        hf, cf = (torch.load(io.BytesIO(x["final"])) for x in (h, c))
        assert hf["pos"] == cf["pos"] == steps + 1
        assert all(torch.equal(hf["model"][k], cf["model"][k]) for k in cf["model"]), rank
        assert all(torch.equal(hf["optim"][i][n], cf["optim"][i][n]) for i in cf["optim"] for n in ("exp_avg", "exp_avg_sq"))
        assert all(torch.isfinite(t).all() for t in hf["model"].values())
        assert torch.equal(hf["rng"], cf["rng"])
    recs = {r.version: r for r in ckptstore.Store(str(tmp_path / "hurt")).versions()}
    assert set(recs) == {f"step-{s}" for s in (2, 4, 6, 8, 10)} and all(r.nonfinite == 0 for r in recs.values())
    assert "nonfinite" in recs["step-6"].supersedes[0][1]  # the NaN save was superseded by the continued run
