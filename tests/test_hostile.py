"""Hostile manifests, frames and metadata objects.

Someone with write access to a store (no key, or an unencrypted store) writes manifests, frames and
DCP metadata objects of their choosing. Expected: typed errors (subclasses of
:class:`ckptstore.CkptStoreError`), never a file touched outside the root, never an unpickling of
unverified bytes, and the allow-list unpickler refuses anything that is not DCP metadata.

Also property-based fuzzing (``hypothesis``) of the manifest parser, the frame header parser, the
frame walker, :meth:`FrameCodec.decode` and the codec stage decoders: no exception other than the
package's typed errors. Example counts are printed at the end of the module (``-s``);
``CKPTSTORE_FULL=1`` (or ``CKPTSTORE_FUZZ_EXAMPLES=N``) runs more examples.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import os
import pickle
import struct
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore.codec import xxh3
from ckptstore.codec.crypto import FrameCipher
from ckptstore.codec.frame import FIXED_LEN, MAGIC, FrameCodec, FrameRef, build_header, iter_frames, parse_header
from ckptstore.codec.stages import decode_stage
from ckptstore.errors import CkptStoreError, ManifestError, UnsupportedFormatError
from ckptstore.manifest import catalogue, layout
from ckptstore.manifest.schema import MAGIC as MMAGIC
from ckptstore.manifest.schema import parse
from ckptstore.tiers import LocalTier

import crash_ranks
from helpers import forge_metadata, mutated

FULL = os.environ.get("CKPTSTORE_FULL") == "1"
N_EXAMPLES = int(os.environ.get("CKPTSTORE_FUZZ_EXAMPLES", "5000" if FULL else "300"))
EXAMPLES: collections.Counter = collections.Counter()
FUZZ = settings(max_examples=N_EXAMPLES, deadline=None, database=None, derandomize=not FULL,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])


@pytest.fixture(scope="module", autouse=True)
def fuzz_report():
    yield
    if EXAMPLES:
        lines = [f"  {k}: {v} examples" for k, v in sorted(EXAMPLES.items())]
        print(f"\n\nfuzzing ({sum(EXAMPLES.values())} examples in all):\n" + "\n".join(lines) + "\n")


# ---- helpers ------------------------------------------------------------------------------------
def seal(body: dict | bytes, mac: str | None = None, seal_extra: dict | None = None) -> bytes:
    """A manifest file with a *valid* xxh3 seal over ``body`` (so parsing gets past the checksum)."""
    b = body if isinstance(body, bytes) else json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    from ckptstore.manifest import schema

    checksum = getattr(schema, "seal_checksum", None)  # the seal covers the HMAC since the fix
    s = {"xxh3": checksum(b, mac if isinstance(mac, str) else None) if checksum else f"{xxh3(b):016x}"}
    if mac is not None:
        s["hmac_sha256"] = mac
    s.update(seal_extra or {})
    return b"\n".join([MMAGIC, b, json.dumps(s).encode()]) + b"\n"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An unencrypted and an encrypted version, saved in-process."""
    root = str(tmp_path_factory.mktemp("hostile") / "root")
    crash_ranks.local_save(root, "v1", 1)
    crash_ranks.local_save(root, "enc", 2, key=bytes(32))
    body = json.loads(open(os.path.join(root, layout.manifest_key("v1")), "rb").read())["body"]
    return root, body


def typed_load_error(root, version, seed=1, **kw) -> list:
    """Load ``version``; it must fail, and only with ckptstore's typed errors. Returns them."""
    with pytest.raises(BaseException) as ei:
        crash_ranks.load_state(root, version, seed, **kw)
    errs = crash_ranks._describe(ei.value)
    assert errs and all(typed for _n, typed, _m in errs), errs
    return errs


class FileAudit:
    """Records file-system events (PEP 578 audit hooks) while ``on``."""

    EVENTS = {"open", "os.remove", "os.rename", "os.replace", "os.link", "os.symlink", "os.mkdir", "os.rmdir",
              "os.truncate", "os.listdir", "os.scandir", "os.chmod", "os.utime", "shutil.rmtree", "shutil.copyfile"}
    _installed = None

    def __init__(self):
        self.on = False
        self.events: list = []

    @classmethod
    def get(cls) -> "FileAudit":
        if cls._installed is None:
            cls._installed = cls()
            sys.addaudithook(cls._installed._hook)
        return cls._installed

    def _hook(self, event, args):
        if self.on and event in self.EVENTS:
            paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
            self.events.append((event, [os.path.abspath(os.fsdecode(p)) for p in paths], args[1:3]))

    def __enter__(self):
        self.events = []
        self.on = True
        return self

    def __exit__(self, *a):
        self.on = False

    def touching(self, directory: str) -> list:
        d = os.path.abspath(directory) + os.sep
        return [e for e in self.events if any((p + os.sep).startswith(d) for p in e[1])]

    def writes_outside(self, root: str) -> list:
        r = os.path.abspath(root) + os.sep
        out = []
        for ev, paths, rest in self.events:
            if ev == "open":
                mode = rest[0] if rest else None
                flags = rest[1] if len(rest) > 1 else 0
                write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
                )
                if not write:
                    continue
            paths = [p for p in paths if "__pycache__" not in p]  # bytecode caches of lazily imported modules
            if any(not (p + os.sep).startswith(r) for p in paths):
                out.append((ev, paths))
        return out


# ---- hostile manifests: hand-written ------------------------------------------------------------
def _set(path, value):
    def f(b):
        d = b
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value

    return f


def _del(path):
    def f(b):
        d = b
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]

    return f


TRAVERSALS = [
    "../../../victim/secret",
    "/etc/passwd",
    "/abs/attempts/x/r00000.ckd",
    "attempts/../../../../victim/secret",
    "attempts/{a}/../../../../victim/secret",
    "attempts/{a}/..",
    "attempts/{a}/.",
    "attempts/{a}/",
    "attempts/{a}/sub/r00000.ckd",
    "attempts/{a}\\..\\..\\victim",
    "attempts/{a}/..\\..\\secret",
    "attempts/{a}/r00000.ckd\x00.txt",
    "attempts/{a}/r０.ckd",
    "attempts/{a}/" + "x" * 300,
    "attempts/other-attempt/r00000.ckd",
    "attempts//r00000.ckd",
    "versions/v1/manifest.json",
    "",
]


def hostile_manifest_cases(body: dict):
    a = body["attempt"]
    for t in TRAVERSALS:
        yield f"object name {t!r}", _set(["objects", 0, "name"], t.format(a=a))
        yield f"metadata name {t!r}", _set(["metadata_object", "name"], t.format(a=a))
    for bad in (5, None, ["x"], {"a": 1}, True):
        yield f"object name of type {type(bad).__name__}", _set(["objects", 0, "name"], bad)
    for field in ("size", "frames", "nbytes", "rank"):
        for bad in (-1, 1 << 63, 10**30, 1.5, "12", True, [1], float("inf")):
            yield f"objects[0].{field} = {bad!r}", _set(["objects", 0, field], bad)
    for field in ("world_size", "nbytes", "stored_bytes", "step"):
        for bad in (-5, 1 << 64, "7", 2.5, False, {}):
            yield f"{field} = {bad!r}", _set([field], bad)
    for bad in ("ABCDEF0123456789", "0123", "zz" * 8, 12345, None, "0" * 17):
        yield f"digest = {bad!r}", _set(["objects", 0, "digest"], bad)
    for field in ("format", "version", "attempt", "created", "world_size", "objects", "metadata_object"):
        yield f"missing {field}", _del([field])
    for field in ("name", "size", "digest", "frames", "nbytes"):
        yield f"missing objects[0].{field}", _del(["objects", 0, field])
        yield f"missing metadata_object.{field}", _del(["metadata_object", field])
    for bad in ("ckptstore/2", "ckptstore/0", "", None, 1, ["ckptstore/1"]):
        yield f"format = {bad!r}", _set(["format"], bad)
    for bad in ("../v1", "..", ".", "", "v2", "a\nb", 7, None):
        yield f"version = {bad!r}", _set(["version"], bad)
    for bad in ("../x", "", "a/b", "a" * 100, 12, None, "attempt with space"):
        yield f"attempt = {bad!r}", _set(["attempt"], bad)
    for bad in ("yesterday", "", 5, None, "2026-13-45T99:99:99Z"):
        yield f"created = {bad!r}", _set(["created"], bad)
    for bad in ([], "x", 5):
        yield f"user = {bad!r}", _set(["user"], bad)
    for bad in ({}, "zstd/1", [1], [None]):
        yield f"codecs = {bad!r}", _set(["codecs"], bad)
    yield "writer = 5", _set(["writer"], 5)
    for bad in ("x", 5, [], {"alg": "AES-128-CBC", "key_id": "0" * 16, "wrapped_key": "AA=="},
                {"alg": "AES-256-GCM", "key_id": "XYZ", "wrapped_key": "AA=="},
                {"alg": "AES-256-GCM", "key_id": "0" * 16, "wrapped_key": 5},
                {"alg": "AES-256-GCM", "key_id": "0" * 16, "wrapped_key": "A" * 5000},
                {"alg": "AES-256-GCM", "key_id": "0" * 16, "wrapped_key": "AA=="}):  # encrypted, but no HMAC in the seal
        yield f"encryption = {str(bad)[:60]}", _set(["encryption"], bad)
    yield "objects is a dict", _set(["objects"], {"0": body["objects"][0]})
    yield "objects[0] is a list", _set(["objects", 0], [1, 2])
    yield "metadata_object is null", _set(["metadata_object"], None)
    yield "body is a list", None


def test_hostile_manifests_raise_typed_errors(saved):
    root, body = saved
    n = 0
    for what, mutate in hostile_manifest_cases(body):
        b = copy.deepcopy(body)
        if mutate is None:
            data = seal(json.dumps([b]).encode())
        else:
            mutate(b)
            data = seal(json.dumps(b, sort_keys=True, separators=(",", ":")).encode())
        with pytest.raises((ManifestError, UnsupportedFormatError)) as ei:
            parse(data, expect_version="v1")
        assert isinstance(ei.value, CkptStoreError), what
        n += 1
    EXAMPLES["hand-written hostile manifest bodies"] += n
    assert n > 150


RAW_MANIFESTS = [
    ("empty", b""),
    ("magic only", MMAGIC),
    ("newer magic", b"CKPTSTORE-MANIFEST 2\n{}\n{}\n"),
    ("wrong magic", b"CKPTSTORE-MANIFESTO 1\n{}\n{}\n"),
    ("no trailing newline", None),
    ("CRLF", None),
    ("extra line", None),
    ("seal not JSON", MMAGIC + b"\n{}\nnot json\n"),
    ("seal is a list", MMAGIC + b"\n{}\n[1]\n"),
    ("seal lacks xxh3", MMAGIC + b'\n{}\n{"hmac_sha256":"00"}\n'),
    ("body not UTF-8", seal(b'{"format":"ckptstore/1","x":"\xff\xfe"}')),
    ("body not JSON", seal(b"{not json")),
    ("body is a number", seal(b"42")),
    ("body with NaN", seal(b'{"format":"ckptstore/1","step":NaN}')),
    ("huge integer literal", seal(b'{"format":"ckptstore/1","world_size":' + b"9" * 5000 + b"}")),
]


def test_hostile_manifest_files_raise_typed_errors(saved):
    root, body = saved
    good = seal(body)
    for what, data in RAW_MANIFESTS:
        if data is None:
            data = {"no trailing newline": good[:-1], "CRLF": good.replace(b"\n", b"\r\n"), "extra line": good + b"x\n"}[what]
        with pytest.raises((ManifestError, UnsupportedFormatError)):
            parse(data, expect_version="v1")
    EXAMPLES["hand-written hostile manifest files"] += len(RAW_MANIFESTS)


def test_manifest_of_another_key_is_refused(saved, tmp_path):
    """An encrypted manifest re-sealed by someone holding another master key (or a version moved
    in from another store) is refused with the right key: KeyMismatchError (key id) or a failed
    HMAC — never loaded."""
    root, _body = saved
    import shutil

    other = str(tmp_path / "other")
    crash_ranks.local_save(other, "enc", 2, key=bytes([7]) * 32)  # same name, another key
    mine = str(tmp_path / "mine")
    shutil.copytree(root, mine)
    shutil.rmtree(os.path.join(mine, layout.version_dir("enc")))
    shutil.copytree(os.path.join(other, layout.version_dir("enc")), os.path.join(mine, layout.version_dir("enc")))
    errs = typed_load_error(mine, "enc", seed=2, key=bytes(32))
    assert any(n == "KeyMismatchError" for n, _t, _m in errs), errs
    # the attacker keeps our key id but wraps their own data key and seals with it
    from ckptstore.codec.crypto import key_id, manifest_mac, new_data_key, wrap_key

    mp = os.path.join(mine, layout.manifest_key("enc"))
    b = json.loads(open(mp, "rb").read())["body"]
    dk = new_data_key()
    b["encryption"] = {"alg": "AES-256-GCM", "key_id": key_id(bytes(32)), "wrapped_key": wrap_key(bytes([9]) * 32, dk, "enc", b["attempt"])}
    raw = json.dumps(b, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    open(mp, "wb").write(seal(raw, mac=manifest_mac(dk, raw)))
    errs = typed_load_error(mine, "enc", seed=2, key=bytes(32))
    assert any(n == "IntegrityError" and "wrapped data key" in m for n, _t, m in errs), errs
    # a stripped-down, *unencrypted* copy of the manifest is refused when a key is configured
    b["encryption"] = None
    raw = json.dumps(b, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    open(mp, "wb").write(seal(raw))
    errs = typed_load_error(mine, "enc", seed=2, key=bytes(32))
    assert any(n == "KeyMismatchError" and "not encrypted" in m for n, _t, m in errs), errs


def test_deeply_nested_manifest_json_is_a_typed_error(saved, tmp_path):
    root, body = saved
    deep = b"[" * 100_000 + b"]" * 100_000
    for data in (seal(json.dumps(body).encode()[:-1] + b',"user":' + deep + b"}"), MMAGIC + b"\n{}\n" + deep + b"\n"):
        with pytest.raises((ManifestError, UnsupportedFormatError)):
            parse(data)
    # one such file must not take the catalogue down
    import shutil

    r2 = str(tmp_path / "r2")
    shutil.copytree(root, r2)
    d = os.path.join(r2, "versions", "evil")
    os.makedirs(d)
    open(os.path.join(d, "manifest.json"), "wb").write(MMAGIC + b"\n{}\n" + deep + b"\n")
    st_ = ckptstore.Store(r2)
    assert {r.version for r in st_.versions()} == {"v1", "enc"} and st_.problems


def test_undecodable_version_directory_is_ignored(saved, tmp_path):
    import shutil

    root, _body = saved
    r2 = str(tmp_path / "r2")
    shutil.copytree(root, r2)
    d = os.path.join(r2, "versions", "%FF")
    os.makedirs(d)
    open(os.path.join(d, "manifest.json"), "wb").write(b"x")
    st_ = ckptstore.Store(r2)
    assert {r.version for r in st_.versions()} == {"v1", "enc"}
    from ckptstore import scrub as _scrub

    _scrub.scrub(st_)


def test_hostile_manifests_in_a_store_touch_nothing_outside(saved, tmp_path):
    """Hostile manifests (resealed, so they pass the checksum) written into a store: listing,
    loading, scrub and gc raise typed errors or skip them, and no file outside the root is read,
    written or deleted."""
    import datetime as dt
    import shutil

    src, body = saved
    base = tmp_path / "t"
    root = str(base / "root")
    shutil.copytree(src, root)
    victim = base / "victim"
    victim.mkdir()
    (victim / "secret").write_bytes(b"do not touch")
    (base / "root" / "secret").write_bytes(b"outside versions/")
    names = []
    for i, (what, mutate) in enumerate(c for c in hostile_manifest_cases(body) if "name" in c[0]):
        b = copy.deepcopy(body)
        mutate(b)
        v = f"h{i}"
        b["version"] = v
        d = os.path.join(root, layout.version_dir(v))
        os.makedirs(d)
        with open(os.path.join(d, "manifest.json"), "wb") as f:
            f.write(seal(json.dumps(b, sort_keys=True, separators=(",", ":")).encode()))
        names.append(v)
    audit = FileAudit.get()
    from ckptstore import gc as _gc
    from ckptstore import scrub as _scrub

    with audit:
        st_ = ckptstore.Store(root)
        assert {r.version for r in st_.versions()} == {"v1", "enc"}
        assert len(st_.problems) == len(names)
        for v in names[:12]:
            typed_load_error(root, v)
        rep = _scrub.scrub(st_)
        assert {vc.version for vc in rep.versions if vc.status == _scrub.DAMAGED} == set(names)
        _plan, res = _gc.run(st_.tiers, None, now=dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1), grace=0)
        assert res.ok
    assert audit.touching(str(victim)) == []
    assert audit.writes_outside(root) == []
    assert (victim / "secret").read_bytes() == b"do not touch"
    assert (base / "root" / "secret").read_bytes() == b"outside versions/"
    assert crash_ranks.load_state(root, "v1", 1)


# ---- hostile DCP metadata (unencrypted store, consistent checksums) -------------------------------
def _metadata(root, version):
    r = ckptstore.StorageReader(root)
    r.reset(version)
    return r.read_metadata()


def _loc_mutations(md, attempt):
    """(what, storage_data) with one ItemLocation made hostile."""

    items = [(k, v) for k, v in md.storage_data.items() if v.shape is not None and len(v.frames) >= 1]
    idx, loc = items[0]
    f0 = loc.frames[0]

    def with_loc(**kw):
        sd = dict(md.storage_data)
        sd[idx] = dataclasses.replace(loc, **kw)
        return sd

    def with_frame(**kw):
        return with_loc(frames=(dataclasses.replace(f0, **kw),) + tuple(loc.frames[1:]))

    yield "object traversal", with_loc(object=f"attempts/{attempt}/../../../../victim/secret")
    yield "absolute object", with_loc(object="/etc/passwd")
    yield "object of another attempt", with_loc(object="attempts/other-attempt/r00000.ckd")
    yield "object not in the manifest", with_loc(object=f"attempts/{attempt}/r00099.ckd")
    yield "object is not a str", with_loc(object=5)
    yield "negative offset", with_frame(offset=-10)
    yield "offset past the object", with_frame(offset=1 << 40)
    yield "huge length", with_frame(length=1 << 62)
    yield "zero length", with_frame(length=0)
    yield "raw_len too big (nbytes agrees)", with_loc(frames=(dataclasses.replace(f0, raw_len=f0.raw_len + (1 << 40)),) + tuple(loc.frames[1:]),
                                                        nbytes=loc.nbytes + (1 << 40))
    yield "raw_len disagrees with nbytes", with_frame(raw_len=f0.raw_len + 1)
    yield "wrong frame index", with_frame(index=f0.index + 1)
    yield "wrong checksum", with_frame(xxh3=f0.xxh3 ^ 1)
    yield "frames not FrameRefs", with_loc(frames=((0, 10, 10, 0, 0),))
    yield "frame list not a tuple", with_loc(frames=None)
    yield "unknown dtype", with_loc(dtype="os")
    yield "dtype not a str", with_loc(dtype=5)
    yield "dtype of another size", with_loc(dtype="float64" if loc.dtype != "float64" else "int8")
    yield "shape bigger than the data", with_loc(shape=tuple(s * 1000 for s in loc.shape))
    yield "shape of another rank", with_loc(shape=tuple(loc.shape) + (1,))
    yield "shape with negative size", with_loc(shape=tuple(-s for s in loc.shape))
    yield "shape is a str", with_loc(shape="abc")
    yield "not an ItemLocation", {**md.storage_data, idx: {"object": loc.object}}
    yield "storage_data is a list", [loc]


#: hostile ItemLocations allowed to fail with an untyped error (none)
KNOWN_UNTYPED: set = set()  # every hostile ItemLocation must fail with a typed error


def test_hostile_item_locations(saved, tmp_path):
    """DCP metadata forged with consistent checksums but hostile ``ItemLocation``s: the load fails
    with a typed error, or (when the lie is self-consistent, e.g. another dtype of the same size)
    returns the stored bytes — and never touches a file outside the root."""
    _hostile_locations(saved, tmp_path, lambda what: what not in KNOWN_UNTYPED)


def _hostile_locations(saved, tmp_path, select):
    import shutil

    src, _body = saved
    audit = FileAudit.get()
    untyped = []
    n = 0
    m = catalogue.read_manifest(LocalTier(src), "v1").manifest
    md = _metadata(src, "v1")
    for what, sd in _loc_mutations(md, m.attempt):
        if not select(what):
            continue
        root = str(tmp_path / f"c{n}" / "root")
        shutil.copytree(src, root)
        victim = tmp_path / f"c{n}" / "victim"
        victim.mkdir()
        (victim / "secret").write_bytes(b"x")
        md2 = copy.copy(md)
        md2.storage_data = sd
        forge_metadata(root, "v1", pickle.dumps(md2, protocol=pickle.HIGHEST_PROTOCOL))
        with audit:
            try:
                crash_ranks.load_state(root, "v1", 1)
                outcome = None
            except BaseException as e:  # noqa: BLE001
                outcome = crash_ranks._describe(e)
        n += 1
        assert audit.touching(str(victim)) == [], what
        assert audit.writes_outside(root) == [], what
        if outcome is not None and not all(t for _n, t, _m in outcome):
            untyped.append((what, outcome[0][0], outcome[0][2][:200]))
    EXAMPLES["hostile ItemLocations"] += n
    assert not untyped, "untyped errors for hostile metadata:\n" + "\n".join(map(str, untyped))


# ---- pickles that would run code -----------------------------------------------------------------
def _reduce_pickle(module: str, name: str, args: tuple, proto: int = 4) -> bytes:
    """A pickle calling ``module.name(*args)`` (STACK_GLOBAL; dotted names resolve under proto 4)."""
    def u(s):
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b

    argp = pickle.dumps(args, protocol=proto)
    argp = argp[2:-1]  # strip PROTO and STOP
    if argp.startswith(b"\x95"):  # FRAME
        argp = argp[9:]
    return bytes([0x80, proto]) + u(module) + u(name) + b"\x93" + argp + b"R."


@pytest.mark.parametrize(
    "module,name",
    [("os", "system"), ("posix", "system"), ("builtins", "eval"), ("subprocess", "getoutput"),
     ("torch._utils", "_rebuild_tensor_v2"), ("torch", "load"), ("ckptstore.tiers.local", "os.system")],
)
def test_metadata_pickle_outside_the_allow_list_is_refused(saved, tmp_path, module, name):
    import shutil

    src, _body = saved
    root = str(tmp_path / "root")
    shutil.copytree(src, root)
    marker = tmp_path / "pwned"
    forge_metadata(root, "v1", _reduce_pickle(module, name, (f"touch {marker}",)))
    errs = typed_load_error(root, "v1")
    assert any(n == "IntegrityError" and "allow" in m for n, _t, m in errs), errs
    assert not marker.exists()


def test_unverified_metadata_is_never_unpickled(saved, tmp_path, monkeypatch):
    """A metadata object whose frame fails its checksum is refused before any unpickling."""
    import shutil

    src, _body = saved
    root = str(tmp_path / "root")
    shutil.copytree(src, root)
    m = catalogue.read_manifest(LocalTier(root), "v1").manifest
    p = LocalTier(root).local_path(layout.object_key("v1", m.metadata_object.name))
    data = bytearray(open(p, "rb").read())
    data[-1] ^= 1
    open(p, "wb").write(bytes(data))
    calls = []
    import ckptstore.dcp.reader as rd

    real = rd._restricted_loads
    monkeypatch.setattr(rd, "_restricted_loads", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: calls.append(2) or (_ for _ in ()).throw(AssertionError("pickle.loads")))
    typed_load_error(root, "v1")
    assert calls == []


def test_allow_list_refuses_dotted_names(saved, tmp_path):
    import shutil

    src, _body = saved
    root = str(tmp_path / "root")
    shutil.copytree(src, root)
    marker = tmp_path / "pwned"
    forge_metadata(root, "v1", _reduce_pickle("torch.distributed.checkpoint.filesystem", "os.system", (f"touch {marker}",)))
    try:
        typed_load_error(root, "v1")
    finally:
        ran = marker.exists()
    assert not ran, "the allow-list unpickler ran os.system from a forged metadata object"


class _Evil:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_allow_list_refuses_functions_of_allowed_modules(saved, tmp_path):
    import shutil
    import warnings

    src, _body = saved
    root = str(tmp_path / "root")
    shutil.copytree(src, root)
    marker = tmp_path / "pwned"
    evil = os.path.join(root, "versions", "v1", "extra.bin")  # any file the attacker can write
    torch.save(_Evil(f"touch {marker}"), evil)
    forge_metadata(root, "v1", _reduce_pickle("torch.distributed.checkpoint.format_utils", "torch_save_to_dcp",
                                              (evil, str(tmp_path / "out")), proto=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            typed_load_error(root, "v1")
        finally:
            ran = marker.exists()
    assert not ran, "the allow-list unpickler called torch_save_to_dcp, which unpickled an attacker's file"


def test_scrub_deep_uses_the_same_allow_list(saved, tmp_path):
    import shutil

    from ckptstore import scrub as _scrub

    src, _body = saved
    root = str(tmp_path / "root")
    shutil.copytree(src, root)
    marker = tmp_path / "pwned"
    forge_metadata(root, "v1", _reduce_pickle("os", "system", (f"touch {marker}",)))
    rep = _scrub.scrub(ckptstore.Store(root), deep=True, key=bytes(32))
    assert ("local", "v1", "", "metadata") in rep.damage()
    assert not marker.exists()


# ---- hostile frames: hand-written -------------------------------------------------------------------
def _header(index=0, raw_len=10, payload=b"0123456789", chain="", header_len=None, codec_len=None, stored_len=None,
            payload_xxh3=None, magic=MAGIC, fix_checksum=True) -> bytes:
    cb = chain.encode("utf-8", "surrogatepass")
    cl = len(cb) if codec_len is None else codec_len
    hl = FIXED_LEN + len(cb) + 8 if header_len is None else header_len
    sl = len(payload) if stored_len is None else stored_len
    ph = xxh3(payload) if payload_xxh3 is None else payload_xxh3
    head = struct.pack("<4sHHQQQQ", magic, hl & 0xFFFF, cl & 0xFFFF, index, raw_len, sl, ph) + cb
    hh = xxh3(head) if fix_checksum else 0
    return head + struct.pack("<Q", hh) + payload


HOSTILE_FRAMES = [
    ("bad magic", _header(magic=b"CKF2")),
    ("codec_len > 1024", _header(chain="zstd/1", codec_len=2000)),
    ("header_len too small", _header(header_len=10)),
    ("header_len too large", _header(header_len=60000)),
    ("stored_len huge", _header(stored_len=1 << 63)),
    ("raw_len > 2 GiB", _header(raw_len=1 << 40)),
    ("raw_len 2^64-1", _header(raw_len=(1 << 64) - 1)),
    ("unknown codec", _header(chain="lz4/1")),
    ("codec with newer version", _header(chain="zstd/2")),
    ("aesgcm not last", _header(chain="aesgcm/1|zstd/1")),
    ("aesgcm without key", _header(chain="aesgcm/1", payload=bytes(40))),
    ("non-ASCII chain", _header(chain="zst\xe9/1")),
    ("empty stage", _header(chain="zstd/1||zstd/1")),
    ("bytegroup bad param", _header(chain="bytegroup/1:3", payload=bytes(64), raw_len=64)),
    ("bytegroup huge param", _header(chain="bytegroup/1:99999999999999999999", payload=bytes(64), raw_len=64)),
    ("bytegroup garbage", _header(chain="bytegroup/1:2", payload=bytes(range(200)), raw_len=100)),
    ("zstd garbage", _header(chain="zstd/1", payload=b"\x28\xb5\x2f\xfd" + bytes(30), raw_len=100)),
    ("zstd declares more than raw_len", _header(chain="zstd/1", payload=__import__("zstandard").ZstdCompressor().compress(bytes(1000)), raw_len=10)),
    ("zstd declares less than raw_len", _header(chain="zstd/1", payload=__import__("zstandard").ZstdCompressor().compress(bytes(10)), raw_len=1000)),
    ("raw payload shorter than raw_len", _header(raw_len=11)),
    ("bad header checksum", _header(fix_checksum=False)),
    ("bad payload checksum", _header(payload_xxh3=1)),
    ("truncated header", _header()[:30]),
    ("empty", b""),
]


def test_hostile_frames_raise_typed_errors():
    key_codec = FrameCodec("v", "a", FrameCipher(bytes(32)))
    plain = FrameCodec("v", "a", None)
    n = 0
    for what, buf in HOSTILE_FRAMES:
        for codec in (plain, key_codec):
            with pytest.raises(CkptStoreError):
                codec.decode("o", buf, None)
                raise AssertionError(f"{what}: decoded")
            n += 1
        try:
            list(iter_frames(lambda o, k: buf[o : o + k], len(buf), "o"))
        except CkptStoreError:
            pass
        n += 1
    EXAMPLES["hand-written hostile frames"] += n


# ---- property-based fuzzing ---------------------------------------------------------------------
json_leaf = st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True) | st.text(max_size=40)
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4), max_leaves=12)

BASE_BODY = None


def _base_body():
    global BASE_BODY
    if BASE_BODY is None:
        a = "20261129T080644-1f50320f96bc-04341"
        BASE_BODY = {
            "attempt": a, "codecs": ["zstd/1"], "created": "2026-11-29T08:06:44.401717Z", "encryption": None,
            "format": "ckptstore/1",
            "metadata_object": {"digest": "ada3abf526c8ff51", "frames": 1, "name": f"attempts/{a}/metadata.ckd", "nbytes": 1727, "rank": None, "size": 1096},
            "nbytes": 1802566,
            "objects": [{"digest": "0e9de66757916e3c", "frames": 6, "name": f"attempts/{a}/r00000.ckd", "nbytes": 1802566, "rank": 0, "size": 1576677}],
            "step": 5, "stored_bytes": 1577773, "user": {}, "version": "v1", "world_size": 1, "writer": "ckptstore 0.1.0",
        }
    return BASE_BODY


def _paths(d, prefix=()):
    yield prefix
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _paths(v, prefix + (i,))


def _check_parse(data: bytes):
    try:
        pm = parse(data)
    except (ManifestError, UnsupportedFormatError):
        return
    # accepted: every name it hands out is inside the layout
    from ckptstore._names import check_object_name

    for o in pm.manifest.all_objects():
        check_object_name(o.name)
        assert o.name.split("/")[1] == pm.manifest.attempt
        assert layout.object_key(pm.manifest.version, o.name).startswith("versions/")


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_manifest_parse_bytes(data):
    EXAMPLES["manifest parse: arbitrary bytes"] += 1
    _check_parse(data)
    _check_parse(MMAGIC + b"\n" + data)


@FUZZ
@given(st.data())
def test_fuzz_manifest_parse_structured(data):
    """A valid manifest with one field replaced by arbitrary JSON (or deleted), resealed."""
    EXAMPLES["manifest parse: resealed field mutations"] += 1
    body = copy.deepcopy(_base_body())
    paths = [p for p in _paths(body) if p]
    path = data.draw(st.sampled_from(paths))
    target = body
    for k in path[:-1]:
        target = target[k]
    if data.draw(st.booleans()):
        target[path[-1]] = data.draw(json_value)
    elif isinstance(target, dict):
        del target[path[-1]]
    else:
        target.pop(path[-1])
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=data.draw(st.booleans()), allow_nan=True).encode()
    mac = data.draw(st.none() | st.text(max_size=70))
    _check_parse(seal(raw, mac=mac))


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_parse_header_bytes(buf):
    EXAMPLES["frame parse_header: arbitrary bytes"] += 1
    try:
        parse_header(buf, "o")
    except CkptStoreError:
        pass


frame_chain = st.sampled_from(["", "zstd/1", "bytegroup/1:2", "bytegroup/1:4", "bytegroup/1:1", "bytegroup/1:8", "aesgcm/1",
                               "zstd/1|aesgcm/1", "bytegroup/1:2|aesgcm/1", "bytegroup/1:0", "bytegroup/1:", "zstd/1|zstd/1",
                               "lz4/1", "aesgcm/1|zstd/1", "zstd/1:x", "|"]) | st.text(max_size=20)


@st.composite
def frames(draw):
    """A frame with valid header and payload checksums around arbitrary content (so decoding
    gets past the checksums), or a valid frame with a few bytes mutated."""
    chain = draw(frame_chain)
    payload = draw(st.binary(max_size=400))
    if draw(st.booleans()) and chain.startswith("zstd/1"):
        import zstandard

        payload = zstandard.ZstdCompressor().compress(draw(st.binary(max_size=300)))
    raw_len = draw(st.integers(min_value=0, max_value=1 << 20) | st.integers(min_value=0, max_value=(1 << 64) - 1) | st.just(len(payload)))
    index = draw(st.integers(min_value=0, max_value=(1 << 64) - 1) | st.just(0))
    try:
        chain.encode("ascii")
        head, _h = build_header(index, raw_len, payload, chain)
        buf = head + payload
    except (UnicodeEncodeError, struct.error):
        buf = _header(index=index % (1 << 64), raw_len=raw_len, payload=payload, chain=chain)
    return mutated(draw, buf, (0, 3))


@FUZZ
@given(frames(), st.booleans(), st.booleans())
def test_fuzz_frame_decode(buf, with_key, with_ref):
    EXAMPLES["FrameCodec.decode: checksummed hostile frames"] += 1
    codec = FrameCodec("v", "a", FrameCipher(bytes(32)) if with_key else None)
    ref = FrameRef(0, len(buf), 0, 0, 0) if with_ref else None
    try:
        out = codec.decode("o", buf, ref)
    except CkptStoreError:
        return
    hd = parse_header(buf, "o")
    assert len(out) == hd.raw_len


@FUZZ
@given(st.lists(frames(), min_size=1, max_size=4), st.integers(min_value=0, max_value=64))
def test_fuzz_iter_frames(bufs, extra):
    EXAMPLES["iter_frames: sequences of hostile frames"] += 1
    data = b"".join(bufs)
    size = max(0, len(data) - extra) if extra % 2 else len(data) + extra
    try:
        for off, hd, _h in iter_frames(lambda o, n: data[o : o + n], size, "o"):
            assert 0 <= off < size and off + hd.header_len + hd.stored_len <= size
    except CkptStoreError:
        pass


@st.composite
def bytegroup_payloads(draw):
    """A bytegroup/1 or /2 payload: valid header and plane table with arbitrary fields, or bytes."""
    if draw(st.booleans()):
        return draw(st.sampled_from(["1", "2", "4", "8", "3", "", "x", "2 "])), draw(st.binary(max_size=200)), draw(st.integers(0, 1 << 40))
    w = draw(st.sampled_from([1, 2, 4, 8]))
    count = draw(st.integers(0, 64) | st.integers(0, (1 << 64) - 1))
    transform = draw(st.sampled_from([0, 1, 2, 255]))
    version = draw(st.sampled_from([1, 1, 2, 2, 3]))
    head = b"BG" + bytes([version, w, transform]) + bytes(draw(st.sampled_from([[0, 0, 0], [0, 0, 1]]))) + struct.pack("<Q", count)
    planes = b""
    table = b""
    for _k in range(w):
        codec = draw(st.sampled_from([0, 1, 1, 2, 2, 7]))
        if codec == 2:  # a Huffman-coded plane (codec/_huff.c): past its 141-byte header, or not
            body = bytes([11]) + draw(st.binary(min_size=140, max_size=300)) if draw(st.booleans()) else draw(st.binary(max_size=200))
        elif codec == 1 and draw(st.booleans()):
            import zstandard

            body = zstandard.ZstdCompressor(write_content_size=True).compress(draw(st.binary(max_size=80)))
        else:
            body = draw(st.binary(max_size=80))
        n = draw(st.just(len(body)) | st.integers(0, (1 << 64) - 1))
        table += bytes([codec]) + struct.pack("<Q", n)
        planes += body
    raw_len = draw(st.just(count * w) | st.integers(0, 1 << 20))
    return str(draw(st.sampled_from([w, w, w, 4]))), head + table + planes + draw(st.binary(max_size=3)), raw_len


@FUZZ
@given(bytegroup_payloads(), st.sampled_from(["bytegroup/1", "bytegroup/2"]))
def test_fuzz_bytegroup_decode_stage(p, name):
    EXAMPLES["decode_stage bytegroup/1"] += 1
    param, data, raw_len = p
    try:
        out = decode_stage(name, param, data, raw_len)
    except CkptStoreError:
        return
    assert len(out) == raw_len


@FUZZ
@given(st.binary(max_size=300), st.integers(0, 1 << 20) | st.integers(0, 1 << 62), st.booleans())
def test_fuzz_zstd_decode_stage(data, raw_len, framed):
    EXAMPLES["decode_stage zstd/1"] += 1
    if framed:
        import zstandard

        data = zstandard.ZstdCompressor(write_content_size=bool(raw_len % 2)).compress(data)
    try:
        out = decode_stage("zstd/1", "", data, raw_len)
    except CkptStoreError:
        return
    assert len(out) == raw_len
