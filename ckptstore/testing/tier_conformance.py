"""Conformance tests every :class:`~ckptstore.tiers.base.Tier` must pass (zarr's ``StoreTests``).

Subclass :class:`TierConformanceTests` in a test module, name the subclass ``Test…`` and implement
:meth:`~TierConformanceTests.make_tier`; pytest then runs every ``test_*`` method against it::

    class TestLocalTier(TierConformanceTests):
        def make_tier(self):
            return LocalTier(self.tmp_path / "root")

    @pytest.mark.s3
    class TestS3Tier(TierConformanceTests):
        list_count = 1100                      # more than one S3 listing page
        def make_tier(self):
            return S3Tier(self.request.getfixturevalue("s3_url"))

``make_tier`` may use ``self.tmp_path`` and ``self.request`` (pytest's ``request``, e.g.
``self.request.getfixturevalue(...)``). Each test gets a fresh, empty tier.

Backdoor and error contract (zarr's ``get``/``set`` test hooks): a subclass also implements
:meth:`~TierConformanceTests.raw_get` / :meth:`~TierConformanceTests.raw_set`, which read and
plant stored bytes without going through the tier (the file itself, the bucket through its own
client), and may implement :meth:`~TierConformanceTests.transient_tier` (a tier whose storage keeps
failing in a way a retry may fix: every call must raise
:class:`~ckptstore.errors.TransientStorageError`, never "not found") and
:meth:`~TierConformanceTests.full_tier` (a tier on full storage: writes must raise
:class:`~ckptstore.errors.StorageFullError` and leave nothing visible). The two default to a skip
naming the reason. Class attributes tune
the cost: ``list_count`` (keys in the pagination test), ``writer_size`` (bytes streamed through
``open_writer``; make it larger than the tier's part size to cover multipart), ``big_size``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import os
import random
import threading
import time

import pytest

from ..errors import (
    IntegrityError,
    InvalidNameError,
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageFullError,
    TransientStorageError,
)
from ..tiers.base import Tier

__all__ = ["TierConformanceTests"]


def _data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


class TierConformanceTests:
    """Base class of tier test suites; see the module docstring."""

    #: keys written by the listing/pagination test (S3: > 1000 to cross a page boundary)
    list_count: int = 40
    #: bytes streamed through ``open_writer`` in the streaming test
    writer_size: int = 3 << 20
    #: object size for the ranged-read tests (S3: larger than the coalescing gap)
    big_size: int = 3 << 20

    request: pytest.FixtureRequest
    tmp_path: os.PathLike

    def make_tier(self) -> Tier:
        """Return a new, empty tier for one test."""
        raise NotImplementedError

    def raw_get(self, tier: Tier, key: str) -> bytes:
        """The stored bytes of ``key``, read around the tier (backdoor)."""
        raise NotImplementedError

    def raw_set(self, tier: Tier, key: str, data: bytes) -> None:
        """Store ``data`` as ``key`` around the tier (backdoor), e.g. to plant damage."""
        raise NotImplementedError

    @contextlib.contextmanager
    def transient_tier(self):
        """Yield a tier whose storage keeps answering with errors a retry may fix."""
        pytest.skip(f"{type(self).__name__} has no transient-failure mechanism")
        yield

    @contextlib.contextmanager
    def full_tier(self):
        """Yield ``(tier, free)`` for a tier on full storage; ``free()`` makes room again."""
        pytest.skip(f"{type(self).__name__} has no full-storage mechanism")
        yield

    @pytest.fixture(autouse=True)
    def _conformance_setup(self, request, tmp_path):
        self.request = request
        self.tmp_path = tmp_path

    @pytest.fixture
    def tier(self):
        t = self.make_tier()
        try:
            yield t
        finally:
            t.close()

    # --- put / get ---

    @pytest.mark.parametrize("size", [0, 1, 1000, (1 << 20) + 7])
    def test_put_get_roundtrip(self, tier, size):
        data = _data(size, size)
        tier.put("obj/a", data)
        assert tier.get("obj/a") == data
        assert tier.stat("obj/a").size == size

    def test_put_accepts_buffers(self, tier):
        data = _data(5000)
        tier.put("buf/ba", bytearray(data))
        tier.put("buf/mv", memoryview(data)[100:])
        tier.put_if_absent("buf/pia", memoryview(bytearray(data)))
        assert tier.get("buf/ba") == data
        assert tier.get("buf/mv") == data[100:]
        assert tier.get("buf/pia") == data

    def test_put_replaces(self, tier):
        tier.put("r/x", b"first version, longer")
        tier.put("r/x", b"second")
        assert tier.get("r/x") == b"second"
        assert tier.stat("r/x").size == 6
        assert [i.key for i in tier.list("r/")] == ["r/x"]

    def test_ranged_get(self, tier):
        data = _data(10_000, 1)
        tier.put("rg/o", data)
        assert tier.get("rg/o", 0, 10) == data[:10]
        assert tier.get("rg/o", 123, 4567) == data[123:4567]
        assert tier.get("rg/o", 9_990, 10_000) == data[9_990:]
        assert tier.get("rg/o", 5000) == data[5000:]
        assert tier.get("rg/o", None, 77) == data[:77]
        assert tier.get("rg/o", 0, None) == data
        assert tier.get("rg/o", 40, 40) == b""
        assert tier.get("rg/o", 9_000, 20_000) == data[9_000:]  # past the end: short, like pread

    def test_get_ranges_in_callers_order(self, tier):
        size = self.big_size
        data = _data(size, 2)
        tier.put("gr/o", data)
        rng = random.Random(3)
        ranges = [(0, 10), (10, 20), (5, 15), (size - 100, size), (size // 2, size // 2 + 4096)]
        ranges += [(size // 3, size // 3), (7, 8), (0, 10)]  # empty and duplicate ranges
        for _ in range(20):
            s = rng.randrange(size)
            ranges.append((s, min(size, s + rng.randrange(1, 300_000))))
        rng.shuffle(ranges)
        got = tier.get_ranges("gr/o", ranges)
        assert len(got) == len(ranges)
        for (s, e), b in zip(ranges, got):
            assert b == data[s:e], (s, e)
        assert tier.get_ranges("gr/o", []) == []
        assert tier.get_ranges("gr/o", [(size - 1, size)]) == [data[-1:]]

    # --- put_if_absent ---

    def test_put_if_absent(self, tier):
        tier.put_if_absent("pia/k", b"one")
        with pytest.raises(ObjectExistsError):
            tier.put_if_absent("pia/k", b"two")
        with pytest.raises(FileExistsError):  # ObjectExistsError is a FileExistsError
            tier.put_if_absent("pia/k", b"three")
        assert tier.get("pia/k") == b"one"
        tier.put("pia/k", b"replaced")  # plain put still replaces
        assert tier.get("pia/k") == b"replaced"

    # --- replace_if_match (tiers that declare supports_conditional_replace) ---

    def test_replace_if_match(self, tier):
        from ..errors import PreconditionFailedError

        if not tier.supports_conditional_replace:
            pytest.skip(f"the {tier.name} tier has no conditional replace")
        tier.put("cas/k", b"one")
        t1 = tier.stat("cas/k").token
        assert t1
        tier.replace_if_match("cas/k", b"two", t1)
        assert tier.get("cas/k") == b"two"
        t2 = tier.stat("cas/k").token
        assert t2 and t2 != t1
        with pytest.raises(PreconditionFailedError):  # the copy read with t1 is gone
            tier.replace_if_match("cas/k", b"three", t1)
        assert tier.get("cas/k") == b"two"
        with pytest.raises(PreconditionFailedError):  # a missing key is never created
            tier.replace_if_match("cas/missing", b"x", t2)
        assert not tier.exists("cas/missing")
        assert [i.key for i in tier.list("cas/")] == ["cas/k"]  # no lock or temporary file left

    def test_replace_if_match_race_has_one_winner(self, tier):
        from ..errors import PreconditionFailedError

        if not tier.supports_conditional_replace:
            pytest.skip(f"the {tier.name} tier has no conditional replace")
        n = 8
        tier.put("cas/r", b"base")
        token = tier.stat("cas/r").token
        barrier = threading.Barrier(n)
        payloads = [f"writer {i} ".encode() * (i + 1) for i in range(n)]

        def go(i):
            barrier.wait()
            try:
                tier.replace_if_match("cas/r", payloads[i], token)
                return i
            except PreconditionFailedError:
                return None

        with cf.ThreadPoolExecutor(n) as ex:
            won = [i for i in ex.map(go, range(n)) if i is not None]
        assert len(won) == 1, won
        assert tier.get("cas/r") == payloads[won[0]]

    def test_put_if_absent_race_has_one_winner(self, tier):
        n = 8
        barrier = threading.Barrier(n)
        payloads = [f"writer {i} ".encode() * (i + 1) for i in range(n)]

        def attempt(i):
            barrier.wait()
            try:
                tier.put_if_absent("race/manifest", payloads[i])
                return i
            except ObjectExistsError:
                return None

        with cf.ThreadPoolExecutor(n) as ex:
            results = list(ex.map(attempt, range(n)))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1, results
        assert tier.get("race/manifest") == payloads[winners[0]]

    # --- streaming writer ---

    def test_writer_commit(self, tier):
        data = _data(self.writer_size, 4)
        w = tier.open_writer("w/obj")
        pos = 0
        rng = random.Random(5)
        while pos < len(data):
            n = rng.randrange(1, 1 << 20)
            w.write(memoryview(data)[pos:pos + n])
            pos += n
        w.commit()
        w.commit()  # idempotent
        assert tier.get("w/obj") == data
        assert tier.stat("w/obj").size == len(data)

    def test_writer_small_and_empty(self, tier):
        with tier.open_writer("w/small") as w:
            w.write(b"abc")
            w.write(bytearray(b"def"))
        with tier.open_writer("w/empty"):
            pass
        assert tier.get("w/small") == b"abcdef"
        assert tier.get("w/empty") == b""

    def test_writer_abort_is_invisible(self, tier):
        w = tier.open_writer("wa/obj")
        w.write(_data(self.writer_size, 6))
        w.abort()
        w.abort()  # idempotent
        assert not tier.exists("wa/obj")
        assert list(tier.list("wa/")) == []
        with pytest.raises(ObjectNotFoundError):
            tier.get("wa/obj")

    def test_writer_context_aborts_on_error(self, tier):
        with pytest.raises(RuntimeError):
            with tier.open_writer("wc/obj") as w:
                w.write(b"partial")
                raise RuntimeError("boom")
        assert not tier.exists("wc/obj")

    def test_put_file_get_file(self, tier):
        data = _data(300_000, 7)
        src = os.path.join(self.tmp_path, "src.bin")
        with open(src, "wb") as f:
            f.write(data)
        tier.put_file("pf/obj", src, len(data))
        assert tier.get("pf/obj") == data
        dst = os.path.join(self.tmp_path, "dst.bin")
        tier.get_file("pf/obj", dst)
        with open(dst, "rb") as f:
            assert f.read() == data
        with pytest.raises(ObjectNotFoundError):
            tier.get_file("pf/missing", os.path.join(self.tmp_path, "missing.bin"))

    def test_close_then_reuse(self, tier):
        tier.put("cl/x", b"1")
        tier.close()
        assert tier.get("cl/x") == b"1"  # resources are re-created on demand

    # --- stat / exists / list / delete ---

    def test_stat(self, tier):
        tier.put("st/o", b"x" * 123)
        info = tier.stat("st/o")
        assert info.key == "st/o" and info.size == 123
        assert abs(info.mtime - time.time()) < 3600  # POSIX seconds, not ms or a datetime
        assert tier.exists("st/o")
        assert not tier.exists("st/none")

    def test_list_prefix(self, tier):
        keys = ["a/1", "a/2", "a/sub/3", "ab/4", "b/5", "top"]
        for k in keys:
            tier.put(k, k.encode())
        def ls(p=""):
            return sorted(i.key for i in tier.list(p))
        assert ls() == sorted(keys)
        assert ls("a/") == ["a/1", "a/2", "a/sub/3"]
        assert ls("a/sub/") == ["a/sub/3"]
        assert ls("a") == ["a/1", "a/2", "a/sub/3", "ab/4"]
        assert ls("b/") == ["b/5"]
        assert ls("nothing/") == []
        sizes = {i.key: i.size for i in tier.list()}
        assert sizes == {k: len(k) for k in keys}

    def test_list_dir_one_level(self, tier):
        for k in ["lv/1", "lv/2", "lv/sub/3", "lv/sub/deep/4", "lv/other/5", "lvx/6"]:
            tier.put(k, k.encode())
        files, dirs = tier.list_dir("lv/")
        assert [(i.key, i.size) for i in files] == [("lv/1", 4), ("lv/2", 4)]
        assert dirs == ["lv/other/", "lv/sub/"]  # each deeper level once, not its objects
        files, dirs = tier.list_dir("lv/sub/")
        assert [i.key for i in files] == ["lv/sub/3"] and dirs == ["lv/sub/deep/"]
        assert tier.list_dir("nothing/") == ([], [])

    def test_list_pagination(self, tier):
        n = self.list_count
        keys = [f"many/k{i:05d}" for i in range(n)]
        with cf.ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda k: tier.put(k, b"v"), keys))
        tier.put("other/x", b"v")
        got = [i.key for i in tier.list("many/")]
        assert len(got) == n  # no page lost or repeated
        assert sorted(got) == keys

    def test_delete_idempotent(self, tier):
        tier.put("d/x", b"1")
        tier.put("d/y", b"2")
        tier.delete("d/x")
        tier.delete("d/x")
        tier.delete("d/never-existed")
        assert not tier.exists("d/x")
        assert [i.key for i in tier.list("d/")] == ["d/y"]
        with pytest.raises(ObjectNotFoundError):
            tier.get("d/x")

    # --- missing objects and names ---

    def test_missing_key(self, tier):
        for call in (
            lambda: tier.get("no/such"),
            lambda: tier.get("no/such", 0, 10),
            lambda: tier.get("no/such", 5),
            lambda: tier.get_ranges("no/such", [(0, 1), (10, 20)]),
            lambda: tier.stat("no/such"),
        ):
            with pytest.raises(ObjectNotFoundError) as ei:
                call()
            assert isinstance(ei.value, FileNotFoundError)
        assert not tier.exists("no/such")

    def test_percent_encoded_keys(self, tier):
        keys = ["v/step%2F100%20final/obj", "v/%2Edot/m", "v/a%25b/c-d_e.f"]
        for i, k in enumerate(keys):
            tier.put(k, bytes([i]) * 10)
        for i, k in enumerate(keys):
            assert tier.get(k) == bytes([i]) * 10
        assert sorted(i.key for i in tier.list("v/")) == sorted(keys)
        assert sorted(i.key for i in tier.list("v/step%2F")) == [keys[0]]
        # a different encoding is a different key
        assert not tier.exists("v/step%2f100%20final/obj")

    @pytest.mark.parametrize(
        "bad", ["", "/abs", "a//b", "../x", "a/../b", "a/./b", "a b", "a\\b", "trail/"]
    )
    def test_invalid_keys_rejected(self, tier, bad):
        with pytest.raises(InvalidNameError):
            tier.put(bad, b"x")
        with pytest.raises(InvalidNameError):
            tier.get(bad)

    # --- backdoor: what the tier stores is what the caller gave, and nothing is cached ---

    def test_backdoor_get_set(self, tier):
        data = _data(70_000, 8)
        tier.put("bd/a", data)
        assert self.raw_get(tier, "bd/a") == data
        planted = _data(5_000, 9)
        self.raw_set(tier, "bd/b", planted)
        assert tier.get("bd/b") == planted
        assert tier.get("bd/b", 10, 20) == planted[10:20]
        assert tier.stat("bd/b").size == len(planted)
        assert sorted(i.key for i in tier.list("bd/")) == ["bd/a", "bd/b"]
        flipped = bytes([data[0] ^ 1]) + data[1:]
        self.raw_set(tier, "bd/a", flipped)  # damage planted after a read is seen by the next read
        assert tier.get("bd/a") == flipped
        assert tier.get_ranges("bd/a", [(0, 4)]) == [flipped[:4]]

    def test_writer_stores_exact_bytes(self, tier):
        data = _data(self.writer_size, 10)
        with tier.open_writer("bdw/o") as w:
            w.write(data[:1000])
            w.write(memoryview(data)[1000:])
        assert self.raw_get(tier, "bdw/o") == data

    # --- verified replace (repair) ---

    def test_put_verified(self, tier):
        tier.put("pv/o", b"damaged copy")
        good = _data(200_000, 11)

        def fill(path, data=good):
            with open(path, "wb") as f:
                f.write(data)

        seen = []

        def verify(read, size):
            seen.append(size)
            if read(0, size) != good:
                raise IntegrityError("copy does not verify", object="pv/o")

        tier.put_verified("pv/o", fill, verify)
        assert seen == [len(good)] and self.raw_get(tier, "pv/o") == good
        # a copy that does not verify replaces nothing and leaves nothing behind
        with pytest.raises(IntegrityError):
            tier.put_verified("pv/o", lambda p: fill(p, b"bad"), verify)
        assert self.raw_get(tier, "pv/o") == good
        assert [i.key for i in tier.list("pv/")] == ["pv/o"]
        tier.put_verified("pv/new/o", fill, verify)  # also creates
        assert tier.get("pv/new/o") == good

    # --- directories (local) / none (object stores) ---

    def test_empty_dirs(self, tier):
        w = tier.open_writer("ed/v1/a/obj")
        w.write(b"partial")
        w.abort()
        tier.put("ed/v2/keep", b"k")
        for d in tier.list_empty_dirs("ed/"):
            assert d.size == 0 and d.key.startswith("ed/") and not tier.exists(d.key)
            assert tier.remove_empty_dir(d.key) is True
        assert list(tier.list_empty_dirs("ed/")) == []
        assert tier.remove_empty_dir("ed/v2") is False  # not empty: kept
        assert tier.get("ed/v2/keep") == b"k"
        assert sorted(i.key for i in tier.list("ed/")) == ["ed/v2/keep"]

    # --- optional features are declared ---

    def test_multipart_declared(self, tier):
        if tier.supports_multipart:
            assert list(tier.list_multipart_uploads("mp/")) == []
        else:
            with pytest.raises(NotImplementedError):
                list(tier.list_multipart_uploads("mp/"))

    def test_listing_md5_declared(self, tier):
        """A tier with ``listing_md5`` lists the MD5 of an object written by one ``put`` /
        ``put_if_absent`` (docs/FORMAT.md, "Tiers", rule 3); a multi-part object may list None."""
        if not tier.listing_md5:
            pytest.skip(f"{type(tier).__name__} does not declare listing_md5")
        a, b = _data(1000, 13), _data(70_000, 14)
        tier.put("md5/a", a)
        tier.put_if_absent("md5/sub/b", b)
        want = {"md5/a": hashlib.md5(a).hexdigest(), "md5/sub/b": hashlib.md5(b).hexdigest()}
        assert {i.key: i.md5 for i in tier.list("md5/")} == want
        files, _dirs = tier.list_dir("md5/")
        assert [(i.key, i.md5) for i in files] == [("md5/a", want["md5/a"])]

    def test_part_upload_declared(self, tier):
        """A tier with ``supports_part_upload`` declares its limits and makes an object from parts
        cut to them; nothing is visible before ``complete``, and ``abort`` leaves nothing."""
        if not tier.supports_part_upload:
            with pytest.raises(NotImplementedError):
                tier.open_part_upload("pu/x")
            return
        lim = tier.part_limits
        assert lim is not None and lim.min_part <= lim.part_size <= lim.max_part
        data = _data(2 * lim.part_size + 4321, 15)
        up = tier.open_part_upload("pu/obj")
        off, n = 0, 0
        while off < len(data):
            size = min(lim.part_size, len(data) - off)
            n += 1
            up.send(n, lambda o=off, s=size: data[o:o + s])
            off += size
        assert not tier.exists("pu/obj")
        up.complete(len(data))
        assert tier.get("pu/obj") == data and up.parts == 3
        up2 = tier.open_part_upload("pu/aborted")
        up2.send(1, lambda: data[:lim.part_size])
        up2.abort()
        assert not tier.exists("pu/aborted") and [i.key for i in tier.list("pu/")] == ["pu/obj"]

    # --- conditional replace (docs/FORMAT.md, "Conditional writes"); skipped where not declared ---

    def _needs_conditional_replace(self, tier):
        if not tier.supports_conditional_replace:
            pytest.skip(f"{type(tier).__name__} does not declare supports_conditional_replace")

    def test_conditional_replace_swaps_only_the_token_seen(self, tier):
        self._needs_conditional_replace(tier)
        tier.put("cas/k", b"one")
        t1 = tier.stat("cas/k").token
        assert t1
        tier.replace_if_match("cas/k", b"two", t1)
        assert tier.get("cas/k") == b"two"
        t2 = tier.stat("cas/k").token
        assert t2 and t2 != t1
        with pytest.raises(PreconditionFailedError):  # a stale token: another writer replaced it
            tier.replace_if_match("cas/k", b"three", t1)
        assert tier.get("cas/k") == b"two"
        tier.delete("cas/k")
        with pytest.raises(PreconditionFailedError):  # deleted since: nothing is written
            tier.replace_if_match("cas/k", b"four", t2)
        assert not tier.exists("cas/k")

    def test_conditional_replace_race_has_one_winner(self, tier):
        self._needs_conditional_replace(tier)
        tier.put("cas/race", b"base")
        token = tier.stat("cas/race").token
        n = 6
        barrier = threading.Barrier(n)
        payloads = [f"replacer {i} ".encode() * (i + 1) for i in range(n)]

        def attempt(i):
            barrier.wait()
            try:
                tier.replace_if_match("cas/race", payloads[i], token)
                return i
            except PreconditionFailedError:
                return None

        with cf.ThreadPoolExecutor(n) as ex:
            results = list(ex.map(attempt, range(n)))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1, results
        assert tier.get("cas/race") == payloads[winners[0]]

    def test_conditional_replace_token_listed(self, tier):
        self._needs_conditional_replace(tier)
        tier.put("cas/l", b"x")
        listed = {i.key: i.token for i in tier.list("cas/")}
        assert listed["cas/l"] in (None, tier.stat("cas/l").token)

    # --- error contract ---

    def test_transient_errors_are_typed(self):
        with self.transient_tier() as t:
            w = None
            for what, call in (
                ("get", lambda: t.get("te/a")),
                ("ranged get", lambda: t.get("te/a", 0, 10)),
                ("get of a missing key", lambda: t.get("te/missing")),
                ("stat", lambda: t.stat("te/a")),
                ("exists", lambda: t.exists("te/a")),
                ("list", lambda: list(t.list("te/"))),
                ("put", lambda: t.put("te/b", b"b")),
                ("put_if_absent", lambda: t.put_if_absent("te/c", b"c")),
                ("delete", lambda: t.delete("te/a")),
            ):
                with pytest.raises(TransientStorageError) as ei:
                    call()
                assert not isinstance(ei.value, ObjectNotFoundError), what
                assert str(ei.value), what
            with pytest.raises(TransientStorageError):
                w = t.open_writer("te/w")
                w.write(b"x" * 1000)
                w.commit()
            if w is not None:
                w.abort()

    def test_full_storage_is_typed(self):
        with self.full_tier() as (t, free):
            before = sorted(i.key for i in t.list(""))
            data = _data(256 << 10, 12)
            for what, call in (
                ("put", lambda: t.put("fu/a", data)),
                ("put into a new directory", lambda: t.put("fu/new/dir/a", data)),
                ("put_if_absent", lambda: t.put_if_absent("fu/b", data)),
            ):
                with pytest.raises(StorageFullError) as ei:
                    call()
                assert "full" in str(ei.value), what
            w = None
            with pytest.raises(StorageFullError):
                w = t.open_writer("fu/w")
                w.write(data)
                w.commit()
            if w is not None:
                w.abort()
            assert sorted(i.key for i in t.list("")) == before  # nothing partial is visible
            free()
            t.put("fu/new/dir/a", data)
            assert t.get("fu/new/dir/a") == data
