"""The manifest file is what its name says: ``versions/<v>/manifest.json`` is one JSON document
(framing 2) that embeds the sealed body byte for byte; manifests of older releases (framing 1: a
magic line, the body line, the seal line) stay readable (docs/FORMAT.md, "Manifest")."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import ckptstore
from ckptstore.cli import main as cli_main
from ckptstore.errors import ManifestError, UnsupportedFormatError, typed
from ckptstore.manifest import layout, schema
from ckptstore.manifest.schema import canonical, frame, parse, seal, seal_framing1, split_file

KEY = bytes(range(32))


def _save(root, version="v1", key=None, user=None):
    dcp.save({"w": torch.arange(6.0), "meta": {"epoch": 3}}, checkpoint_id=version,
             storage_writer=ckptstore.StorageWriter(str(root), key=key, step=7, user_metadata=user))


def _path(root, version="v1"):
    return os.path.join(str(root), layout.manifest_key(version))


def _load(root, version="v1", key=None):
    t = {"w": torch.zeros(6), "meta": {"epoch": 0}}
    with typed():
        dcp.load(t, checkpoint_id=version, storage_reader=ckptstore.StorageReader(str(root), key=key))
    return t


@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "encrypted"])
def test_manifest_json_is_json_and_read_returns_its_body(tmp_path, key):
    _save(tmp_path, key=key)
    with open(_path(tmp_path)) as f:
        doc = json.load(f)  # was: json.decoder.JSONDecodeError (a magic line first)
    assert list(doc) == ["ckptstore_manifest", "body", "seal"] and doc["ckptstore_manifest"] == 2
    assert doc["body"]["version"] == "v1" and doc["body"]["step"] == 7
    assert set(doc["seal"]) == ({"xxh3", "hmac_sha256"} if key else {"xxh3"})
    body = ckptstore.manifest.read(_path(tmp_path))
    assert body == doc["body"] and body["format"] == "ckptstore/1"
    # the seal is over the body's exact bytes, recoverable by position
    raw, s = split_file(open(_path(tmp_path), "rb").read())
    assert json.loads(raw) == body and canonical(body) == raw and s == doc["seal"]


def test_a_body_that_contains_the_seal_key_still_splits_at_the_real_seal(tmp_path):
    _save(tmp_path, user={"note": ',"seal":{"xxh3":"0"}}', "x": "}\n"})
    body = ckptstore.manifest.read(_path(tmp_path))
    assert body["user"]["note"] == ',"seal":{"xxh3":"0"}}'
    assert _load(tmp_path)["meta"] == {"epoch": 3}


@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "encrypted"])
def test_an_old_framing_1_store_still_lists_loads_and_scrubs(tmp_path, key):
    """A store whose manifests an older release wrote (framing 1) reads as before."""
    _save(tmp_path, "v1", key=key)
    _save(tmp_path, "v2", key=key)
    for v in ("v1", "v2"):
        data = open(_path(tmp_path, v), "rb").read()
        raw, s = split_file(data)
        old = frame(raw, s, 1)
        assert old.startswith(b"CKPTSTORE-MANIFEST 1\n") and schema.framing(old) == 1
        with open(_path(tmp_path, v), "wb") as f:
            f.write(old)
    assert [r.version for r in ckptstore.Store(str(tmp_path), key=key).versions()] == ["v1", "v2"]
    assert torch.equal(_load(tmp_path, "v1", key=key)["w"], torch.arange(6.0))
    assert ckptstore.manifest.read(_path(tmp_path, "v2"))["version"] == "v2"
    r = CliRunner().invoke(cli_main, ["scrub", str(tmp_path)])
    assert r.exit_code == 0, r.output
    if key is not None:  # rekey rewrites a framing-1 manifest in framing 2; it still loads
        from ckptstore.rekey import rekey

        new = bytes(reversed(KEY))
        rep = rekey(ckptstore.Store(str(tmp_path)), KEY, new)
        assert rep.exit_code == 0
        assert schema.framing(open(_path(tmp_path, "v1"), "rb").read()) == 2
        assert torch.equal(_load(tmp_path, "v1", key=new)["w"], torch.arange(6.0))


def test_both_framings_parse_to_the_same_manifest():
    body = canonical({"x": 1})
    for data in (seal(body, None), seal_framing1(body, None), seal(body, KEY), seal_framing1(body, KEY)):
        assert split_file(data)[0] == body


@pytest.mark.parametrize("edit, err", [
    (lambda d: d.replace(b'"step":7', b'"step":8'), ManifestError),                  # an edited body
    (lambda d: d[:-5], ManifestError),                                                 # truncated
    (lambda d: d[:-1], ManifestError),                                                 # its last byte cut
    (lambda d: d.replace(b'{"ckptstore_manifest":2,', b'{"ckptstore_manifest": 2,'), ManifestError),  # reformatted
    (lambda d: json.dumps(json.loads(d), indent=2).encode(), ManifestError),          # pretty-printed: not the sealed bytes
    (lambda d: d.replace(b'{"ckptstore_manifest":2,', b'{"ckptstore_manifest":3,'), UnsupportedFormatError),
    (lambda d: d.replace(b',"seal":', b',"seel":'), ManifestError),
    (lambda d: d[:-2] + b"]\n", ManifestError),
    (lambda d: b"[" + d, ManifestError),
])
def test_damage_or_edits_to_a_framing_2_file_are_refused(tmp_path, edit, err):
    _save(tmp_path)
    data = open(_path(tmp_path), "rb").read()
    bad = edit(data)
    assert bad != data
    with pytest.raises(err):
        parse(bad)
    with open(_path(tmp_path), "wb") as f:
        f.write(bad)
    with pytest.raises(err):
        ckptstore.manifest.read(_path(tmp_path))


def test_show_manifest_prints_the_checked_body(tmp_path):
    _save(tmp_path)
    r = CliRunner().invoke(cli_main, ["show", str(tmp_path), "v1", "--manifest"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == ckptstore.manifest.read(_path(tmp_path))
    r = CliRunner().invoke(cli_main, ["show", str(tmp_path), "v1", "--manifest", "--json"])
    assert r.exit_code == 0 and len(r.output.strip().splitlines()) == 1
    assert json.loads(r.output)["attempt"] == json.load(open(_path(tmp_path)))["body"]["attempt"]
