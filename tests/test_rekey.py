"""``ckptstore rekey`` — rotate the master key without re-encrypting data."""

from __future__ import annotations

import base64
import hashlib
import json
import os

import pytest
from click.testing import CliRunner

import ckptstore
from ckptstore.cli import main as cli_main
from ckptstore.codec.crypto import key_id
from ckptstore.manifest import layout
from ckptstore.manifest.schema import parse
from ckptstore.rekey import rekey

import crash_ranks

OLD = bytes(range(32))
NEW = bytes(range(50, 82))
THIRD = bytes([3]) * 32


def _key_files(tmp_path):
    old, new = tmp_path / "old.key", tmp_path / "new.key"
    old.write_bytes(OLD)  # raw
    new.write_text(base64.b64encode(NEW).decode() + "\n")  # base64
    return str(old), str(new)


def _tier_roots(root, remote):
    return crash_ranks._tier_stores(root, remote)


def _objects_digest(tier) -> dict:
    """sha256 of every stored object except manifests (data must not change)."""
    return {i.key: hashlib.sha256(tier.get(i.key)).hexdigest() for i in tier.list("versions/") if not i.key.endswith("manifest.json")}


def _reseal(body: bytes, mac: str | None) -> bytes:
    from ckptstore.codec import xxh3
    from ckptstore.manifest import schema

    checksum = getattr(schema, "seal_checksum", None)
    seal = {"xxh3": checksum(body, mac) if checksum else f"{xxh3(body):016x}"}
    if mac is not None:
        seal["hmac_sha256"] = mac
    return schema.frame(body, seal)


def _damage_wrapped_key(tier, version, resealed: bool) -> bytes:
    """Flip one character of the wrapped key; with ``resealed`` the xxh3 seal is recomputed (so
    only the wrapped key's own authentication can tell), else it is bit rot the seal catches."""
    k = layout.manifest_key(version)
    data = tier.get(k)
    from ckptstore.manifest.schema import frame, split_file

    body, seal = split_file(data)
    d = json.loads(body)
    wk = d["encryption"]["wrapped_key"]
    d["encryption"]["wrapped_key"] = wk[:10] + ("A" if wk[10] != "A" else "B") + wk[11:]
    nb = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    new = _reseal(nb, seal.get("hmac_sha256")) if resealed else frame(nb, seal)
    tier.put(k, new)
    return new


def _setup(root, remote):
    common = dict(remote=remote, durability="remote" if remote else "local")
    crash_ranks.local_save(root, "e1", 1, key=OLD, **common)
    crash_ranks.local_save(root, "plain", 2, **common)
    crash_ranks.local_save(root, "e3", 3, key=OLD, **common)
    crash_ranks.local_save(root, "dmg", 4, key=OLD, **common)
    crash_ranks.local_save(root, "rot", 5, key=OLD, **common)
    st = ckptstore.Store(root, remote=remote)
    damaged = {}
    for tname, tier in st.tiers.items():
        damaged[(tname, "dmg")] = _damage_wrapped_key(tier, "dmg", resealed=True)
        damaged[(tname, "rot")] = _damage_wrapped_key(tier, "rot", resealed=False)
    return st, damaged


def _run(root, remote, tmp_path):
    st, damaged = _setup(root, remote)
    before = {t: _objects_digest(tier) for t, tier in st.tiers.items()}
    manifests = {(t, v): parse(tier.get(layout.manifest_key(v))).manifest for t, tier in st.tiers.items() for v in ("e1", "e3", "plain")}
    order = [r.version for r in st.versions()]
    old_f, new_f = _key_files(tmp_path)
    args = ["rekey", root, "--key-file", old_f, "--new-key-file", new_f, "--json"] + (["--remote", remote] if remote else [])
    res = CliRunner().invoke(cli_main, args, catch_exceptions=False)
    rep = json.loads(res.stdout)
    assert res.exit_code == 4, res.output  # damaged versions are reported
    status = {(e["tier"], e["version"]): e["status"] for e in rep["versions"]}
    tiers = sorted(st.tiers)
    for t in tiers:
        assert status[(t, "e1")] == status[(t, "e3")] == "rekeyed"
        assert status[(t, "plain")] == "not-encrypted"
        assert status[(t, "dmg")] == "damaged-key"
        assert (t, "rot") not in status  # its manifest fails its seal: reported as invalid
        assert any(p[0] == t and "/rot/" in p[1] for p in rep["problems"])
    assert rep["old_key_id"] == key_id(OLD) and rep["new_key_id"] == key_id(NEW)
    # data untouched; manifests changed only in their key fields; damaged ones left alone
    for t, tier in st.tiers.items():
        assert _objects_digest(tier) == before[t]
        for v in ("dmg", "rot"):
            assert tier.get(layout.manifest_key(v)) == damaged[(t, v)]
        for v in ("e1", "e3", "plain"):
            m = parse(tier.get(layout.manifest_key(v))).manifest
            old = manifests[(t, v)]
            if v == "plain":
                assert m == old
                continue
            assert m.encryption["key_id"] == key_id(NEW) and m.encryption["wrapped_key"] != old.encryption["wrapped_key"]
            assert m.created == old.created and m.attempt == old.attempt and m.all_objects() == old.all_objects()
    assert [r.version for r in ckptstore.Store(root, remote=remote).versions()] == order
    # the new key loads bit-exactly from each tier; the old key is refused
    for t, (r, rem) in _tier_roots(root, remote).items():
        for v, seed in (("e1", 1), ("e3", 3)):
            assert crash_ranks.load_state(r, v, seed, remote=rem, key=NEW), (t, v)
            with pytest.raises(BaseException) as ei:
                crash_ranks.load_state(r, v, seed, remote=rem, key=OLD)
            assert [n for n, _t, _m in crash_ranks._describe(ei.value)] == ["KeyMismatchError"]
        assert crash_ranks.load_state(r, "plain", 2, remote=rem, key=NEW, allow_unencrypted=True)
        with pytest.raises(BaseException) as ei:  # the damaged one never returns garbage
            crash_ranks.load_state(r, "dmg", 4, remote=rem, key=OLD)
        assert all(typed for _n, typed, _m in crash_ranks._describe(ei.value))
    # scrub --deep with the new key: the re-keyed versions verify; the invalid manifest is damage
    from ckptstore import scrub as _scrub

    srep = _scrub.scrub(ckptstore.Store(root, remote=remote), deep=True, key=NEW)
    vstat = {(vc.tier, vc.version): vc.status for vc in srep.versions}
    for t in tiers:
        assert vstat[(t, "e1")] == vstat[(t, "e3")] == vstat[(t, "plain")] == _scrub.OK
        assert vstat[(t, "dmg")] == _scrub.UNCHECKED  # still names the old key id: not checkable with the new key
    assert {(t, v, k) for t, v, _o, k in srep.damage()} == {(t, "rot", "manifest") for t in tiers}
    # ... and with the old key, scrub --deep reports the damaged wrapped key
    srep = _scrub.scrub(ckptstore.Store(root, remote=remote), deep=True, key=OLD)
    dmg = {(t, v, k) for t, v, _o, k in srep.damage()}
    for t in tiers:
        assert (t, "dmg", "key") in dmg and (t, "rot", "manifest") in dmg
    assert {v for _t, v, _k in dmg} == {"dmg", "rot"}
    # running it again: nothing left to do (an interrupted rekey is simply run again)
    res2 = CliRunner().invoke(cli_main, args, catch_exceptions=False)
    rep2 = json.loads(res2.stdout)
    assert {e["version"]: e["status"] for e in rep2["versions"] if e["version"] in ("e1", "e3")} == {"e1": "already", "e3": "already"}
    return rep


def test_rekey_local(tmp_path):
    _run(str(tmp_path / "root"), None, tmp_path)


@pytest.mark.s3
def test_rekey_local_and_s3(tmp_path, s3_url):
    rep = _run(str(tmp_path / "root"), s3_url, tmp_path)
    assert {e["tier"] for e in rep["versions"]} == {"local", "remote"}


def test_rekey_dry_run_other_key_and_partial(tmp_path):
    root = str(tmp_path)
    crash_ranks.local_save(root, "a", 1, key=OLD)
    crash_ranks.local_save(root, "b", 2, key=OLD)
    crash_ranks.local_save(root, "c", 3, key=THIRD)
    st = ckptstore.Store(root)
    snap = {i.key: st.local.get(i.key) for i in st.local.list("versions/")}
    rep = rekey(st, OLD, NEW, dry_run=True)
    assert {e.version: e.status for e in rep.entries} == {"a": "would-rekey", "b": "would-rekey", "c": "other-key"}
    assert rep.exit_code == 5
    assert {i.key: st.local.get(i.key) for i in st.local.list("versions/")} == snap
    # one version first (as an interrupted run leaves it), then everything
    rep = rekey(st, OLD, NEW, version="a")
    assert [(e.version, e.status) for e in rep.entries] == [("a", "rekeyed")]
    rep = rekey(st, OLD, NEW)
    assert {e.version: e.status for e in rep.entries} == {"a": "already", "b": "rekeyed", "c": "other-key"}
    assert st.local.get(layout.manifest_key("c")) == snap[layout.manifest_key("c")]
    assert crash_ranks.load_state(root, "c", 3, key=THIRD)
    assert crash_ranks.load_state(root, "b", 2, key=NEW)
    # the CLI exit code for "another key"
    old_f, new_f = _key_files(tmp_path)
    res = CliRunner().invoke(cli_main, ["rekey", root, "--key-file", new_f, "--new-key-file", old_f], catch_exceptions=False)
    assert res.exit_code == 5 and "other-key" in res.output
    with pytest.raises(ckptstore.KeyMismatchError):
        rekey(st, None, NEW)


def test_rekey_never_reseals_a_tampered_manifest(tmp_path):
    """An encrypted manifest edited by someone without the key (xxh3 recomputed, HMAC now wrong)
    is reported and left as it is — rekey must not launder it with a fresh HMAC."""
    root = str(tmp_path)
    crash_ranks.local_save(root, "t", 1, key=OLD)
    st = ckptstore.Store(root)
    k = layout.manifest_key("t")
    from ckptstore.manifest.schema import split_file

    body, seal = split_file(st.local.get(k))
    d = json.loads(body)
    d["step"] = 999999
    nb = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    tampered = _reseal(nb, seal["hmac_sha256"])
    st.local.put(k, tampered)
    rep = rekey(st, OLD, NEW)
    assert [(e.version, e.status) for e in rep.entries] == [("t", "damaged-manifest")] and rep.exit_code == 4
    assert st.local.get(k) == tampered


# -- a rekey that missed one root -----------------------------------------------------------------------
@pytest.mark.parametrize("with_s3", [pytest.param(True, marks=[pytest.mark.s3, pytest.mark.slow]), False],
                         ids=["s3", "replicas"])
def test_a_rekey_that_missed_one_root_loads_from_the_copies_that_open(tmp_path, request, with_s3):
    """Node-local roots ``a`` (rank 0) and ``b`` (rank 1); ``a`` (and S3) rekeyed, ``b`` not. A load with
    the new key uses the manifest copies that open with it (``a``'s, S3's): the data keys did not
    change, so ``b``'s objects decode as before. Only when no copy opens does the load fail, naming
    the root and the command that fixes it. (The rekey of ``a``, which holds a part of the version,
    keeps its copy: another root's objects are not missing there.)"""
    from ckptstore.testing.dist import run_ranks

    import roots_ranks

    remote = request.getfixturevalue("s3_url") if with_s3 else None
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    old = {"CKPTSTORE_KEY": base64.b64encode(OLD).decode()}
    new = {"CKPTSTORE_KEY": base64.b64encode(NEW).decode()}
    fast = dict(start_method="forkserver", preload=["roots_ranks"])
    run_ranks(roots_ranks.save_keyed, 2, [a, b], "v1", remote, 0 if with_s3 else 1, env=old, **fast)
    assert rekey(ckptstore.Store(a, remote=remote), OLD, NEW).exit_code == 0  # ... and not b
    out = run_ranks(roots_ranks.load_or_error, 2, [a, b], "v1", remote, env=new, **fast)
    assert all(isinstance(o, dict) and o["ok"] for o in out), out
    # b alone (it holds its part, and with replicas a's part too): with S3 the remote copy opens; without
    # it no copy does, and the error names b and the command to run
    got = run_ranks(roots_ranks.load_or_error, 1, [b], "v1", remote, env=new, **fast)[0]
    if with_s3:
        assert isinstance(got, dict) and got["ok"], got
    else:
        assert isinstance(got, str) and "KeyMismatchError" in got and b in got and f"ckptstore rekey {b}" in got, got
    assert "v1" in ckptstore.Store(a).versions()[0].version  # the rekey of a split root kept a's copy
