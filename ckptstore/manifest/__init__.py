"""Manifest schema, two-phase commit and the catalogue of committed versions."""

from .schema import FORMAT, Manifest, ObjectEntry, ParsedManifest, parse  # noqa: F401
