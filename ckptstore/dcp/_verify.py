"""Verification on the read path (docs/FORMAT.md, "Commit, read and deletion ordering"): a version
opened for reading (:class:`OpenVersion`) — its manifest's key and HMAC checked before anything else
is read — decodes every frame it returns through the codec of the attempt that wrote it (each frame's
checksum and, with a key, its AEAD tag), checks whole objects against their manifest entry and the
DCP metadata's item locations against the manifest, before any of them is used.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .._names import check_object_name
from ..codec import FrameCodec, FrameRef
from ..codec.crypto import FrameCipher, WrappedKey
from ..codec.frame import FrameWalk
from ..errors import CkptStoreError, IntegrityError, KeyMismatchError
from ..manifest import layout
from ..manifest.schema import ObjectEntry
from ._stage import OwnLock
from ._types import ItemLocation


class OpenVersion(OwnLock):
    """The version of a parsed manifest (``parsed``), verified with ``keys`` (``_keys.DataKeys``):
    :class:`KeyMismatchError` when it is encrypted and no key is given, or it is not encrypted but a
    key is (unless ``allow_unencrypted``); :class:`IntegrityError` when its HMAC does not verify.

    ``objects``: every object the version's items may name — its own and the objects of earlier
    versions it references (docs/FORMAT.md, "References") — by name."""

    def __init__(self, parsed, keys, allow_unencrypted: bool) -> None:
        super().__init__()
        m = parsed.manifest
        version = m.version
        cipher = None
        if m.encrypted:
            w = WrappedKey.of_encryption(m.encryption)
            if keys.master is None:
                if w.kms_key_arn is not None:
                    raise KeyMismatchError(f"version {version!r} is encrypted with the AWS KMS key {w.kms_key_arn} but no key "
                                           f"was given; pass key=ckptstore.KmsKey({w.kms_key_arn!r}) or set CKPTSTORE_KMS_KEY_ID")
                raise KeyMismatchError(
                    f"version {version!r} is encrypted (key id {m.encryption['key_id']}) but no key was given; "
                    "pass key=, or set CKPTSTORE_KEY or CKPTSTORE_KEY_FILE"
                )
            data_key = keys.unwrap(w, version, m.attempt)
            parsed.verify_mac(data_key)
            cipher = FrameCipher(data_key)
        elif keys.master is not None and not allow_unencrypted:
            raise KeyMismatchError(
                f"version {version!r} is not encrypted, but a key was given; a store that should be encrypted "
                "may have been tampered with. Pass allow_unencrypted=True (or drop the key) to load it"
            )
        self.manifest = m
        self.version = version
        self.keys = keys
        self.codec = FrameCodec(version, m.attempt, cipher)
        self.objects: dict[str, ObjectEntry] = {o.name: o for o in m.all_objects()}
        # objects of earlier versions whose frames items reference (docs/FORMAT.md, "References")
        self.refs = m.ref_by_name()
        self.objects.update({r.name: r.entry for r in m.refs})
        self._codecs = {m.attempt: self.codec}

    def key(self, obj: str) -> str:
        """The key of object ``obj``: in this version's directory, or in its origin version's for a
        referenced object."""
        ref = self.refs.get(obj)
        return layout.object_key(self.version if ref is None else ref.version, obj)

    def codec_of(self, obj: str) -> FrameCodec:
        """The frame codec of ``obj``'s attempt: a referenced object's frames are bound to (and, with a
        key, encrypted under the data key of) the version and attempt that wrote them."""
        ref = self.refs.get(obj)
        if ref is None:
            return self.codec
        with self._lock:
            codec = self._codecs.get(ref.attempt)
            if codec is None:
                if self.manifest.encrypted != (ref.wrapped_key is not None):
                    raise IntegrityError(f"version {self.version!r} references {obj!r} of {ref.version!r} with "
                                         "another encryption than its own", object=obj, version=self.version)
                cipher = None
                if ref.wrapped_key is not None:
                    cipher = self.keys.cipher(WrappedKey.of(ref), ref.version, ref.attempt)
                codec = self._codecs[ref.attempt] = FrameCodec(ref.version, ref.attempt, cipher)
            return codec

    def decode_whole(self, entry: ObjectEntry, data: bytes) -> bytes:
        """The decoded contents of the whole object ``entry`` from its stored bytes ``data``: every
        frame, the frame count, the header digest and both sizes checked."""
        if len(data) != entry.size:
            raise IntegrityError(f"{entry.name}: size {len(data)} != {entry.size} in the manifest", object=entry.name)
        mv = memoryview(data)
        walk = FrameWalk(lambda off, n: mv[off : off + n], len(data), entry.name)
        out = [self.codec.decode(entry.name, mv[off : off + length], None) for off, _hd, length in walk]
        if walk.mismatch(entry.frames, entry.digest) is not None:
            raise IntegrityError(f"{entry.name}: frames do not match the manifest (count or header digest)", object=entry.name)
        blob = b"".join(out)
        if len(blob) != entry.nbytes:
            raise IntegrityError(f"{entry.name}: decoded size mismatch", object=entry.name)
        return blob

    def check_storage_data(self, md: Metadata) -> None:
        """Every item location of the DCP metadata ``md`` is well formed and inside an object the
        manifest lists (:class:`IntegrityError` otherwise)."""
        sd = md.storage_data
        if not isinstance(sd, dict):
            raise IntegrityError("DCP metadata has no ckptstore storage_data")
        for idx, loc in sd.items():
            if not isinstance(loc, ItemLocation):
                raise IntegrityError(f"storage_data[{idx}] is not an ItemLocation")
            fqn = getattr(idx, "fqn", idx)
            try:
                check_object_name(loc.object)
            except CkptStoreError as e:
                raise IntegrityError(f"item {fqn!r}: {e}") from None
            if not isinstance(loc.frames, tuple) or not isinstance(loc.nbytes, int) or loc.nbytes < 0:
                raise IntegrityError(f"item {fqn!r} has a malformed frame list")
            if loc.dtype is not None:
                if not isinstance(loc.dtype, str) or not isinstance(getattr(torch, loc.dtype, None), torch.dtype):
                    raise IntegrityError(f"item {fqn!r} has unknown dtype {loc.dtype!r}")
                shape = loc.shape
                if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
                    raise IntegrityError(f"item {fqn!r} has a malformed shape {shape!r}")
                numel = 1
                for n in shape:
                    numel *= n
                if numel * getattr(torch, loc.dtype).itemsize != loc.nbytes:
                    raise IntegrityError(f"item {fqn!r}: shape {shape} of {loc.dtype} does not hold {loc.nbytes} bytes")
            elif loc.shape is not None:
                raise IntegrityError(f"item {fqn!r}: a bytes item has a shape")
            ent = self.objects.get(loc.object)
            if ent is None:
                raise IntegrityError(f"item {idx.fqn!r} names object {loc.object!r}, which the manifest does not list")
            total = 0
            for f in loc.frames:
                if not isinstance(f, FrameRef) or f.offset < 0 or f.length <= 0 or f.offset + f.length > ent.size:
                    raise IntegrityError(f"item {idx.fqn!r} has a frame outside {loc.object!r}", object=loc.object)
                total += f.raw_len
            if total != loc.nbytes:
                raise IntegrityError(f"item {idx.fqn!r}: frames hold {total} bytes, index says {loc.nbytes}")


__all__ = ["OpenVersion"]
