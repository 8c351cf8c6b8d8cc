"""The DCP contract: StorageWriter and StorageReader."""

from .reader import StorageReader  # noqa: F401
from .writer import StorageWriter  # noqa: F401
