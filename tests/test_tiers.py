"""Tier tests: the shared conformance suite for LocalTier and S3Tier, plus S3-specific behaviour.

Everything S3 runs against a real SeaweedFS server (fixtures in conftest.py); faults are injected
through botocore's own event hooks (``before-send``), never by mocking the client.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import pickle
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid

import pytest

from ckptstore.errors import (
    IntegrityError,
    InvalidNameError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
)
from ckptstore.testing.tier_conformance import TierConformanceTests
from helpers import small_tmpfs
from ckptstore.tiers.local import LocalTier

MiB = 1 << 20
GiB = 1 << 30


# ------------------------------------------------------------------------------------------------
# conformance


def fill_bytes(fs: str) -> str:
    """Write a filler file until ``fs`` has no free byte left; returns its path."""
    filler = os.path.join(fs, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return filler


class TestLocalTier(TierConformanceTests):
    def make_tier(self):
        return LocalTier(self.tmp_path / "root")

    def raw_get(self, tier, key):
        with open(os.path.join(tier.root, *key.split("/")), "rb") as f:
            return f.read()

    def raw_set(self, tier, key, data):
        path = os.path.join(tier.root, *key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    @contextlib.contextmanager
    def full_tier(self):
        with small_tmpfs(self.tmp_path / "fs") as fs:
            t = LocalTier(os.path.join(fs, "root"))
            t.put("fu/seed", b"s")
            filler = fill_bytes(fs)
            yield t, lambda: os.unlink(filler)


@pytest.mark.s3
@pytest.mark.s3_both
class TestS3Tier(TierConformanceTests):
    """The tier conformance suite on SeaweedFS and on moto (a second, independent implementation)."""

    list_count = 1100  # crosses S3's 1000-key page
    writer_size = 9 * MiB + 17  # larger than the 8 MiB part: exercises multipart streaming
    big_size = 5 * MiB  # ranges farther apart than the 1 MiB coalescing gap
    # on moto in the slow set only: 1,100 PUTs (≈ 8 s), and retries of injected 503s (client-side)
    moto_slow = ("test_list_pagination", "test_transient_errors_are_typed")

    @pytest.fixture(autouse=True)
    def _server(self, s3_server):
        self.server = s3_server

    def make_tier(self):
        from ckptstore.tiers.s3 import S3Tier

        return S3Tier(self.request.getfixturevalue("s3_url"))

    def raw_get(self, tier, key):
        return tier.client.get_object(Bucket=tier.bucket, Key=tier.prefix + key)["Body"].read()

    def raw_set(self, tier, key, data):
        tier.client.put_object(Bucket=tier.bucket, Key=tier.prefix + key, Body=data)

    @contextlib.contextmanager
    def transient_tier(self):
        url = self.request.getfixturevalue("s3_url")
        _s3(url).put("te/a", b"a")
        t = _s3(url, max_attempts=2)  # retries happen (test_throttling_is_retried); keep them short
        t.client.meta.events.register("before-send.s3", Injector(lambda n, r: True))  # 503 SlowDown, always
        try:
            yield t
        finally:
            t.close()


# ------------------------------------------------------------------------------------------------
# helpers for S3 fault injection through botocore events


class _Raw:
    def __init__(self, body: bytes):
        self._body = body

    def stream(self, **_):
        yield self._body

    def read(self, *_a, **_k):
        b, self._body = self._body, b""
        return b


def _error_response(request, status: int, code: str):
    from botocore.awsrequest import AWSResponse

    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>injected by test</Message><RequestId>test</RequestId></Error>"
    ).encode()
    headers = {"Content-Type": "application/xml", "Content-Length": str(len(body))}
    return AWSResponse(request.url, status, headers, _Raw(body))


class Injector:
    """A ``before-send`` handler failing the requests ``should_fail(n, request)`` picks."""

    def __init__(self, should_fail, status=503, code="SlowDown"):
        self.should_fail = should_fail
        self.status, self.code = status, code
        self.seen = 0
        self.failed = 0
        self._lock = threading.Lock()

    def __call__(self, request, **kwargs):
        with self._lock:
            n = self.seen
            self.seen += 1
            fail = self.should_fail(n, request)
            self.failed += bool(fail)
        if fail:
            return _error_response(request, self.status, self.code)
        return None


def _s3(url, **kw):
    from ckptstore.tiers.s3 import S3Tier

    return S3Tier(url, **kw)


def _data(n, seed=0):
    import random

    return random.Random(seed).randbytes(n)


# ------------------------------------------------------------------------------------------------
# part sizes and URLs (no server)


@pytest.mark.parametrize(
    "size",
    [0, 1, 5 * MiB, 8 * MiB, 8 * MiB + 1, 80_000 * MiB, 80_000 * MiB + 1, 2**32 + 1,
     3 * 2**40 + 7, 5 * 2**40],
)
@pytest.mark.parametrize("max_parts", [10000, 1000, 3])
def test_part_size_for(size, max_parts):
    from ckptstore.tiers.s3 import part_size_for

    if -(-size // (5 * GiB)) > max_parts:
        with pytest.raises(StorageError):
            part_size_for(size, max_parts)
        return
    p = part_size_for(size, max_parts)
    assert 5 * MiB <= p <= 5 * GiB
    assert -(-size // p) <= max_parts
    if p != 5 * GiB:
        assert p % (8 * MiB) == 0 and (p // (8 * MiB)) & (p // (8 * MiB) - 1) == 0  # 8 MiB · 2^k
        if p > 8 * MiB:
            assert -(-size // (p // 2)) > max_parts  # the smallest such size


def test_part_size_for_defaults():
    from ckptstore.tiers.s3 import part_size_for

    assert part_size_for(0) == 8 * MiB
    assert part_size_for(80_000 * MiB) == 8 * MiB
    assert part_size_for(80_000 * MiB + 1) == 16 * MiB
    assert part_size_for(2**32 + 1) == 8 * MiB
    assert part_size_for(5 * 2**40) == 1 * GiB  # the largest S3 object
    with pytest.raises(StorageError):
        part_size_for(10_000 * 5 * GiB + 1)
    with pytest.raises(ValueError):
        part_size_for(-1)


@pytest.mark.parametrize(
    "url, prefix",
    [
        ("s3://bkt", ""),
        ("s3://bkt/", ""),
        ("s3://bkt//", ""),
        ("s3://bkt/runs", "runs/"),
        ("s3://bkt/runs/", "runs/"),
        ("s3://bkt//runs//exp1///", "runs/exp1/"),
        ("s3://my.dotted.bucket/a b/c+d/", "a b/c+d/"),
        ("s3://bkt/runs/exp[1]/", "runs/exp[1]/"),
        ("s3://bkt/50%25/x#y?z/", "50%25/x#y?z/"),
        ("s3://bkt/ünïcødé/日本", "ünïcødé/日本/"),
    ],
)
def test_url_normalisation(url, prefix):
    from ckptstore.tiers.s3 import parse_s3_url

    bucket, p = parse_s3_url(url)
    assert p == prefix
    assert bucket == url[5:].split("/")[0]
    t = _s3(url)
    assert t.url == f"s3://{bucket}/{prefix}"
    assert t.prefix == prefix


@pytest.mark.parametrize(
    "url",
    [
        "bkt/prefix",
        "http://bkt/prefix",
        "S3://bkt/x",
        "s3://",
        "s3:///prefix",
        "s3://ab/x",  # too short
        "s3://" + "a" * 64,  # too long
        "s3://Upper/x",
        "s3://under_score/x",
        "s3://-lead/x",
        "s3://trail-/x",
        "s3://double..dot/x",
        "s3://dash.-dot/x",
        "s3://192.168.1.1/x",
        "s3://xn--punycode/x",
        "s3://bkt-s3alias/x",
        "s3://bkt/a/../b",
        "s3://bkt/./a",
        "s3://bkt/back\\slash/",
        "s3://bkt/ctl\x01/",
        "s3://bkt/nl\n/",
        "s3://bkt/" + "p" * 600,
        None,
        b"s3://bkt/x",
    ],
)
def test_bad_urls_rejected_up_front(url):
    with pytest.raises(InvalidNameError):
        _s3(url)


def test_make_remote_builds_s3_tier():
    from ckptstore.tiers import make_remote
    from ckptstore.tiers.s3 import S3Tier

    t = make_remote("s3://bkt/p", endpoint_url="http://127.0.0.1:1")
    assert isinstance(t, S3Tier) and t.url == "s3://bkt/p/" and t.name == "remote"
    for bad in ("ftp://bkt/p", "bkt/p", "s3:/bkt"):
        with pytest.raises(InvalidNameError):
            make_remote(bad)


def test_pickle_keeps_constructor_args():
    t = _s3("s3://bkt/p", endpoint_url="http://127.0.0.1:1", max_parts=7, part_size=6 * MiB,
            coalesce_gap=0)
    t2 = pickle.loads(pickle.dumps(t))
    assert (t2.url, t2.endpoint_url, t2.max_parts, t2.part_size, t2.coalesce_gap) == (
        "s3://bkt/p/", "http://127.0.0.1:1", 7, 6 * MiB, 0
    )


# ------------------------------------------------------------------------------------------------
# S3 against SeaweedFS


@pytest.mark.s3
@pytest.mark.parametrize(
    "prefix",
    ["runs/exp[1]/", "with space/x y", "a+b/c+", "50%/%2F%", "hash#tag/q?x=1", "ünï/日本語/",
     "dou//ble//", "a&b=c;d,e@f:g$/"],
)
def test_awkward_prefixes_round_trip(s3_bucket, s3_env, prefix):
    base = f"t-{uuid.uuid4().hex[:8]}/"
    t = _s3(f"s3://{s3_bucket}/{base}{prefix}")
    t.put("v%3A1/obj", b"payload")
    t.put("v%3A1/other", b"x")
    assert t.get("v%3A1/obj") == b"payload"
    assert t.get("v%3A1/obj", 1, 4) == b"ayl"
    assert sorted(i.key for i in t.list()) == ["v%3A1/obj", "v%3A1/other"]
    assert sorted(i.key for i in t.list("v%3A1/o")) == ["v%3A1/obj", "v%3A1/other"]
    t.delete("v%3A1/obj")
    assert [i.key for i in t.list()] == ["v%3A1/other"]
    # the normalised prefix is what is stored: a sibling tier on a prefix of it sees nothing extra
    parent = _s3(f"s3://{s3_bucket}/{base}")
    assert [i.key for i in parent.list()] == [t.prefix[len(base):] + "v%3A1/other"]


@pytest.mark.s3
def test_bucket_with_dots(seaweed, s3_env):
    bucket = seaweed.create_bucket(f"ckpt.dotted.{uuid.uuid4().hex[:6]}")
    t = _s3(f"s3://{bucket}/p")
    t.put_if_absent("m/x", b"dots")
    assert t.get("m/x") == b"dots"
    assert [i.key for i in t.list()] == ["m/x"]


@pytest.mark.s3
def test_multipart_put_file_respects_max_parts(s3_url, tmp_path):
    from ckptstore.tiers.s3 import part_size_for

    size = 20 * MiB + 3
    data = _data(size, 11)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    t = _s3(s3_url, max_parts=2)
    assert part_size_for(size, 2) == 16 * MiB  # 8 MiB would need 3 parts
    t.put_file("f/obj", src, size)
    head = t.client.head_object(Bucket=t.bucket, Key=t.prefix + "f/obj")
    assert head["ContentLength"] == size
    assert head["ETag"].strip('"').endswith("-2")  # two parts: 16 MiB + 4 MiB
    assert t.get("f/obj") == data
    dst = tmp_path / "dst.bin"
    t.get_file("f/obj", dst)  # parallel ranged download
    assert dst.read_bytes() == data
    assert list(t.list_multipart_uploads()) == []
    with pytest.raises(StorageError):
        t.put_file("f/wrong-size", src, size + 1)


@pytest.mark.s3
def test_large_put_uses_multipart(s3_url):
    data = _data(12 * MiB, 12)
    t = _s3(s3_url)
    t.put("p/big", memoryview(data))
    head = t.client.head_object(Bucket=t.bucket, Key=t.prefix + "p/big")
    assert head["ETag"].strip('"').endswith("-2")
    assert t.get("p/big") == data
    got = t.get_ranges("p/big", [(9 * MiB, 9 * MiB + 10), (1, 2)])
    assert got == [data[9 * MiB:9 * MiB + 10], data[1:2]]


@pytest.mark.s3
def test_get_ranges_parallel_without_coalescing(s3_url):
    data = _data(2 * MiB, 13)
    t = _s3(s3_url, coalesce_gap=0, max_coalesced=64 * 1024)
    t.put("g/o", data)
    counter = Injector(lambda n, r: False)
    t.client.meta.events.register("before-send.s3.GetObject", counter)
    ranges = [(i * 100_000, i * 100_000 + 5_000) for i in range(20)][::-1] + [(0, 200_000)]
    assert t.get_ranges("g/o", ranges) == [data[s:e] for s, e in ranges]
    assert counter.seen >= 20  # far-apart ranges were separate GETs
    counter.seen = 0
    t2 = _s3(s3_url)  # default 1 MiB gap: one coalesced GET
    t2.client.meta.events.register("before-send.s3.GetObject", counter)
    assert t2.get_ranges("g/o", ranges) == [data[s:e] for s, e in ranges]
    assert counter.seen == 1


@pytest.mark.s3
@pytest.mark.parametrize("how", ["put_file", "writer", "put", "parts"])
def test_failed_multipart_upload_is_aborted(s3_url, tmp_path, how):
    data = _data(20 * MiB, 14)
    t = _s3(s3_url)
    # the third UploadPart is refused for good (403 is not retried)
    inj = Injector(lambda n, r: n == 2, status=403, code="AccessDenied")
    t.client.meta.events.register("before-send.s3.UploadPart", inj)
    with pytest.raises(StorageError) as ei:
        if how == "put_file":
            src = tmp_path / "src"
            src.write_bytes(data)
            t.put_file("mp/obj", src)
        elif how == "put":
            t.put("mp/obj", data)
        elif how == "parts":
            mp = t.open_multipart("mp/obj")
            for n, i in enumerate(range(0, len(data), 5 * MiB), 1):
                mp.send(n, lambda i=i: data[i:i + 5 * MiB])
            mp.complete(len(data))
        else:
            with t.open_writer("mp/obj") as w:
                for i in range(0, len(data), MiB):
                    w.write(data[i:i + MiB])
    assert not isinstance(ei.value, TransientStorageError)
    assert inj.failed == 1
    assert list(t.list_multipart_uploads()) == []
    assert not t.exists("mp/obj")


@pytest.mark.s3
def test_part_upload_streams_parts_then_completes(s3_url):
    """``open_multipart``: parts sent one by one (read on the pool) make the object; a part whose
    read fails aborts the upload; parts out of order are refused."""
    t = _s3(s3_url)
    data = _data(12 * MiB + 123, 15)
    mp = t.open_multipart("pu/obj")
    assert list(t.list_multipart_uploads("pu/")) == []  # nothing sent before the first part runs
    cuts = [0, 5 * MiB, 10 * MiB, len(data)]
    for n, (a, b) in enumerate(zip(cuts, cuts[1:]), 1):
        mp.send(n, lambda a=a, b=b: data[a:b])
    with pytest.raises(ValueError):
        mp.send(7, lambda: b"")
    mp.complete(len(data))
    assert t.get("pu/obj") == data
    assert list(t.list_multipart_uploads("pu/")) == []

    mp = t.open_multipart("pu/bad")
    mp.send(1, lambda: data[: 5 * MiB])

    def bad():
        raise IntegrityError("changed after it was written")

    mp.send(2, bad)
    with pytest.raises(IntegrityError):
        mp.complete(10 * MiB)
    assert list(t.list_multipart_uploads("pu/")) == []
    assert not t.exists("pu/bad")


@pytest.mark.s3
def test_list_and_abort_multipart_uploads(s3_url):
    t = _s3(s3_url)
    before = time.time()
    up = t.client.create_multipart_upload(Bucket=t.bucket, Key=t.prefix + "v/attempts/a1/shard")
    t.client.create_multipart_upload(Bucket=t.bucket, Key=t.prefix + "w/other")
    ups = list(t.list_multipart_uploads("v/"))
    assert [(u.key, u.upload_id) for u in ups] == [("v/attempts/a1/shard", up["UploadId"])]
    assert before - 120 <= ups[0].initiated <= time.time() + 120
    assert len(list(t.list_multipart_uploads())) == 2
    t.abort_multipart_upload("v/attempts/a1/shard", up["UploadId"])
    t.abort_multipart_upload("v/attempts/a1/shard", up["UploadId"])  # already gone: fine
    assert list(t.list_multipart_uploads("v/")) == []


@pytest.mark.s3
def test_throttling_is_retried(s3_url):
    t = _s3(s3_url, list_page_size=8)
    keys = [f"th/k{i:03d}" for i in range(40)]
    for k in keys:
        t.put(k, k.encode())
    # from now on every fourth request answers 503 SlowDown (each retry costs a backoff)
    inj = Injector(lambda n, r: n % 4 == 1)
    t.client.meta.events.register("before-send.s3", inj)
    t.put("th2/a", b"A" * 1000)
    t.put_if_absent("th2/b", b"B")
    with pytest.raises(ObjectExistsError):
        t.put_if_absent("th2/b", b"C")
    assert t.get("th2/a") == b"A" * 1000
    assert t.get("th2/a", 10, 20) == b"A" * 10
    assert t.stat("th2/b").size == 1
    got = sorted(i.key for i in t.list("th/"))  # 5 pages, some throttled: never short or empty
    assert got == keys
    assert inj.failed >= 3


@pytest.mark.s3
def test_persistent_throttling_is_transient_error_not_missing(s3_url):
    t = _s3(s3_url, max_attempts=1)  # retries used up at once (the test above shows they happen)
    t.put("x/a", b"a")
    t.client.meta.events.register("before-send.s3", Injector(lambda n, r: True))
    for call in (lambda: t.get("x/a"), lambda: t.get("x/missing"), lambda: t.stat("x/a"),
                 lambda: list(t.list("x/")), lambda: t.put("x/b", b"b")):
        with pytest.raises(TransientStorageError):
            call()


@pytest.mark.s3
def test_put_if_absent_survives_lost_response(s3_url):
    """The conditional PUT lands but its response is lost; the retry gets 412 and must see its
    own object (same ETag) instead of reporting ObjectExistsError."""
    import urllib3

    http = urllib3.PoolManager()
    t = _s3(s3_url)
    done = []

    def lose_response(request, **kwargs):
        if done:
            return None
        body = request.body
        if hasattr(body, "read"):
            pos = body.tell()
            payload = body.read()
            body.seek(pos)
        else:
            payload = body or b""
        r = http.request(request.method, request.url, body=payload, headers=dict(request.headers))
        done.append(r.status)
        return _error_response(request, 503, "SlowDown")

    t.client.meta.events.register("before-send.s3.PutObject", lose_response)
    t.put_if_absent("m/manifest", b"my manifest")
    assert done == [200] and t.get("m/manifest") == b"my manifest"
    # a genuinely different object is still refused, retries or not
    done.clear()
    with pytest.raises(ObjectExistsError):
        t.put_if_absent("m/manifest", b"another manifest")
    assert done == [412] and t.get("m/manifest") == b"my manifest"


@pytest.mark.s3
def test_missing_bucket_is_storage_error_not_missing_object(seaweed, s3_env):
    t = _s3(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p")
    for call in (lambda: t.get("a/b"), lambda: t.get("a/b", 0, 4), lambda: t.stat("a/b"),
                 lambda: t.exists("a/b"), lambda: list(t.list()), lambda: t.put("a/b", b"x"),
                 lambda: t.put_if_absent("a/b", b"x"), lambda: t.open_writer("a/b").commit()):
        with pytest.raises(StorageError) as ei:
            call()
        assert not isinstance(ei.value, (ObjectNotFoundError, TransientStorageError))
        assert "does not exist" in str(ei.value) or "NoSuchBucket" in str(ei.value)


@pytest.mark.s3
def test_access_denied_is_storage_error(s3_url, monkeypatch):
    from ckptstore.testing.seaweed import READONLY_ACCESS_KEY, READONLY_SECRET_KEY

    _s3(s3_url).put("ro/x", b"readable")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", READONLY_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READONLY_SECRET_KEY)
    ro = _s3(s3_url)
    assert ro.get("ro/x") == b"readable"
    with pytest.raises(ObjectNotFoundError):
        ro.get("ro/missing")
    for call in (lambda: ro.put("ro/y", b"y"), lambda: ro.put_if_absent("ro/y", b"y"),
                 lambda: ro.put("ro/big", b"z" * (9 * MiB))):
        with pytest.raises(StorageError) as ei:
            call()
        assert not isinstance(ei.value, TransientStorageError)
        assert "access denied" in str(ei.value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(StorageError) as ei:
        _s3(s3_url).get("ro/x")
    assert not isinstance(ei.value, (ObjectNotFoundError, TransientStorageError))


@pytest.mark.s3
def test_threads_share_one_lazy_client(s3_url):
    t = _s3(s3_url)
    errors = []
    barrier = threading.Barrier(12)

    def work(i):
        try:
            barrier.wait()
            t.put(f"c/{i}", str(i).encode())
            assert t.get(f"c/{i}") == str(i).encode()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len({id(t.client) for _ in range(3)}) == 1


@pytest.mark.s3
def test_unpickled_tier_uses_its_constructor_args(s3_url, seaweed, monkeypatch):
    t = _s3(s3_url, endpoint_url=seaweed.endpoint, max_parts=9)
    t.put("pk/x", b"from the original")
    blob = pickle.dumps(t)
    assert b"secret" not in blob.lower()  # credentials never travel in the pickle
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # the pickled endpoint must win
    t2 = pickle.loads(blob)
    assert t2.max_parts == 9 and t2.client is not t.client
    t2.put("pk/y", t2.get("pk/x") + b" and the copy")
    assert t.get("pk/y") == b"from the original and the copy"


@pytest.mark.s3
def test_forked_child_gets_its_own_client(s3_url):
    t = _s3(s3_url)
    t.put("fk/x", b"1")
    parent_client = t.client
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        ok = 0
        try:
            ok = t.client is not parent_client and t.get("fk/x") == b"1"
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert t.client is parent_client


@pytest.mark.s3
def test_server_killed_mid_upload(seaweed, s3_url):
    """SIGKILL SeaweedFS during a streamed multipart upload: the writer fails with a transient
    error; after the restart the old data is intact and the leftover upload can be listed and
    aborted (what gc does)."""
    t = _s3(s3_url, max_attempts=2, connect_timeout=2, read_timeout=10)
    t.put("k/before", b"durable")
    w = t.open_writer("k/shard")
    w.write(_data(8 * MiB, 15))  # part 1 goes up in the background
    deadline = time.time() + 30
    while not list(t.client.list_parts(Bucket=t.bucket, Key=t.prefix + "k/shard",
                                       UploadId=w._upload_id).get("Parts", [])):
        assert time.time() < deadline
        time.sleep(0.05)
    seaweed.kill()
    try:
        with pytest.raises(TransientStorageError):
            w.write(_data(8 * MiB, 16))
            w.commit()
        with pytest.raises(TransientStorageError):
            t.get("k/before")
    finally:
        seaweed.start()
    assert t.get("k/before") == b"durable"
    assert not t.exists("k/shard")
    left = list(t.list_multipart_uploads("k/"))
    for u in left:  # the abort could not reach the dead server
        t.abort_multipart_upload(u.key, u.upload_id)
    assert list(t.list_multipart_uploads("k/")) == []


# ------------------------------------------------------------------------------------------------
# local tier: directory errors are typed too


def test_local_no_inode_for_a_new_directory_is_storage_full(tmp_path):
    """A full file system can refuse the directory before the file (mkdir → ENOSPC): that is a
    StorageFullError like any other full-disk failure, not a bare OSError."""
    from ckptstore.errors import StorageFullError

    with small_tmpfs(tmp_path / "fs", size="4m", nr_inodes=16) as fs:
        t = LocalTier(os.path.join(fs, "root"))
        t.put("seed", b"s")
        i = 0
        with pytest.raises(OSError) as ei:
            while True:
                open(os.path.join(fs, f"inode{i}"), "x").close()
                i += 1
        assert ei.value.errno == errno.ENOSPC
        for call in (lambda: t.put("v/new/dir/a", b"x"), lambda: t.put_if_absent("v2/b", b"x"),
                     lambda: t.open_writer("v3/c")):
            with pytest.raises(StorageFullError, match="disk full"):
                call()
        os.unlink(os.path.join(fs, "inode0"))
        os.unlink(os.path.join(fs, "inode1"))
        t.put("v/a", b"x")
        assert t.get("v/a") == b"x"


def test_local_fsync_dir_errors_are_typed(tmp_path):
    from ckptstore.tiers.local import fsync_dir, makedirs_synced

    with pytest.raises(StorageError) as ei:
        fsync_dir(str(tmp_path / "missing"))
    assert not isinstance(ei.value, ObjectNotFoundError)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageError):
        makedirs_synced(str(tmp_path / "file" / "sub"))


# ------------------------------------------------------------------------------------------------
# the demo's --seaweedfs launcher is the test server


@pytest.mark.s3
def test_demo_seaweedfs_uses_the_test_server(seaweed, tmp_path, monkeypatch):
    from ckptstore.demo.seaweed import seaweedfs
    from ckptstore.tiers.s3 import S3Tier

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    log = str(tmp_path / "seaweedfs.log")
    with seaweedfs(bucket="demo-bucket", log_path=log) as sw:
        assert os.environ["AWS_ENDPOINT_URL"] == sw["endpoint"] and sw["log"] == log
        t = S3Tier(sw["url"])
        t.put("k", b"v")
        assert t.get("k") == b"v"
        t.close()
    assert "AWS_ENDPOINT_URL" not in os.environ  # restored
    assert os.path.getsize(log) > 0


def test_local_writer_early_writeback_keeps_every_byte(tmp_path, monkeypatch):
    """The writer starts writeback every WRITEBACK_BYTES (sync_file_range on Linux): with a tiny
    threshold, an object written in uneven pieces still reads back byte for byte after commit."""
    import ckptstore.tiers.local as local_mod

    monkeypatch.setattr(local_mod, "WRITEBACK_BYTES", 4096)
    calls = []
    real = local_mod._start_writeback
    if real is not None:
        monkeypatch.setattr(local_mod, "_start_writeback", lambda fd, off, n: (calls.append((off, n)), real(fd, off, n)))
    tier = LocalTier(tmp_path / "root")
    data = os.urandom(300_001)
    w = tier.open_writer("obj/a")
    for i in range(0, len(data), 7_777):
        w.write(data[i : i + 7_777])
    w.commit()
    assert tier.get("obj/a") == data
    if real is not None:  # the ranges started are contiguous from 0 and never past what was written
        assert calls and calls[0][0] == 0
        assert all(a[0] + a[1] == b[0] for a, b in zip(calls, calls[1:]))
        assert calls[-1][0] + calls[-1][1] <= len(data)


@pytest.mark.s3
@pytest.mark.parametrize("signing", [False, True])
def test_payload_signing_choice_is_what_goes_on_the_wire(s3_url, signing, monkeypatch):
    """Default: bodies go as UNSIGNED-PAYLOAD with a CRC32 the server checks; payload_signing=True
    puts the body's SHA-256 into the signature. Either way the object reads back byte for byte,
    and the CRC32 is sent even when the environment asks botocore for checksums only where an API
    requires them."""
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    t = _s3(s3_url, payload_signing=signing, part_size=5 * MiB)
    seen = []

    def record(request, **_):
        h = request.headers
        seen.append((h.get("x-amz-content-sha256"), h.get("x-amz-checksum-crc32")))

    t.client.meta.events.register("before-send.s3.PutObject", record)
    t.client.meta.events.register("before-send.s3.UploadPart", record)
    small, big = _data(1000, 3), _data(11 * MiB, 4)
    t.put("sig/small", small)
    mp = t.open_multipart("sig/big")
    mp.send(1, lambda: big[: 6 * MiB])
    mp.send(2, lambda: big[6 * MiB :])
    mp.complete(len(big))
    assert t.get("sig/small") == small and t.get("sig/big") == big
    assert len(seen) == 3
    for sha, crc in seen:
        sha = sha.decode() if isinstance(sha, bytes) else sha
        assert crc  # the server-checked body checksum is always there
        if signing:
            assert len(sha) == 64 and int(sha, 16) >= 0
        else:
            assert sha == "UNSIGNED-PAYLOAD"


_SKEWED = r'''
import sys
from ckptstore.errors import StorageError
from ckptstore.tiers.s3 import S3Tier
t = S3Tier(sys.argv[1])
for what, call in (("HEAD", lambda: t.stat("a")), ("PUT", lambda: t.put("b", b"y"))):
    try:
        call()
        print(what, "accepted")
    except StorageError as e:
        print(what, type(e).__name__, e)
'''


def test_a_host_clock_two_hours_ahead_is_named_not_reported_as_access_denied(s3_url):
    """S3 refuses requests signed more than 15 minutes off its clock: a PUT with RequestTimeTooSkewed, a HEAD
    (no body) with a bare 403, which read "access denied; check the credentials". Both now say the host's
    clock is 2 h ahead (from the reply's Date header). The process runs under libfaketime (+2h)."""
    from ckptstore.demo.chaos.clockexec import faketime_env, libfaketime
    from ckptstore.tiers.s3 import S3Tier

    if libfaketime() is None:
        pytest.skip("needs libfaketime (Debian package faketime; scripts/test.sh installs it)")
    S3Tier(s3_url).put("a", b"x")
    p = subprocess.run([sys.executable, "-c", _SKEWED, s3_url], capture_output=True, text=True, timeout=120,
                       env=faketime_env("+2h"))
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    assert set(lines) == {"HEAD", "PUT"}, p.stdout + p.stderr
    for what, msg in lines.items():
        assert msg.startswith("TransientStorageError") and "clock is 2.0 h ahead of the S3 server's" in msg, msg
        assert "fix the host's clock" in msg and "credentials" not in msg, msg


_SKEWED_RESTORE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import ckptstore
from store_helpers import load, same, state
root, url = sys.argv[2], sys.argv[3]
print("restored", same(load(root, remote=url), state(7)))  # no version: the newest every rank can load
"""


def test_a_restore_from_a_host_two_hours_ahead_reads_the_local_root(s3_url, tmp_path):
    """A version committed locally and in S3; a process 2 h ahead (libfaketime) loads the newest version
    (a StorageReader without a version, as resume() does) from the local root: S3's refusal for clock skew is transient, as an unreachable S3 is (the chaos run's
    clock-jump on the coordinating node failed every restart with the refused LIST before)."""
    from ckptstore.demo.chaos.clockexec import faketime_env, libfaketime

    if libfaketime() is None:
        pytest.skip("needs libfaketime (Debian package faketime; scripts/test.sh installs it)")
    from store_helpers import save

    root = str(tmp_path / "root")
    save(root, "v7", 7, remote=s3_url).close()
    p = subprocess.run([sys.executable, "-c", _SKEWED_RESTORE, os.path.dirname(__file__), root, s3_url],
                       capture_output=True, text=True, timeout=120, env=faketime_env("+2h"))
    assert "restored True" in p.stdout, p.stdout + p.stderr[-3000:]


@pytest.mark.parametrize("bad", [None, b"step-1", ["step-1"], 5, "", ".", "..", "a\x00b", "tab\there", "x" * 201])
def test_bad_version_names_and_keys_are_refused_every_time(bad):
    """Names and keys are worked out once per distinct string (they recur at every save); a bad one
    is refused with InvalidNameError on every call, whatever its type, never cached as good."""
    from ckptstore._names import check_key, decode_version, encode_version

    for _ in range(2):
        with pytest.raises(InvalidNameError):
            encode_version(bad)
        with pytest.raises(InvalidNameError):
            check_key(bad if not isinstance(bad, str) or bad in ("", ".", "..") else f"versions/{bad}/../x")
    if isinstance(bad, str) and bad not in ("", ".", ".."):
        with pytest.raises(InvalidNameError):
            decode_version(urllib.parse.quote(bad, safe=""))
    assert decode_version(encode_version("step-1")) == "step-1" and check_key("versions/step-1/x") == "versions/step-1/x"
