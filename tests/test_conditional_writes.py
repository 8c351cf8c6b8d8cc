"""An S3 endpoint that ignores ``If-None-Match`` (pithings/mountx #19; untested by ceph/s3-tests
#583): remote commits are refused with ``ConditionalWritesError`` after a probe, unless opted out.
The endpoint is moto behind ``tests/header_proxy.HeaderStrippingProxy`` (the header never arrives,
so moto overwrites like such a server)."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptstore
from ckptstore.errors import ConditionalWritesError, ObjectExistsError
from ckptstore.tiers.s3 import CONDITIONAL_WRITES_ENV, S3Tier

from header_proxy import HeaderStrippingProxy

pytestmark = pytest.mark.s3


@pytest.fixture
def ignoring(moto, monkeypatch):
    """``(proxy, url)``: the boto3 chain pointed at moto through the header-stripping proxy."""
    for k, v in moto.env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", CONDITIONAL_WRITES_ENV):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    with HeaderStrippingProxy(moto.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        yield proxy, f"s3://ckptstore-test/t-{uuid.uuid4().hex[:12]}/"


def _state(x: float) -> dict:
    return {"w": torch.full((1000,), x), "meta": {"x": x}}


def _keys(url: str, prefix: str = "") -> list[str]:
    t = S3Tier(url, conditional_writes="trust")
    try:
        return sorted(i.key for i in t.list(prefix))
    finally:
        t.close()


def test_the_proxy_makes_moto_ignore_the_header(ignoring):
    """What ckptstore guards against: through the proxy a conditional PUT of an existing key
    succeeds and overwrites, so without the check two writers would both "commit"."""
    proxy, url = ignoring
    t = S3Tier(url, conditional_writes="trust")
    t.put_if_absent("versions/v/manifest.json", b"writer A")
    t.put_if_absent("versions/v/manifest.json", b"writer B")  # no ObjectExistsError: overwritten
    assert t.get("versions/v/manifest.json") == b"writer B" and proxy.stripped == 2
    t.close()


def test_remote_commit_through_an_ignoring_endpoint_is_refused(ignoring, tmp_path):
    proxy, url = ignoring
    w = ckptstore.StorageWriter(tmp_path / "root", remote=url, durability="remote")
    with pytest.raises(CheckpointException) as ei:
        dcp.save(_state(1.0), checkpoint_id="v1", storage_writer=w)
    with pytest.raises(ckptstore.CkptStoreError, match="does not enforce put-if-absent"):
        w.close()  # the version is still not uploaded: close() says so, with the reason
    err = next(f[0] if isinstance(f, tuple) else f for f in ei.value.failures.values())
    assert isinstance(err, ConditionalWritesError), ei.value
    msg = str(err)
    assert proxy.url in msg and "If-None-Match" in msg and f"{CONDITIONAL_WRITES_ENV}=trust" in msg
    assert ckptstore.Store(None, remote=url).versions() == []  # nothing committed remotely
    assert _keys(url, "probes/") == []  # the probe was cleaned up
    # a tier on the same endpoint and prefix answers from the cache (no second probe), still refusing
    t = S3Tier(url)
    with pytest.raises(ConditionalWritesError):
        t.put_if_absent("x/y", b"z")
    assert not any(k.startswith("x/") for k in _keys(url))
    t.close()


def test_durability_local_keeps_the_local_commit_and_close_names_the_refusal(ignoring, tmp_path):
    _proxy, url = ignoring
    root = tmp_path / "root"
    w = ckptstore.StorageWriter(root, remote=url)
    dcp.save(_state(2.0), checkpoint_id="v1", storage_writer=w)
    with pytest.raises(ckptstore.CkptStoreError) as ei:
        w.close()
    assert "v1" in str(ei.value) and "put-if-absent" in str(ei.value)
    assert [r.version for r in ckptstore.Store(root).versions()] == ["v1"]
    assert ckptstore.Store(None, remote=url).versions() == []


def test_opt_out_commits_through_an_ignoring_endpoint(ignoring, tmp_path, monkeypatch):
    _proxy, url = ignoring
    monkeypatch.setenv(CONDITIONAL_WRITES_ENV, "trust")
    w = ckptstore.StorageWriter(tmp_path / "root", remote=url, durability="remote")
    dcp.save(_state(3.0), checkpoint_id="v1", storage_writer=w)
    w.close()
    assert [r.version for r in ckptstore.Store(None, remote=url).versions()] == ["v1"]


@pytest.mark.s3_both
def test_an_enforcing_server_passes_the_probe_once(s3_url):
    """SeaweedFS and moto enforce put-if-absent: the probe passes, leaves nothing, runs once per
    process and prefix; a second put_if_absent still gets ObjectExistsError."""
    puts = []
    t = S3Tier(s3_url)
    t.client.meta.events.register("before-send.s3.PutObject", lambda request, **kw: puts.append(request.url))
    t.put_if_absent("a", b"1")
    with pytest.raises(ObjectExistsError):
        t.put_if_absent("a", b"2")
    assert sum("probes/put-if-absent." in u for u in puts) == 2  # first PUT and the refused second
    t2 = S3Tier(s3_url)
    seen = []
    t2.client.meta.events.register("before-send.s3.PutObject", lambda request, **kw: seen.append(request.url))
    t2.put_if_absent("b", b"1")
    assert not any("probes/" in u for u in seen)  # cached for this endpoint and prefix
    assert _keys(s3_url, "probes/") == []
    t.close()
    t2.close()


def test_bad_opt_out_value_is_refused(monkeypatch):
    monkeypatch.setenv(CONDITIONAL_WRITES_ENV, "yes")
    with pytest.raises(ValueError, match="verify' or 'trust"):
        S3Tier("s3://bucket-x/p")


@pytest.fixture
def ignoring_if_match(moto, monkeypatch):
    """Like ``ignoring``, for ``If-Match``: an endpoint that enforces put-if-absent but not a
    conditional replace."""
    for k, v in moto.env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", CONDITIONAL_WRITES_ENV):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    with HeaderStrippingProxy(moto.endpoint, strip=("if-match",)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        yield proxy, f"s3://ckptstore-test/t-{uuid.uuid4().hex[:12]}/"


def test_conditional_replace_through_an_endpoint_ignoring_if_match_is_refused(ignoring_if_match):
    """Through the proxy a PUT with a stale If-Match overwrites (on main a superseding remote commit
    was a plain overwrite everywhere); the probe sees it, and replace_if_match refuses with
    ConditionalWritesError without writing, so two superseding saves cannot both commit there."""
    from ckptstore.errors import ConditionalWritesError

    proxy, url = ignoring_if_match
    raw = S3Tier(url, conditional_writes="trust")
    raw.put("versions/v/manifest.json", b"A")
    stale = raw.stat("versions/v/manifest.json").token
    raw.put("versions/v/manifest.json", b"B")
    raw.replace_if_match("versions/v/manifest.json", b"C", stale)  # trusted: the stale token overwrote
    assert raw.get("versions/v/manifest.json") == b"C"
    raw.close()
    t = S3Tier(url)
    token = t.stat("versions/v/manifest.json").token
    with pytest.raises(ConditionalWritesError, match="If-Match"):
        t.replace_if_match("versions/v/manifest.json", b"D", token)
    assert t.get("versions/v/manifest.json") == b"C"
    assert _keys(url, "probes/") == []  # the probe cleaned up after itself
    t.close()
