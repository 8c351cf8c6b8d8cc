"""Staging to S3, remote commit and restore — against a real SeaweedFS server."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.manifest import layout
from ckptstore.testing.dist import run_ranks, run_ranks_raw
from ckptstore.tiers.s3 import S3Tier

import dcp_ranks
from helpers import bits_equal, failures, load, save

pytestmark = pytest.mark.s3


def _remote_manifests(url):
    t = S3Tier(url)
    return sorted(i.key for i in t.list("versions/") if i.key.endswith("/manifest.json"))


def _incomplete_uploads(url):
    t = S3Tier(url)
    return list(t.list_multipart_uploads(""))


# Case 1: save 2 ranks with remote, delete local root, load on 1 and 3 ranks from S3 only
@pytest.mark.s3_both(moto_slow=True)  # moto in the slow set (suite time); SeaweedFS in the default one
def test_remote_only_restore_after_local_loss(tmp_path, s3_url):
    root = str(tmp_path / "nvme")
    key = os.urandom(32)
    outs = run_ranks(dcp_ranks.s3_save, 2, root, s3_url, "v1", 5, "remote", key)
    assert outs == [("ok", None)] * 2
    st = ckptstore.Store(root, remote=s3_url)
    assert [(r.version, sorted(r.tiers)) for r in st.versions()] == [("v1", ["local", "remote"])]
    shutil.rmtree(root)
    assert [(r.version, sorted(r.tiers)) for r in ckptstore.Store(root, remote=s3_url).versions()] == [("v1", ["remote"])]
    for world in (1, 3):
        assert all(run_ranks(dcp_ranks.s3_load, world, root, s3_url, "v1", 5, key))
    from click.testing import CliRunner

    from ckptstore.cli import main

    res = CliRunner().invoke(main, ["list", root, "--remote", s3_url, "--json"])
    assert res.exit_code == 0, res.output
    import json

    (v,) = json.loads(res.stdout)["versions"]  # stderr warns that the local root does not exist
    assert v["version"] == "v1" and v["tiers"] == ["remote"]


def test_durability_local_uploads_in_background(tmp_path, s3_url):
    root = str(tmp_path)
    w = ckptstore.StorageWriter(root, remote=s3_url)  # durability="local" (default)
    sd = {"a": torch.randn(300_000), "b": {"x": [1, 2]}}
    dcp.save(sd, checkpoint_id="v1", storage_writer=w)
    assert "local" in ckptstore.Store(root, remote=s3_url).get("v1").tiers
    w.close()  # waits for the upload and the remote commit
    assert ckptstore.Store(root, remote=s3_url).get("v1").tiers == {"local", "remote"}
    shutil.rmtree(root)
    tgt = load({"a": torch.zeros(300_000), "b": {"x": [0, 0]}}, root, "v1", remote=s3_url)
    assert bits_equal(tgt["a"], sd["a"]) and tgt["b"] == {"x": [1, 2]}


# Case 2: awkward names
@pytest.mark.parametrize(
    "prefix",
    ["runs/exp[1]/", "with space/", "plus+pct%hash#/", "ünï/cödé", "no-trailing", "double//slash/"],
)
def test_awkward_prefixes_round_trip_or_refused_up_front(tmp_path, s3_bucket, s3_env, prefix):
    url = f"s3://{s3_bucket}/aw-{os.urandom(3).hex()}/{prefix}"
    try:
        w = ckptstore.StorageWriter(str(tmp_path), remote=url, durability="remote")
    except ckptstore.CkptStoreError as e:  # refused up front, with a message
        assert "s3://" in str(e) or "prefix" in str(e)
        return
    names = ["step 1+2%#ü", "run/ü-ñ"]
    for n in names:
        dcp.save({"a": torch.ones(3)}, checkpoint_id=n, storage_writer=w)
    w.close()
    shutil.rmtree(tmp_path)
    st = ckptstore.Store(str(tmp_path), remote=url)
    assert sorted(r.version for r in st.versions()) == sorted(names)
    for n in names:
        assert load({"a": torch.zeros(3)}, str(tmp_path), n, remote=url)["a"].sum() == 3


def test_bucket_with_dots(tmp_path, seaweed, s3_env):
    seaweed.create_bucket("dotted.bucket.name")
    url = "s3://dotted.bucket.name/p/"
    save({"a": torch.ones(3)}, str(tmp_path), "v", remote=url, durability="remote")
    shutil.rmtree(tmp_path)
    assert load({"a": torch.zeros(3)}, str(tmp_path), "v", remote=url)["a"].sum() == 3


# Case 3: SIGKILL the S3 server half-way through the uploads, restart it
def test_s3_killed_mid_upload(tmp_path, s3_url, seaweed):
    root = str(tmp_path)
    save({"a": torch.ones(4)}, root, "v0", remote=s3_url, durability="remote")
    tier = S3Tier(s3_url, part_size=5 << 20, max_attempts=3, connect_timeout=2, read_timeout=5)
    w = ckptstore.StorageWriter(root, remote=tier, durability="remote", compression="none", upload_timeout=30)
    sd = {"big": torch.randn(6 << 20)}  # 24 MiB: a multipart upload of several parts
    parts_seen = threading.Event()
    tier.client.meta.events.register("before-send.s3.UploadPart", lambda **kw: parts_seen.set())

    def killer():
        if parts_seen.wait(60):
            seaweed.kill()
            time.sleep(1.0)
            seaweed.start()

    th = threading.Thread(target=killer)
    th.start()
    outcome = None
    try:
        dcp.save(sd, checkpoint_id="v1", storage_writer=w)
        outcome = "saved"
    except BaseException as e:  # noqa: BLE001
        outcome = "failed"
        errs = failures(e)
        assert all(isinstance(x, ckptstore.CkptStoreError) for x in errs), errs
    th.join()
    try:
        w.close(timeout=60)
    except ckptstore.CkptStoreError:
        assert outcome == "failed"
    man = _remote_manifests(s3_url)
    if outcome == "saved":
        assert len(man) == 2
        shutil.rmtree(root)
        tgt = load({"big": torch.zeros(6 << 20)}, root, "v1", remote=s3_url)
        assert bits_equal(tgt["big"], sd["big"])
    else:
        assert man == [layout.manifest_key("v0")]  # no remote manifest for incomplete data
    assert _incomplete_uploads(s3_url) == []  # every failed multipart upload was aborted


# Case 4: one rank's upload fails permanently (read-only credentials on rank 1)
def test_one_rank_upload_denied(tmp_path, s3_url, seaweed):
    root = str(tmp_path)
    run_ranks(dcp_ranks.s3_save, 2, root, s3_url, "v1", 1, "remote")
    from ckptstore.testing import seaweed as sw

    ro = {"AWS_ACCESS_KEY_ID": sw.READONLY_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": sw.READONLY_SECRET_KEY}
    t0 = time.monotonic()
    outs = run_ranks(dcp_ranks.s3_save, 2, root, s3_url, "v2", 2, "remote", env=[{}, ro], timeout=120)
    assert time.monotonic() - t0 < 120
    assert all(o[0] == "error" for o in outs), outs
    assert any("RANK 1" in o[1] for o in outs)
    st = ckptstore.Store(None, remote=s3_url)
    assert st.latest().version == "v1"
    assert _remote_manifests(s3_url) == [layout.manifest_key("v1")]


# Case 5: a rank dies after the other's objects reached S3; the job saves the version again
@pytest.mark.slow  # long (15-45 s); the default suite keeps a shorter case of the same kind (suite < 15 min)
def test_retry_after_rank_death_names_only_new_attempt(tmp_path, s3_url):
    root = str(tmp_path)
    codes = run_ranks_raw(
        dcp_ranks.s3_save, 2, root, s3_url, "v1", 1, "remote",
        env=[{"CKPTSTORE_FAULT": "upload.object"}, {}], timeout=120,
    )
    assert codes[0] != 0
    first = {i.key for i in S3Tier(s3_url).list("versions/")}
    assert first and not any(k.endswith("manifest.json") for k in first)
    assert run_ranks(dcp_ranks.s3_save, 2, root, s3_url, "v1", 2, "remote") == [("ok", None)] * 2
    st = ckptstore.Store(None, remote=s3_url)
    m = st.manifest("v1", "remote").manifest
    assert all(o.name.split("/")[1] == m.attempt for o in m.all_objects())
    old_attempts = {k.split("/")[3] for k in first if "/attempts/" in k}
    assert m.attempt not in old_attempts
    shutil.rmtree(root)
    assert all(run_ranks(dcp_ranks.s3_load, 1, root, s3_url, "v1", 2))


# Case 6: part size adapts when size > part size x max parts
def test_part_size_adapts_to_small_max_parts(tmp_path, s3_url):
    tier = S3Tier(s3_url, max_parts=2)
    sd = {"big": torch.randn(5 << 20)}  # 20 MiB > 5 MiB x 2 parts
    save(sd, str(tmp_path), "v", remote=tier, durability="remote", compression="none")
    shutil.rmtree(tmp_path)
    tgt = load({"big": torch.zeros(5 << 20)}, str(tmp_path), "v", remote=s3_url)
    assert bits_equal(tgt["big"], sd["big"])


# Case 7: throttling
def test_throttling_503_slowdown(tmp_path, s3_url):
    from botocore.awsrequest import AWSResponse

    class _Raw:
        def __init__(self, b):
            self.b = b

        def stream(self, **kw):
            yield self.b

        def read(self, *a):
            return self.b

    count = {"n": 0}

    def throttle(request, **kw):
        count["n"] += 1
        if count["n"] % 3 == 0:
            body = b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>"
            return AWSResponse(request.url, 503, {"Content-Type": "application/xml"}, _Raw(body))
        return None

    tier = S3Tier(s3_url, retry_mode="standard", max_attempts=10)
    tier.client.meta.events.register("before-send.s3", throttle)
    root = str(tmp_path)
    for i in range(2):
        save({"a": torch.full((1000,), float(i))}, root, f"v{i}", remote=tier, durability="remote")
    st = ckptstore.Store(None, remote=tier)
    for _ in range(2):
        assert [r.version for r in st.versions()] == ["v0", "v1"]
    assert count["n"] > 10, count  # every third request was refused with 503 SlowDown, and retried
    tgt = load({"a": torch.zeros(1000)}, None, "v1", remote=tier)
    assert tgt["a"].eq(1.0).all()


def test_interrupted_remote_commit_is_finished_by_the_next_save(tmp_path, s3_url):
    """A crash after the local commit but before the remote one: the next writer stages it."""
    root = str(tmp_path)
    codes = run_ranks_raw(dcp_ranks.s3_save, 1, root, s3_url, "v1", 1, "remote", env={"CKPTSTORE_FAULT": "remote.manifest"}, timeout=60)
    assert codes[0] != 0
    st = ckptstore.Store(root, remote=s3_url)
    assert st.get("v1").tiers == {"local"}
    w = ckptstore.StorageWriter(root, remote=s3_url)
    dcp.save({"a": torch.ones(2)}, checkpoint_id="v2", storage_writer=w)
    w.close()
    assert {r.version: r.tiers for r in st.versions()} == {"v1": {"local", "remote"}, "v2": {"local", "remote"}}
    shutil.rmtree(root)
    assert all(run_ranks(dcp_ranks.s3_load, 1, root, s3_url, "v1", 1))


# streamed upload
class _GatedPlanner(__import__("torch.distributed.checkpoint.default_planner", fromlist=["x"]).DefaultSavePlanner):
    """Calls ``hook(fqn)`` before handing DCP each item's data (while the rank object is being written)."""

    def __init__(self, hook):
        super().__init__()
        self._hook = hook

    def resolve_data(self, write_item):
        self._hook(write_item.index.fqn)
        return super().resolve_data(write_item)


def _streamed_state():
    torch.manual_seed(5)
    return {f"t{i}": torch.randn(1 << 20) for i in range(4)}  # 4 x 4 MiB, stored uncompressed: 16 MiB


def test_parts_reach_s3_while_the_object_is_written(tmp_path, s3_url):
    """The last item is resolved only once a part of the same object has been sent to S3."""
    tier = S3Tier(s3_url, part_size=5 << 20)
    part_sent = threading.Event()
    tier.client.meta.events.register("before-send.s3.UploadPart", lambda **kw: part_sent.set())
    waited = {}

    def hook(fqn):
        if fqn == "t3":
            waited["ok"] = part_sent.wait(60)

    sd = _streamed_state()
    # one encoder thread: at most 2 frames (4 MiB) are encoded ahead of the ones written
    w = ckptstore.StorageWriter(str(tmp_path), remote=tier, durability="remote", compression="none", threads=1)
    dcp.save(sd, checkpoint_id="v1", storage_writer=w, planner=_GatedPlanner(hook))
    w.close()
    assert waited == {"ok": True}  # a part went up before the object's last bytes were written
    assert ckptstore.Store(None, remote=s3_url).get("v1").tiers == {"remote"}
    shutil.rmtree(tmp_path)
    tgt = load({k: torch.zeros_like(v) for k, v in sd.items()}, str(tmp_path), "v1", remote=s3_url)
    assert all(bits_equal(tgt[k], sd[k]) for k in sd)


@pytest.mark.parametrize("durability", ["local", "remote"])
def test_failed_local_write_aborts_the_streamed_upload(tmp_path, s3_url, durability):
    """A write that fails after parts were sent leaves no multipart upload, object or manifest in S3."""
    tier = S3Tier(s3_url, part_size=5 << 20)
    part_sent = threading.Event()
    tier.client.meta.events.register("before-send.s3.UploadPart", lambda **kw: part_sent.set())

    def hook(fqn):
        if fqn == "t3":
            assert part_sent.wait(60)
            raise OSError("simulated failure while writing the shard")

    w = ckptstore.StorageWriter(str(tmp_path), remote=tier, durability=durability, compression="none", threads=1)
    with pytest.raises(BaseException) as ei:  # DCP's CheckpointException is a BaseException
        dcp.save(_streamed_state(), checkpoint_id="v1", storage_writer=w, planner=_GatedPlanner(hook))
    assert "simulated failure" in str(ei.value)
    w.close()  # waits for the background abort
    assert _incomplete_uploads(s3_url) == []
    assert [i.key for i in S3Tier(s3_url).list("versions/")] == []
    # the name is free for a retry, which streams again
    w = ckptstore.StorageWriter(str(tmp_path), remote=tier, durability="remote", compression="none")
    sd = _streamed_state()
    dcp.save(sd, checkpoint_id="v1", storage_writer=w)
    w.close()
    assert ckptstore.Store(None, remote=s3_url).get("v1").tiers == {"remote"}
