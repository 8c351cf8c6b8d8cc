"""Manifest schema, two-phase commit and the catalogue of committed versions.

:func:`read` reads and checks one manifest file (docs/FORMAT.md, "Manifest") and returns its body.
"""

from .schema import FORMAT, Manifest, ObjectEntry, ParsedManifest, parse, read  # noqa: F401
