"""The remote staging queue is bounded (docs/FORMAT.md, Save rule 8): saves that outpace the remote
tier — a rank whose S3 requests are refused (a host with a jumped clock, wrong credentials), an S3
that is slower than the save interval — keep at most ``UPLOAD_BACKLOG`` versions in flight; older ones
stay committed locally only, and local retention can reclaim them, so the local disk never fills with
versions waiting for S3. Real gloo ranks, real SeaweedFS (rank 1 gets its read-only credentials)."""

from __future__ import annotations

import pytest

import ckptstore
import roots_ranks
from ckptstore import retention as R
from ckptstore.dcp import upload
from ckptstore.testing.dist import run_ranks

FAST = dict(start_method="forkserver", preload=["roots_ranks"])


@pytest.mark.slow  # long (15-45 s); the default suite keeps a shorter case of the same kind (suite < 15 min)
@pytest.mark.s3
def test_a_rank_whose_uploads_are_refused_does_not_fill_the_local_roots(tmp_path, s3_url, seaweed):
    """12 saves while S3 refuses rank 1: before, every version waited ``upload_timeout`` for rank 1's
    upload marker, local retention kept them all as "uploading" and the roots grew by one version per
    save (the chaos run's full disk). Now each root holds at most keep-last + the pending versions +
    the queue's bound (the old code: 12), ``close()`` reports only the versions still queued, and nothing reached S3
    that a reader would take."""
    from ckptstore.testing import seaweed as sw

    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    ro = {"AWS_ACCESS_KEY_ID": sw.READONLY_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": sw.READONLY_SECRET_KEY}
    n, keep = 12, 1
    outs = run_ranks(roots_ranks.save_while_a_rank_is_refused, 2, roots, s3_url, n, keep, 20.0, env=[{}, ro],
                     timeout=400, **FAST)
    # + 1: the version whose remote commit was still waiting when the newest save's retention ran
    bound = keep + R.PENDING_KEPT + upload.UPLOAD_BACKLOG + 1
    for rank, (counts, err) in enumerate(outs):
        assert len(counts) == n
        assert max(counts) <= bound, (rank, str(counts), bound)
        assert err is not None and "UploadError" in err, (rank, err)  # the newest versions were not staged
    # the coordinator's report names the newest versions still queued, not the 12
    named = {f"v{i}" for i in range(1, n + 1) if f"'v{i}'" in outs[0][1] or f"v{i}/" in outs[0][1]
             or f"v{i} (" in outs[0][1]}
    assert named and named <= {f"v{i}" for i in range(n - upload.UPLOAD_BACKLOG + 1, n + 1)}, outs[0][1]
    # nothing committed remotely (rank 1's part never arrived); the newest version loads from the roots
    assert ckptstore.Store(None, remote=s3_url).versions() == []
    got = run_ranks(roots_ranks.load, 2, roots, **FAST)
    assert [g["version"] for g in got] == [f"v{n}"] * 2 and all(g["ok"] for g in got)


@pytest.mark.s3
def test_saves_faster_than_uploads_stage_the_newest_version(tmp_path, s3_url):
    """Two ranks, eight saves back to back with a working S3: whatever the queue skipped, ``close()``
    raises nothing, the newest version is committed remotely and loads bit-exactly from S3 alone (empty
    roots), and every version is either committed remotely or reported skipped."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    n = 8
    skipped = run_ranks(roots_ranks.save_back_to_back, 2, roots, s3_url, n, **FAST)
    listed = [r.version for r in ckptstore.Store(None, remote=s3_url).versions()]
    assert f"v{n}" in listed
    assert set(listed) | set(skipped[0]) == {f"v{i}" for i in range(1, n + 1)}, (listed, skipped)
    empty = [str(tmp_path / "e0"), str(tmp_path / "e1")]
    got = run_ranks(roots_ranks.load, 2, empty, None, s3_url, **FAST)
    assert [g["version"] for g in got] == [f"v{n}"] * 2 and all(g["ok"] for g in got)


@pytest.mark.s3
def test_versions_superseded_during_an_outage_are_skipped_not_reported_at_close(tmp_path, s3_url, seaweed):
    """S3 down for five saves of one writer: every upload fails and waits for a retry. S3 back, then
    ``close()``: the newest ``UPLOAD_BACKLOG`` versions are uploaded, the older ones are skipped
    (``skipped_uploads``) and ``close()`` raises nothing (docs/FORMAT.md, Save rule 8) — before, the
    older versions' failures from the outage were reported as uploads that did not complete."""
    import os
    import time

    import torch
    import torch.distributed.checkpoint as dcp

    n = 5
    writer = ckptstore.StorageWriter(str(tmp_path / "root"), remote=s3_url,
                                     remote_options={"endpoint_url": os.environ.get("AWS_ENDPOINT_URL")})
    seaweed.stop()
    try:
        for i in range(1, n + 1):
            dcp.save({"w": torch.full((64,), float(i))}, checkpoint_id=f"v{i}", storage_writer=writer, no_dist=True)
        up = writer._up._uploader
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # every upload of the outage has failed and waits for a retry
            with up._lock:
                if all(f.done() for _w, f in up._pending):
                    break
            time.sleep(0.2)
    finally:
        seaweed.start()
    writer.close(120.0)  # raises UploadError when anything is reported as not uploaded
    listed = {r.version for r in ckptstore.Store(None, remote=s3_url).versions()}
    newest = {f"v{i}" for i in range(n - upload.UPLOAD_BACKLOG + 1, n + 1)}
    assert newest <= listed, listed
    assert listed | set(writer.skipped_uploads) == {f"v{i}" for i in range(1, n + 1)}, (listed, writer.skipped_uploads)
