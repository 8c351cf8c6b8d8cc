"""Frame format, codec stages (byte-group, zstd, AES-GCM) and checksums.

Only this package imports zstandard, xxhash and cryptography.
"""

from . import stages  # noqa: F401  (registers zstd/1)
from .crypto import FrameCipher, key_id, new_data_key, resolve_key, unwrap_key, wrap_key  # noqa: F401
from .frame import FrameCodec, FrameRef, iter_frames, xxh3, xxh128  # noqa: F401

# The byte-grouping float codec (numpy) registers itself on first use (``stages.decoder``,
# ``stages.has_bytegroup``), so that the command line and the catalogue start without numpy.
