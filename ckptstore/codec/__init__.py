"""Frame format, codec stages (byte-group, zstd, AES-GCM) and checksums.

Only this package imports zstandard, xxhash and cryptography.
"""

from . import stages  # noqa: F401  (registers zstd/1)
from .crypto import FrameCipher, key_id, new_data_key, resolve_key, unwrap_key, wrap_key  # noqa: F401
from .frame import FrameCodec, FrameRef, iter_frames, xxh3, xxh128  # noqa: F401

try:  # the byte-grouping float codec registers itself when present
    from . import bytegroup  # noqa: F401
except ImportError:  # pragma: no cover
    pass
