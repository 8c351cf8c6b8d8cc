"""The catalogue chain: a keyed store's commits form an authenticated chain, so that a missing
newest version or an older manifest put back in place of a newer one is detected
(docs/FORMAT.md, "Catalogue chain").

* Each commit of an encrypted version carries, inside its manifest body (sealed by the version's
  HMAC), ``chain = {"n": counter, "prev": {"version", "attempt", "n"} | None}``: a commit counter one
  above the root's catalogue head, and the commit it extends (the head's).
* Each tier keeps a **catalogue head** ``catalogue-head.json`` at its top: the newest commit
  (``version``, ``attempt``, ``n``), the ``counter``, the newest version's wrapped data key
  (``encryption``) and an HMAC under that data key (:func:`head_bytes`): only a holder of the master
  key can write one. The coordinator writes its root's head after each local commit; the uploader
  copies it to the remote tier after the remote commit, and keeps a copy of the remote head in the
  local root (``catalogue-head.remote.json``), so a remote head rolled back or deleted is seen against
  the local disk. ``drop`` (with the key) moves a head off a dropped version (:func:`after_drop`).
* :func:`findings` (pure) compares a tier's manifests with its verified heads: the head's version
  gone (``missing-newest``), the name holding an older attempt than the head or than a later commit's
  ``prev`` (``rolled-back``), a dropped version back (``rolled-back``); an unverifiable head is a
  finding too (``unverified-head``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging

from ..errors import CkptStoreError, ManifestError, ObjectNotFoundError
from . import layout

log = logging.getLogger("ckptstore")

HEAD_FORMAT = "ckptstore-head/1"
MISSING_NEWEST = "missing-newest"
ROLLED_BACK = "rolled-back"
UNVERIFIED_HEAD = "unverified-head"


@dataclasses.dataclass(frozen=True)
class Head:
    """A catalogue head as stored (not yet verified: :func:`verify`)."""

    counter: int
    version: str
    attempt: str
    n: int
    dropped: bool
    encryption: dict
    mac: str
    body: bytes

    def link(self) -> dict:
        return {"version": self.version, "attempt": self.attempt, "n": self.n}


@dataclasses.dataclass(frozen=True)
class Finding:
    """What the chain shows in one tier: ``kind`` (``missing-newest``, ``rolled-back``,
    ``unverified-head``), the ``version`` and ``attempt`` concerned, a sentence ``message``."""

    kind: str
    tier: str
    version: str | None
    attempt: str | None
    message: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _mac(data_key: bytes, body: bytes) -> str:
    k = hmac.new(data_key, b"ckptstore catalogue head v1", hashlib.sha256).digest()
    return hmac.new(k, body, hashlib.sha256).hexdigest()


def head_bytes(version: str, attempt: str, n: int, encryption: dict, data_key: bytes, *, counter: int,
               dropped: bool = False) -> bytes:
    """A head naming commit ``n`` (``version``, ``attempt``, whose data key is ``data_key`` and
    wrapped key ``encryption``)."""
    body = _canonical({"format": HEAD_FORMAT, "counter": int(counter), "version": version, "attempt": attempt,
                       "n": int(n), "dropped": bool(dropped), "encryption": encryption})
    return json.dumps({"body": body.decode(), "hmac_sha256": _mac(data_key, body)}, sort_keys=True).encode()


def parse_head(data: bytes) -> Head:
    """The head in ``data`` (structure only; :class:`ManifestError` when it is not one)."""
    try:
        outer = json.loads(data)
        body = outer["body"].encode()
        d = json.loads(body)
        if d["format"] != HEAD_FORMAT:
            raise ValueError("format")
        h = Head(int(d["counter"]), str(d["version"]), str(d["attempt"]), int(d["n"]), bool(d["dropped"]),
                 dict(d["encryption"]), str(outer["hmac_sha256"]), body)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ManifestError(f"not a catalogue head ({type(e).__name__}: {e})") from None
    return h


def head_key(h: Head, master) -> bytes:
    """The data key that authenticates ``h`` (the named commit's, unwrapped by ``master``)."""
    from ..codec.crypto import WrappedKey

    return master.unwrap(WrappedKey.of_encryption(h.encryption), h.version, h.attempt)


def verify(h: Head, master) -> bytes:
    """Check ``h``'s HMAC under ``master``; returns its data key. Raises :class:`ManifestError` (a
    head that does not authenticate), or the master key's errors (another key, KMS unavailable)."""
    dk = head_key(h, master)
    if not hmac.compare_digest(h.mac, _mac(dk, h.body)):
        raise ManifestError(f"the catalogue head naming {h.version!r} does not authenticate")
    return dk


def read(tier, key: str = layout.CATALOGUE_HEAD) -> bytes | None:
    try:
        return tier.get(key)
    except ObjectNotFoundError:
        return None


def counter_of(tier) -> tuple[int, dict | None]:
    """``(counter, link of the newest commit)`` of ``tier``'s head for the next commit's ``chain``
    (unverified: a head that does not parse counts as none). ``(0, None)`` without a head."""
    raw = read(tier)
    if raw is None:
        return 0, None
    try:
        h = parse_head(raw)
    except ManifestError:
        return 0, None
    return h.counter, h.link()


def findings(manifests: dict, heads: list, tier: str) -> list[Finding]:
    """What ``manifests`` (``{version: Manifest}``, the tier's committed copies) and the verified
    ``heads`` (:class:`Head`) of ``tier`` show (module docstring). Pure."""
    out: dict[tuple, Finding] = {}

    def add(kind, v, a, msg):
        out.setdefault((kind, v, a), Finding(kind, tier, v, a, msg))

    def n_of(m):
        return (m.chain or {}).get("n") if m is not None else None

    top = max((n_of(m) or 0 for m in manifests.values()), default=0)
    newest_left = max(((n_of(m) or 0, v) for v, m in manifests.items()), default=(0, None))[1]
    if heads:
        h = max(heads, key=lambda x: (x.counter, x.n))
        present = manifests.get(h.version)
        pn = n_of(present)
        if h.dropped:
            if present is not None and present.attempt == h.attempt:
                add(ROLLED_BACK, h.version, h.attempt,
                    f"version {h.version!r} (attempt {h.attempt}, commit {h.n}) was dropped, yet the {tier} tier holds "
                    "its manifest again: a manifest was put back by someone without the key")
        elif present is None or present.attempt != h.attempt:
            if (pn is not None and pn > h.n) or top > h.n:
                pass  # a newer commit than the head (its head update was cut short)
            elif present is None:
                add(MISSING_NEWEST, h.version, h.attempt,
                    f"the newest commit of this store (commit {h.n}: version {h.version!r}, attempt {h.attempt}) is gone "
                    f"from the {tier} tier; the newest left is {newest_left!r}. It was deleted by someone or something "
                    "without the key (gc and drop extend the chain instead): restore it from another tier or backup, or "
                    "accept the loss with 'ckptstore drop' and the key")
            else:
                add(ROLLED_BACK, h.version, present.attempt,
                    f"version {h.version!r} in the {tier} tier is attempt {present.attempt} (commit {pn or 'unchained'}), "
                    f"older than the newest commit {h.n} (attempt {h.attempt}) of the chain: an older manifest was put back")
    for v, m in manifests.items():
        prev = (m.chain or {}).get("prev")
        if not prev:
            continue
        p = manifests.get(prev["version"])
        if p is None or p.attempt == prev["attempt"]:
            continue
        pn = n_of(p)
        if pn is None or pn < prev["n"]:
            add(ROLLED_BACK, prev["version"], p.attempt,
                f"version {prev['version']!r} in the {tier} tier is attempt {p.attempt} (commit {pn or 'unchained'}), but "
                f"commit {m.chain['n']} ({v!r}) extends its later commit {prev['n']} (attempt {prev['attempt']}): an older "
                "manifest was put back")
    return list(out.values())


def check_tier(tier, master, name: str, manifests: dict | None = None, extra: tuple = ()) -> list[Finding]:
    """:func:`findings` of ``tier`` (``manifests``: its ``{version: Manifest}``, read when None),
    against its head and the ``extra`` head files (bytes) kept elsewhere for it, each verified with
    ``master``. Nothing without a key or without any head (an older store, a root that never
    coordinated a keyed commit)."""
    if master is None:
        return []
    raws = [r for r in (read(tier), *extra) if r is not None]
    if not raws:
        return []
    heads, out = [], []
    for raw in raws:
        try:
            h = parse_head(raw)
            verify(h, master)
            heads.append(h)
        except CkptStoreError as e:
            out.append(Finding(UNVERIFIED_HEAD, name, None, None, f"a catalogue head of the {name} tier does not verify "
                               f"with this key ({e}): written by someone without the key, or the store was rekeyed"))
    if manifests is None:
        from . import catalogue

        manifests = {v: e.manifest for v, e in catalogue.scan(tier).items()}
    return out + findings(manifests, heads, name)


def check_store(tiers: dict, master) -> list[Finding]:
    """The findings of every tier of a store (``{"local": tier, "remote": tier}``); the remote tier
    is also checked against the local root's copy of its head."""
    out = []
    local, remote = tiers.get("local"), tiers.get("remote")
    if local is not None:
        out += check_tier(local, master, "local")
    if remote is not None:
        extra = (read(local, layout.REMOTE_HEAD_COPY),) if local is not None else ()
        out += check_tier(remote, master, "remote", extra=extra)
    return out


def publish_remote(local, remote, version: str, attempt: str, n: int) -> None:
    """After the remote commit of ``version``/``attempt`` (commit ``n``): copy the local head to the
    remote tier when it names that commit, unless the remote head is further on, and keep the copy
    in the local root too (module docstring). Best effort: a failure is logged."""
    try:
        raw = read(local)
        if raw is None:
            return
        h = parse_head(raw)
        if (h.version, h.attempt, h.n) != (version, attempt, n):
            return
        there = read(remote)
        if there is not None:
            try:
                if parse_head(there).counter > h.counter:
                    return
            except ManifestError:
                pass
        remote.put(layout.CATALOGUE_HEAD, raw)
        local.put(layout.REMOTE_HEAD_COPY, raw)
    except CkptStoreError as e:
        log.warning("ckptstore: could not update the remote catalogue head after %r: %s", version, e)


def rewrap(tier, old, rewrapper) -> None:
    """``rekey``: re-wrap the data key in ``tier``'s heads (its own and, in a local root, its copy of the
    remote head) from master key ``old`` with ``rewrapper`` (``rekey.Rewrapper``); the data key and so
    the HMAC stay. A head that does not verify under ``old`` is left as it is (and reported by list)."""
    for key in (layout.CATALOGUE_HEAD, layout.REMOTE_HEAD_COPY):
        raw = read(tier, key)
        if raw is None:
            continue
        try:
            h = parse_head(raw)
            dk = verify(h, old)
            w = rewrapper.wrap(dk, h.version, h.attempt)
            tier.put(key, head_bytes(h.version, h.attempt, h.n, w.encryption(), dk, counter=h.counter, dropped=h.dropped))
        except CkptStoreError as e:
            log.warning("ckptstore: rekey left the catalogue head %s of %s as it is: %s", key, tier.url, e)


def after_drop(tiers: dict, dropped: str, master) -> list[str]:
    """``drop`` removed ``dropped``: each tier (and the local copy of the remote head) whose head
    names it is moved to the newest commit left there, or marked ``dropped`` when none is (the
    deletion is then not reported). Needs the master key; without it the heads stay and say what
    is missing. Returns warnings."""
    from . import catalogue

    warn = []
    for name, tier in tiers.items():
        keys = [(tier, layout.CATALOGUE_HEAD)]
        if name == "local" and tiers.get("remote") is not None:
            keys.append((tier, layout.REMOTE_HEAD_COPY))
        for t, key in keys:
            raw = read(t, key)
            if raw is None:
                continue
            try:
                h = parse_head(raw)
            except ManifestError:
                continue
            if h.version != dropped or h.dropped:
                continue
            if master is None:
                warn.append(f"the catalogue head of the {name} tier names the dropped version {dropped!r}; without the "
                            "key it cannot be moved, so list, scrub and restores report the version as missing. Run drop "
                            "with the key (CKPTSTORE_KEY, CKPTSTORE_KEY_FILE or CKPTSTORE_KMS_KEY_ID) to accept it")
                continue
            source = tiers.get("remote") if key == layout.REMOTE_HEAD_COPY else tier
            left = {v: e.manifest for v, e in catalogue.scan(source).items() if e.manifest.chain and e.manifest.encryption}
            try:
                if left:
                    v = max(left, key=lambda x: left[x].chain["n"])
                    m = left[v]
                    from ..codec.crypto import WrappedKey

                    dk = master.unwrap(WrappedKey.of_encryption(m.encryption), m.version, m.attempt)
                    new = head_bytes(m.version, m.attempt, m.chain["n"], m.encryption, dk, counter=h.counter)
                else:
                    new = head_bytes(h.version, h.attempt, h.n, h.encryption, verify(h, master), counter=h.counter,
                                     dropped=True)
                t.put(key, new)
            except CkptStoreError as e:
                warn.append(f"could not move the catalogue head of the {name} tier off {dropped!r}: {e}")
    return warn


__all__ = ["Finding", "Head", "MISSING_NEWEST", "ROLLED_BACK", "UNVERIFIED_HEAD", "after_drop", "check_store",
           "check_tier", "counter_of", "findings", "head_bytes", "parse_head", "publish_remote", "rewrap", "verify"]
