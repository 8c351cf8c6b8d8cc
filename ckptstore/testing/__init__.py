"""Test helpers shipped with ckptstore: multi-process runner, tier conformance, SeaweedFS server."""
