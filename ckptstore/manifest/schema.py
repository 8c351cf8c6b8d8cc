"""The manifest: the one commit point of a version (docs/FORMAT.md, "Manifest"; Save rule 4, Read rule 1).

File format (``versions/<encoded version>/manifest.json``): one JSON document (framing 2, written
by this release)::

    {"ckptstore_manifest":2,"body":{"format":"ckptstore/1",...},"seal":{"hmac_sha256":"<64 hex>","xxh3":"<16 hex>"}}

``body`` is the canonical JSON of the manifest (sorted keys, no spaces, UTF-8) embedded byte for
byte: its exact bytes are everything between the fixed prefix ``{"ckptstore_manifest":2,"body":``
and the last ``,"seal":`` of the file, so the seal over those bytes verifies while ``json.load`` of
the file works. Framing 1 (older releases; still read, never written): three lines::

    CKPTSTORE-MANIFEST 1
    {"format": "ckptstore/1", "version": ..., ...}        <- the body, canonical JSON, UTF-8
    {"xxh3": "<16 hex>", "hmac_sha256": "<64 hex>"}        <- the seal over the body's exact bytes

``xxh3`` is always present: XXH3-64 of the body bytes followed by ``"\n"`` and the
``hmac_sha256`` value (empty when absent), so accidental damage anywhere in the file — the HMAC
included — is detected without a key.
``hmac_sha256`` is present when the version is encrypted: HMAC-SHA256 under a key derived from the
version's data key, which only a holder of the master key can unwrap; so an encrypted manifest
cannot be forged or edited without the master key.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hmac
import json
import re
from typing import Any

from .._names import check_attempt, check_object_name, check_version
from ..codec import xxh3
from ..codec.crypto import ALG, ALG_KMS, kms_key_id, manifest_mac
from ..errors import ManifestError, UnsupportedFormatError

FORMAT = "ckptstore/1"
#: a manifest with references to objects of earlier versions (docs/FORMAT.md, "References")
FORMAT_REFS = "ckptstore/2"
FORMATS = (FORMAT, FORMAT_REFS)
MAGIC = b"CKPTSTORE-MANIFEST 1"  # framing 1 (three lines; read, never written)
#: the framing this release writes (docs/FORMAT.md, "Manifest": one JSON document)
FRAMING = 2
_HEAD = b'{"ckptstore_manifest":2,"body":'
_HEAD_KEY = b'{"ckptstore_manifest":'
_SEAL_KEY = b',"seal":'
MAX_MANIFEST_BYTES = 512 << 20
MAX_OBJECTS = 10_000_000


@dataclasses.dataclass(frozen=True)
class ObjectEntry:
    """One stored object of a version.

    ``name`` relative to the version directory (``attempts/<attempt>/<file>``); ``size`` bytes;
    ``digest`` XXH3-64 (hex) of the concatenation of the object's frame headers — each header
    carries its payload's checksum, so this seals every byte; ``frames`` count; ``rank`` that wrote
    it (None for the DCP metadata object); ``nbytes`` logical (decoded) bytes.
    """

    name: str
    size: int
    digest: str
    frames: int
    rank: int | None
    nbytes: int

    def to_json(self) -> dict:
        # the fields by hand (dataclasses.asdict deep-copies: 30x slower, a manifest has one per rank)
        return {"name": self.name, "size": self.size, "digest": self.digest, "frames": self.frames, "rank": self.rank,
                "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: Any) -> "ObjectEntry":
        if not isinstance(d, dict):
            raise ManifestError("manifest object entry is not an object")
        try:
            e = cls(
                name=check_object_name(d["name"]),
                size=_int(d["size"], "size"),
                digest=_hex(d["digest"], 16, "digest"),
                frames=_int(d["frames"], "frames"),
                rank=None if d.get("rank") is None else _int(d["rank"], "rank"),
                nbytes=_int(d["nbytes"], "nbytes"),
            )
        except KeyError as k:
            raise ManifestError(f"manifest object entry lacks field {k}") from None
        except ManifestError:
            raise
        except Exception as ex:  # InvalidNameError etc.
            raise ManifestError(f"manifest object entry is invalid: {ex}") from None
        return e


@dataclasses.dataclass(frozen=True)
class RefEntry:
    """An object of an earlier committed version of the store whose frames this version's items
    reference (docs/FORMAT.md, "References"): the origin ``version`` and ``attempt`` (its frames stay
    bound to them), the object as the origin's manifest records it, and with encryption the origin's
    ``wrapped_key`` and ``key_id`` (what decrypts those frames) — and ``kms_key_arn`` (JSON
    ``"kms": {"key_arn": ...}``) when AWS KMS wrapped that data key."""

    version: str
    attempt: str
    name: str
    size: int
    digest: str
    frames: int
    rank: int | None
    nbytes: int
    wrapped_key: str | None = None
    key_id: str | None = None
    kms_key_arn: str | None = None

    @property
    def entry(self) -> ObjectEntry:
        return ObjectEntry(self.name, self.size, self.digest, self.frames, self.rank, self.nbytes)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        arn = d.pop("kms_key_arn")
        out = {k: v for k, v in d.items() if v is not None or k == "rank"}
        if arn is not None:
            out["kms"] = {"key_arn": arn}
        return out

    @classmethod
    def from_json(cls, d: Any) -> "RefEntry":
        if not isinstance(d, dict):
            raise ManifestError("manifest reference is not an object")
        try:
            e = ObjectEntry.from_json(d)
            kms = _kms(d.get("kms"), "refs")
            ref = cls(check_version(d["version"]), check_attempt(d["attempt"]), e.name, e.size, e.digest, e.frames,
                      e.rank, e.nbytes, d.get("wrapped_key"), d.get("key_id"), kms)
        except KeyError as k:
            raise ManifestError(f"manifest reference lacks field {k}") from None
        except ManifestError:
            raise
        except Exception as ex:  # noqa: BLE001 - InvalidNameError and friends
            raise ManifestError(f"manifest reference is invalid: {ex}") from None
        if ref.name.split("/")[1] != ref.attempt:
            raise ManifestError(f"manifest reference {ref.name!r} is outside its attempt {ref.attempt!r}")
        limit = 200 if ref.kms_key_arn is None else MAX_KMS_BLOB
        if ref.wrapped_key is not None and (not isinstance(ref.wrapped_key, str) or len(ref.wrapped_key) > limit):
            raise ManifestError("manifest reference's wrapped_key must be a string")
        if ref.key_id is not None:
            _hex(ref.key_id, 16, "refs.key_id")
        if ref.kms_key_arn is not None and (ref.wrapped_key is None or ref.key_id != kms_key_id(ref.kms_key_arn)):
            raise ManifestError("manifest reference's kms.key_arn does not match its wrapped_key/key_id")
        return ref


def _int(v: Any, what: str) -> int:
    if type(v) is not int or v < 0 or v > (1 << 62):  # JSON gives exactly int (a bool is not one)
        raise ManifestError(f"manifest field {what!r} must be a non-negative integer, got {v!r}")
    return v


_HEX = {16: re.compile(r"[0-9a-f]{16}"), 32: re.compile(r"[0-9a-f]{32}"), 64: re.compile(r"[0-9a-f]{64}")}


def _hex(v: Any, n: int, what: str) -> str:
    pat = _HEX.get(n) or re.compile(f"[0-9a-f]{{{n}}}")
    if type(v) is not str or not pat.fullmatch(v):
        raise ManifestError(f"manifest field {what!r} must be {n} lowercase hex digits")
    return v


def seal_checksum(body: bytes, mac: str | None) -> str:
    """XXH3-64 (hex) over the body and the HMAC value: the key-less check of the whole file."""
    data = body + b"\n" + (mac or "").encode("ascii", "replace")
    return f"{xxh3(data):016x}"


def nonfinite_text(nf: dict | None) -> str:
    """A manifest's ``nonfinite`` in words (docs/FORMAT.md, "Manifest"):
    ``"17 NaN/Inf values in 2 items: model.w (16), b (1)"``, ``"none"``, or ``"unknown (not counted)"``."""
    if nf is None:
        return "unknown (not counted)"
    if not nf["count"]:
        return "none"
    keys = ", ".join(f"{e['key']} ({e['count']})" for e in nf["first"])
    more = " ..." if sum(e["count"] for e in nf["first"]) < nf["count"] else ""
    n, k = nf["count"], nf["items"]
    return f"{n} NaN/Inf value{'s' if n != 1 else ''} in {k} item{'s' if k != 1 else ''}: {keys}{more}"


def utcnow() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclasses.dataclass
class Manifest:
    """The body of a manifest. See docs/FORMAT.md for the schema and an example."""

    version: str
    attempt: str
    created: str  # ISO 8601 UTC, e.g. "2026-11-29T08:00:00.000000Z"
    world_size: int
    objects: list[ObjectEntry]
    metadata_object: ObjectEntry
    nbytes: int = 0
    stored_bytes: int = 0
    step: int | None = None
    user: dict = dataclasses.field(default_factory=dict)
    encryption: dict | None = None  # {"alg","key_id","wrapped_key"[,"kms": {"key_arn"}]}
    codecs: list[str] = dataclasses.field(default_factory=list)
    format: str = FORMAT
    writer: str = ""
    #: root groups: ``[[0, 1], [2, 3]]`` = ranks 0 and 1 wrote to one root (a node's disk), 2 and 3 to
    #: another (docs/FORMAT.md, "Placement"). None: one root holds every object (older manifests).
    placement: list | None = None
    #: commit sequence (docs/FORMAT.md, "Order"): a hybrid logical clock in microseconds, never lower
    #: than 1 + the highest ``seq`` of the versions the saving job's roots held. None: older manifests.
    seq: int | None = None
    #: the earlier attempts of this version name that this commit replaced, each
    #: ``{"attempt": str, "reason": str}`` (docs/FORMAT.md, "Superseding"); None: it replaced none.
    supersedes: list | None = None
    #: replication factor F (docs/FORMAT.md, "Replicas"): each root group's objects are copied to the
    #: roots of F other groups; None/0: no replicas
    replicas: int | None = None
    #: the failure domain of each root group of ``placement`` (same order; docs/FORMAT.md, "Replicas"):
    #: replicas never land in their source's domain while another exists. None: not recorded
    domains: list | None = None
    #: objects of earlier versions whose frames items of this version reference (docs/FORMAT.md,
    #: "References"); a manifest with any is format ``ckptstore/2``
    refs: list = dataclasses.field(default_factory=list)
    #: NaN/±Inf values of the version's floating tensors (docs/FORMAT.md, "Manifest"): ``{"count":
    #: values, "items": write items holding any, "first": [{"key": fqn, "count": values}, ...]}``;
    #: None: not counted (older releases, ``count_nonfinite=False``) — unknown
    nonfinite: dict | None = None
    #: the catalogue chain (docs/FORMAT.md, "Catalogue chain"; encrypted versions only): ``{"n": commit
    #: counter, "prev": None | {"version", "attempt", "n"}}`` — the previous commit of the store this
    #: commit extends. None: not chained (older releases, unencrypted stores)
    chain: dict | None = None

    @property
    def nonfinite_count(self) -> int | None:
        """NaN/±Inf values in the version's floating tensors; None: unknown (not counted)."""
        return None if self.nonfinite is None else self.nonfinite["count"]

    @property
    def encrypted(self) -> bool:
        return self.encryption is not None

    @property
    def created_dt(self) -> _dt.datetime:
        return _dt.datetime.fromisoformat(self.created.replace("Z", "+00:00"))

    def all_objects(self) -> list[ObjectEntry]:
        """The objects this version stored itself (its attempt's): metadata object and shards."""
        return [self.metadata_object, *self.objects]

    def ref_by_name(self) -> dict:
        """``{object name: RefEntry}`` of the referenced objects of earlier versions."""
        return {r.name: r for r in self.refs}

    @property
    def superseded_attempts(self) -> frozenset:
        """The attempts of this version name that this commit replaced."""
        return frozenset(d["attempt"] for d in self.supersedes or ())

    def body_json(self) -> dict:
        return {
            "format": FORMAT_REFS if self.refs else self.format,
            "version": self.version,
            "attempt": self.attempt,
            "created": self.created,
            "world_size": self.world_size,
            "step": self.step,
            "nbytes": self.nbytes,
            "stored_bytes": self.stored_bytes,
            "encryption": self.encryption,
            "codecs": sorted(self.codecs),
            "writer": self.writer,
            "user": self.user,
            "metadata_object": self.metadata_object.to_json(),
            "objects": [o.to_json() for o in self.objects],
            **({} if self.placement is None else {"placement": self.placement}),
            **({} if self.seq is None else {"seq": self.seq}),
            **({} if not self.supersedes else {"supersedes": self.supersedes}),
            **({} if not self.replicas else {"replicas": self.replicas}),
            **({} if self.domains is None else {"domains": self.domains}),
            **({} if not self.refs else {"refs": [r.to_json() for r in self.refs]}),
            **({} if self.nonfinite is None else {"nonfinite": self.nonfinite}),
            **({} if self.chain is None else {"chain": self.chain}),
        }

    def to_bytes(self, data_key: bytes | None) -> bytes:
        """Serialise and seal. ``data_key`` is required iff the version is encrypted."""
        if self.encryption is not None and data_key is None:
            raise ValueError("an encrypted manifest needs its data key to be sealed")
        return seal(canonical(self.body_json()), data_key if self.encryption is not None else None)


def canonical(body: dict) -> bytes:
    """The body line: canonical JSON (sorted keys, no spaces, UTF-8)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _seal_fields(body: bytes, data_key: bytes | None) -> dict:
    s = {}
    if data_key is not None:
        s["hmac_sha256"] = manifest_mac(data_key, body)
    s["xxh3"] = seal_checksum(body, s.get("hmac_sha256"))
    return s


def seal(body: bytes, data_key: bytes | None) -> bytes:
    """The manifest file for the body bytes ``body`` (framing 2: one JSON document embedding the
    body verbatim, then the seal): the HMAC under ``data_key`` (an encrypted version's; None: no
    HMAC) and the XXH3 over both. The one sealer: the writer (through :meth:`Manifest.to_bytes`)
    and rekey both use it."""
    return frame(body, _seal_fields(body, data_key), 2)


def seal_framing1(body: bytes, data_key: bytes | None) -> bytes:
    """The same manifest in framing 1 (magic line, body line, seal line), as releases before
    framing 2 wrote it: still read by :func:`parse`, written only by the compatibility tests."""
    return frame(body, _seal_fields(body, data_key), 1)


@dataclasses.dataclass
class ParsedManifest:
    manifest: Manifest
    body: bytes
    mac: str | None

    def verify_mac(self, data_key: bytes) -> None:
        if self.mac is None or not hmac.compare_digest(self.mac, manifest_mac(data_key, self.body)):
            raise ManifestError(
                f"manifest of version {self.manifest.version!r} fails its HMAC: it was altered or sealed with another key"
            )


def parse(data: bytes, *, expect_version: str | None = None) -> ParsedManifest:
    """Parse and check a manifest file (structure, XXH3 seal, field types, object names).

    Does not check the HMAC (that needs the data key, see :meth:`ParsedManifest.verify_mac`).
    Raises :class:`ManifestError` (an :class:`IntegrityError`) or :class:`UnsupportedFormatError`.
    """
    body, seal_line = _split_and_check_seal(data)
    m = _manifest_from_body(_load_body(body))
    for o in m.all_objects():
        if o.name.split("/")[1] != m.attempt:
            raise ManifestError(f"manifest names object {o.name!r} outside its attempt {m.attempt!r}")
    if expect_version is not None and m.version != expect_version:
        raise ManifestError(f"manifest at version {expect_version!r} describes version {m.version!r}")
    mac = seal_line.get("hmac_sha256")
    if m.encrypted and not isinstance(mac, str):
        raise ManifestError("encrypted manifest lacks its HMAC seal")
    return ParsedManifest(m, body, mac)


def _split_and_check_seal(data: bytes) -> tuple[bytes, dict]:
    """The body bytes and the seal of a manifest file (either framing) whose XXH3 seal checks."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit")
    if data.startswith(b"{"):
        body, seal_raw = _split_framing2(data)
    else:
        body, seal_raw = _split_framing1(data)
    try:
        seal_line = json.loads(seal_raw)
        if not isinstance(seal_line, dict):
            raise ValueError
    except (ValueError, RecursionError):
        raise ManifestError("manifest seal is not a JSON object") from None
    mac = seal_line.get("hmac_sha256")
    if mac is not None and not isinstance(mac, str):
        raise ManifestError("manifest seal's hmac_sha256 is not a string")
    if seal_line.get("xxh3") != seal_checksum(body, mac):
        raise ManifestError("manifest checksum mismatch: the manifest is damaged or was edited")
    return body, seal_line


def _split_framing1(data: bytes) -> tuple[bytes, bytes]:
    parts = data.split(b"\n")
    if len(parts) != 4 or parts[3] != b"" or parts[0] != MAGIC:
        if parts and parts[0].startswith(b"CKPTSTORE-MANIFEST ") and parts[0] != MAGIC:
            raise UnsupportedFormatError(f"manifest format {parts[0][19:50]!r} is newer than this ckptstore; upgrade")
        raise ManifestError("not a ckptstore manifest (bad header or line structure)")
    return parts[1], parts[2]


def _split_framing2(data: bytes) -> tuple[bytes, bytes]:
    """Framing 2 by position (docs/FORMAT.md, "Manifest"): the fixed prefix, the body's exact bytes up
    to the last ``,"seal":``, the seal object, ``}`` and one newline."""
    if not data.startswith(_HEAD):
        if data.startswith(_HEAD_KEY):
            n = data[len(_HEAD_KEY):len(_HEAD_KEY) + 12].split(b",")[0]
            if n.isdigit() and int(n) > FRAMING:
                raise UnsupportedFormatError(f"manifest framing {int(n)} is newer than this ckptstore (it reads "
                                             f"1 and {FRAMING}); upgrade")
        raise ManifestError("not a ckptstore manifest (bad header)")
    if not data.endswith(b"}\n"):  # the file ends exactly so: a truncated one never passes
        raise ManifestError("not a ckptstore manifest (truncated, or text after the seal)")
    end = data[:-1]
    i = end.rfind(_SEAL_KEY)
    if i < len(_HEAD):
        raise ManifestError("not a ckptstore manifest (no seal after the body)")
    return end[len(_HEAD):i], end[i + len(_SEAL_KEY):-1]


def split_file(data: bytes) -> tuple[bytes, dict]:
    """``(body bytes, seal)`` of a manifest file of either framing, **unchecked** (for tools and tests
    that rewrite a manifest; readers use :func:`parse`). Raises :class:`ManifestError` when the bytes
    are not framed as a manifest."""
    body, seal_raw = _split_framing2(data) if data.startswith(b"{") else _split_framing1(data)
    try:
        return body, json.loads(seal_raw)
    except ValueError:
        raise ManifestError("manifest seal is not JSON") from None


def frame(body: bytes, seal: dict, framing_: int = FRAMING) -> bytes:
    """A manifest file of ``body`` and ``seal`` (``{"xxh3", "hmac_sha256"?}``) in framing ``framing_``."""
    if framing_ == 1:
        return b"\n".join([MAGIC, body, json.dumps(seal, sort_keys=True).encode()]) + b"\n"
    return _HEAD + body + _SEAL_KEY + json.dumps(seal, sort_keys=True, separators=(",", ":")).encode() + b"}\n"


def framing(data: bytes) -> int:
    """The framing of a manifest file's bytes: 2 (one JSON document), 1 (three lines), 0 (neither)."""
    return 2 if data.startswith(_HEAD) else 1 if data.startswith(MAGIC + b"\n") else 0


def read(path) -> dict:
    """Read and check the manifest file at ``path`` (``versions/<version>/manifest.json`` of a local
    root, or its bytes): either framing, its XXH3 seal, its fields' types and object names — what
    every reader checks before it trusts a manifest (docs/FORMAT.md, Read rule 1).

    Returns the body as a dict (the fields of docs/FORMAT.md, "Manifest": ``format``, ``version``,
    ``attempt``, ``objects``, ...), parsed from its exact sealed bytes. The HMAC of an encrypted
    version is not checked here (that needs the master key: ``ckptstore scrub --deep``).
    Raises :class:`ManifestError` (damaged, edited, not a manifest) or
    :class:`UnsupportedFormatError` (written by a newer ckptstore); ``OSError`` from reading."""
    if isinstance(path, (bytes, bytearray, memoryview)):
        data = bytes(path)
    else:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    return json.loads(parse(data).body)


def _load_body(body: bytes) -> dict:
    try:
        d = json.loads(body)
    except (ValueError, RecursionError):
        raise ManifestError("manifest body is not valid JSON (or nested too deeply)") from None
    if not isinstance(d, dict):
        raise ManifestError("manifest body is not a JSON object")
    if d.get("format") not in FORMATS:
        raise UnsupportedFormatError(f"manifest format {d.get('format')!r} is not one of {FORMATS}; upgrade ckptstore")
    return d


def _manifest_from_body(d: dict) -> Manifest:
    """The :class:`Manifest` of a body object, every field checked."""
    try:
        objs = d["objects"]
        if not isinstance(objs, list) or len(objs) > MAX_OBJECTS:
            raise ManifestError("manifest 'objects' must be a list")
        enc = _encryption(d.get("encryption"))
        return Manifest(
            version=check_version(d["version"]),
            attempt=check_attempt(d["attempt"]),
            created=_created(d["created"]),
            world_size=_int(d["world_size"], "world_size"),
            objects=[ObjectEntry.from_json(o) for o in objs],
            metadata_object=ObjectEntry.from_json(d["metadata_object"]),
            nbytes=_int(d.get("nbytes", 0), "nbytes"),
            stored_bytes=_int(d.get("stored_bytes", 0), "stored_bytes"),
            step=None if d.get("step") is None else _int(d["step"], "step"),
            user=_typed(d.get("user", {}), dict, "'user' must be an object"),
            encryption=enc,
            codecs=_codecs(d.get("codecs", [])),
            writer=_typed(d.get("writer", ""), str, "'writer' must be a string"),
            placement=_placement(d.get("placement")),
            seq=None if d.get("seq") is None else _int(d["seq"], "seq"),
            supersedes=_supersedes(d.get("supersedes")),
            replicas=None if d.get("replicas") is None else _int(d["replicas"], "replicas"),
            domains=_domains(d.get("domains"), d.get("placement")),
            refs=_refs(d.get("refs"), d.get("format")),
            nonfinite=_nonfinite(d.get("nonfinite")),
            chain=_chain(d.get("chain")),
            format=d["format"],
        )
    except KeyError as k:
        raise ManifestError(f"manifest lacks field {k}") from None
    except (ManifestError, UnsupportedFormatError):
        raise
    except Exception as e:  # InvalidNameError and friends
        raise ManifestError(f"manifest is invalid: {e}") from None


def _typed(v: Any, t: type, what: str) -> Any:
    if not isinstance(v, t):
        raise ManifestError(f"manifest {what}")
    return v


def _created(v: Any) -> str:
    created = _typed(v, str, "'created' must be a string")
    try:
        _dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        raise ManifestError(f"manifest 'created' is not an ISO 8601 time: {created!r}") from None
    return created


def _placement(v: Any) -> list | None:
    if v is None:
        return None
    ok = isinstance(v, list) and len(v) <= MAX_OBJECTS and all(
        isinstance(g, list) and g and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < (1 << 31) for r in g) for g in v
    )
    if not ok:
        raise ManifestError("manifest 'placement' must be a list of non-empty lists of ranks")
    seen = [r for g in v for r in g]
    if len(seen) != len(set(seen)):
        raise ManifestError("manifest 'placement' names a rank in two root groups")
    return v


#: the longest failure domain name a manifest holds (docs/FORMAT.md, "Replicas")
MAX_DOMAIN = 256


def check_domain(v: Any) -> str:
    """A failure domain name as a manifest may hold it: a non-empty string of at most
    :data:`MAX_DOMAIN` characters without control characters; ``ValueError`` otherwise. The writer
    checks its ``replica_domain`` with this, so it never commits what a reader refuses."""
    if not isinstance(v, str) or not v or len(v) > MAX_DOMAIN or any(ord(c) < 32 or ord(c) == 127 for c in v):
        raise ValueError(f"a replica domain must be a non-empty string of at most {MAX_DOMAIN} characters without "
                         f"control characters, got {v!r}")
    return v


def _domains(v: Any, placement: Any) -> list | None:
    if v is None:
        return None
    if not isinstance(v, list) or not isinstance(placement, list) or len(v) != len(placement):
        raise ManifestError("manifest 'domains' must be a list with one failure domain per root group of 'placement'")
    try:
        return [check_domain(x) for x in v]
    except ValueError as e:
        raise ManifestError(f"manifest 'domains': {e}") from None


def _refs(v: Any, fmt: Any) -> list:
    if v is None or v == []:
        if fmt == FORMAT_REFS:
            # Format 2 is written only for a manifest with references (docs/FORMAT.md "Manifest").
            raise ManifestError(f"manifest format {fmt!r} has no 'refs' list; a format-2 manifest must reference objects")
        return []
    if fmt != FORMAT_REFS:
        raise ManifestError(f"manifest format {fmt!r} has no 'refs' (a manifest with references is {FORMAT_REFS!r})")
    if not isinstance(v, list) or len(v) > MAX_OBJECTS:
        raise ManifestError("manifest 'refs' must be a list")
    return [RefEntry.from_json(r) for r in v]


#: at most this many keys in ``nonfinite.first`` (a writer records 8)
MAX_NONFINITE_FIRST = 1000


def _nonfinite(v: Any) -> dict | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ManifestError("manifest 'nonfinite' must be an object")
    first = v.get("first", [])
    if not isinstance(first, list) or len(first) > MAX_NONFINITE_FIRST:
        raise ManifestError("manifest 'nonfinite.first' must be a list")
    for e in first:
        if not isinstance(e, dict) or not isinstance(e.get("key"), str):
            raise ManifestError("manifest 'nonfinite.first' entries must be {key, count} objects")
        _int(e.get("count"), "nonfinite.first.count")
    return {"count": _int(v.get("count"), "nonfinite.count"), "items": _int(v.get("items", 0), "nonfinite.items"),
            "first": [{"key": e["key"], "count": e["count"]} for e in first]}


def _chain_link(v: Any, what: str) -> dict:
    if not isinstance(v, dict) or set(v) != {"version", "attempt", "n"}:
        raise ManifestError(f"manifest {what} must be an object of version, attempt and n")
    return {"version": check_version(v["version"]), "attempt": check_attempt(v["attempt"]), "n": _chain_n(v["n"], what)}


def _chain_n(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ManifestError(f"manifest {what}'s n must be an integer >= 1")
    return v


def _chain(v: Any) -> dict | None:
    """``chain`` (docs/FORMAT.md, "Catalogue chain"): ``{"n": int >= 1, "prev": None | link}``."""
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) != {"n", "prev"}:
        raise ManifestError("manifest 'chain' must be an object of n and prev")
    n = _chain_n(v["n"], "'chain'")
    prev = None if v["prev"] is None else _chain_link(v["prev"], "'chain.prev'")
    if prev is not None and prev["n"] >= n:
        raise ManifestError("manifest 'chain.prev' must be an earlier commit (a lower n)")
    return {"n": n, "prev": prev}


def _supersedes(v: Any) -> list | None:
    if v is None:
        return None
    ok = isinstance(v, list) and len(v) <= 1000 and all(
        isinstance(d, dict) and isinstance(d.get("attempt"), str) and isinstance(d.get("reason", ""), str) for d in v
    )
    if not ok:
        raise ManifestError("manifest 'supersedes' must be a list of {attempt, reason} objects")
    for d in v:
        check_attempt(d["attempt"])
    return v or None


def _codecs(v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(c, str) for c in v):
        raise ManifestError("manifest 'codecs' must be a list of strings")
    return v


def _encryption(enc: Any) -> dict | None:
    if enc is None:
        return None
    if not isinstance(enc, dict) or enc.get("alg") not in (ALG, ALG_KMS):
        raise UnsupportedFormatError(f"unknown encryption {enc!r}")
    _hex(enc.get("key_id"), 16, "encryption.key_id")
    kms = enc.get("alg") == ALG_KMS
    if not isinstance(enc.get("wrapped_key"), str) or len(enc["wrapped_key"]) > (MAX_KMS_BLOB if kms else 200):
        raise ManifestError("manifest encryption.wrapped_key must be a string")
    if not kms:
        if "kms" in enc:
            raise ManifestError(f"manifest encryption {ALG!r} has a 'kms' object")
        return enc
    arn = _kms(enc.get("kms"), "encryption")
    if arn is None:
        raise ManifestError(f"manifest encryption {ALG_KMS!r} lacks its 'kms' object")
    if enc["key_id"] != kms_key_id(arn):
        raise ManifestError("manifest encryption.key_id does not match encryption.kms.key_arn")
    return enc


#: the longest base64 ``wrapped_key`` of a KMS-wrapped data key (a KMS ``CiphertextBlob`` is at most 6,144 bytes)
MAX_KMS_BLOB = 8192


def _kms(v: Any, where: str) -> str | None:
    """The ``key_arn`` of a ``kms`` object (``{"key_arn": "arn:<partition>:kms:<region>:<account>:key/<id>"}``), or None."""
    if v is None:
        return None
    arn = v.get("key_arn") if isinstance(v, dict) else None
    parts = arn.split(":") if isinstance(arn, str) else []
    if (not isinstance(v, dict) or set(v) != {"key_arn"} or not isinstance(arn, str) or len(arn) > 2048
            or len(parts) < 6 or parts[0] != "arn"
            or parts[2] != "kms" or not parts[5].startswith("key/") or len(parts[5]) < 5
            or any(c.isspace() or ord(c) < 32 for c in arn)):
        raise ManifestError(f"manifest {where}.kms must be {{\"key_arn\": <an AWS KMS key ARN>}}")
    return arn
