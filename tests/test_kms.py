"""Keys from a key service: envelope encryption through AWS KMS (``ckptstore.KmsKey``), against moto's
KMS (``ckptstore.testing.moto.MotoServer``, the same server as the moto S3 fixture).

What a user sees: a save and a load through KMS round-trip bit for bit with one KMS request per rank
and version; the manifest holds the KMS ``CiphertextBlob`` and the key's ARN, never the data key; a
wrong key id, a disabled key and an unreachable KMS give typed errors that say what to do, write
nothing and mark nothing damaged; rekey moves a store between raw keys and KMS keys; ``scrub --deep``
and every read path use the KMS key.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.api import CheckpointException

import ckptstore
from ckptstore.cli import main as cli_main
from ckptstore.codec.crypto import kms_context, kms_key_id
from ckptstore.manifest import layout
from ckptstore.testing.dist import free_port, run_ranks

pytestmark = pytest.mark.s3

FAST = {"start_method": "forkserver", "preload": ["torch", "torch.distributed.checkpoint", "ckptstore", "ckptstore.dcp",
                                                   "botocore.session", "kms_ranks"]}
RAW = bytes(range(32))
RAW2 = bytes(range(100, 132))


@pytest.fixture
def kms(moto, monkeypatch):
    """moto's KMS reached through the standard chain (``AWS_ENDPOINT_URL``, credentials, region);
    returns a botocore KMS client for making keys."""
    if not moto.running:
        moto.start()
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_KMS", "AWS_SESSION_TOKEN", "AWS_RETRY_MODE",
              "AWS_MAX_ATTEMPTS", "CKPTSTORE_KEY", "CKPTSTORE_KEY_FILE", "CKPTSTORE_KMS_KEY_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for k, v in moto.env.items():
        monkeypatch.setenv(k, v)
    c = moto.kms_client()
    yield c
    c.close()


def new_key(kms) -> tuple[str, str]:
    """A fresh symmetric KMS key: (its ARN, an alias of it)."""
    md = kms.create_key(Description="ckptstore test")["KeyMetadata"]
    alias = f"alias/ckpt-{uuid.uuid4().hex[:10]}"
    kms.create_alias(AliasName=alias, TargetKeyId=md["KeyId"])
    return md["Arn"], alias


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "step": seed, "note": f"seed {seed}"}


def empty() -> dict:
    return {"w": torch.zeros(300, 70), "b": torch.zeros(7, dtype=torch.bfloat16), "step": -1, "note": ""}


def save(root, version, key, seed=0, **kw):
    w = ckptstore.StorageWriter(str(root), key=key, **kw)  # root: the local tier
    dcp.save(state(seed), checkpoint_id=version, storage_writer=w)
    w.close()


def load(root, version, key, **kw) -> dict:
    sd = empty()
    reader = ckptstore.StorageReader(None if root is None else str(root), key=key, **kw)  # None: no local tier
    dcp.load(sd, checkpoint_id=version, storage_reader=reader)
    return sd


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("w", "b")) and (a["step"], a["note"]) == (b["step"], b["note"])


def errors(e: BaseException) -> list:
    """The ckptstore errors inside DCP's CheckpointException (or ``e`` itself)."""
    if isinstance(e, CheckpointException):
        return [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    return [e]


def failure(fn):
    """The one ckptstore error ``fn()`` fails with (through DCP's CheckpointException)."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        errs = errors(e)
        assert len({type(x) for x in errs}) == 1, errs
        return errs[0]
    raise AssertionError("did not fail")


def manifest_body(root, version) -> dict:
    with open(os.path.join(root, layout.manifest_key(version)), "rb") as f:
        return json.load(f)["body"]


def files(root) -> dict:
    out = {}
    for d, _dirs, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


def store_files(root) -> dict:
    """:func:`files` without the event log (a failed restore is a line there)."""
    return {k: v for k, v in files(root).items() if k != "events.jsonl"}


def stored_objects(root) -> set:
    return {p for p in files(root) if p.endswith(".ckd")}


def cli(*args, env=None):
    return CliRunner().invoke(cli_main, [str(a) for a in args], env=env, catch_exceptions=False)


# -- round trip, manifest, requests --------------------------------------------------------------------------


def test_save_and_load_through_kms_one_request_each_and_no_data_key_stored(kms, tmp_path, monkeypatch):
    arn, alias = new_key(kms)
    root = str(tmp_path / "s")
    wkey = ckptstore.KmsKey(alias)
    save(root, "v1", wkey, seed=1)
    assert dict(wkey.calls) == {"DescribeKey": 1, "GenerateDataKey": 1}
    enc = manifest_body(root, "v1")["encryption"]
    assert enc["alg"] == "AES-256-GCM/KMS" and enc["kms"] == {"key_arn": arn} and enc["key_id"] == kms_key_id(arn)
    # the wrapped key is KMS's CiphertextBlob, bound to the version and attempt
    attempt = manifest_body(root, "v1")["attempt"]
    data_key = kms.decrypt(CiphertextBlob=base64.b64decode(enc["wrapped_key"]),
                           EncryptionContext=kms_context("v1", attempt))["Plaintext"]
    with pytest.raises(kms.exceptions.InvalidCiphertextException):
        kms.decrypt(CiphertextBlob=base64.b64decode(enc["wrapped_key"]), EncryptionContext=kms_context("v2", attempt))
    for name, data in files(root).items():  # the data key is nowhere in the store, in any form
        assert data_key not in data and base64.b64encode(data_key) not in data and data_key.hex().encode() not in data, name

    rkey = ckptstore.KmsKey(arn)
    assert same(load(root, "v1", rkey), state(1))
    assert same(load(root, "v1", rkey), state(1))  # a second load asks KMS nothing
    assert dict(rkey.calls) == {"DescribeKey": 1, "Decrypt": 1}
    # the same key given as a string and through the environment
    assert same(load(root, "v1", f"kms://{alias}"), state(1))
    monkeypatch.setenv("CKPTSTORE_KMS_KEY_ID", arn)
    assert same(load(root, "v1", None), state(1))
    monkeypatch.setenv("CKPTSTORE_KEY", base64.b64encode(RAW).decode())  # two master keys: refused, not one chosen
    assert isinstance(failure(lambda: load(root, "v1", None)), ckptstore.KeyMismatchError)
    monkeypatch.delenv("CKPTSTORE_KEY")
    monkeypatch.delenv("CKPTSTORE_KMS_KEY_ID")
    # a KmsKey travels to DCP's checkpoint subprocess as its configuration only
    back = pickle.loads(pickle.dumps(ckptstore.StorageWriter(root, key=wkey)))
    assert back._master.key_id == alias and back._master._client_obj is None and not back._master._keys
    st = ckptstore.Store(root)
    assert [v.version for v in st.versions()] == ["v1"]
    r = cli("show", root, "v1")
    assert r.exit_code == 0 and f"data key wrapped by AWS KMS key {arn}" in r.output


def test_a_load_with_the_wrong_key_or_none_is_refused_and_names_the_key(kms, tmp_path):
    arn, alias = new_key(kms)
    other_arn, other_alias = new_key(kms)
    root = str(tmp_path / "s")
    save(root, "v1", ckptstore.KmsKey(alias))
    save(root, "raw", RAW)

    e = failure(lambda: load(root, "v1", None))
    assert isinstance(e, ckptstore.KeyMismatchError) and arn in str(e) and "CKPTSTORE_KMS_KEY_ID" in str(e)
    e = failure(lambda: load(root, "v1", RAW))
    assert isinstance(e, ckptstore.KeyMismatchError) and arn in str(e)
    other = ckptstore.KmsKey(other_alias)
    e = failure(lambda: load(root, "v1", other))
    assert isinstance(e, ckptstore.KeyMismatchError) and arn in str(e) and other_arn in str(e)
    assert "Decrypt" not in other.calls  # told apart by the ARN, before any Decrypt
    e = failure(lambda: load(root, "raw", ckptstore.KmsKey(alias)))
    assert isinstance(e, ckptstore.KeyMismatchError) and "raw master key" in str(e)
    assert same(load(root, "raw", RAW), state(0))  # the raw-key path as before


def test_a_wrapped_key_moved_to_another_version_is_refused_by_kms(kms, tmp_path):
    from ckptstore.manifest.schema import frame, seal_checksum, split_file

    arn, alias = new_key(kms)
    root = str(tmp_path / "s")
    key = ckptstore.KmsKey(alias)
    save(root, "v1", key, seed=1)
    save(root, "v2", key, seed=2)
    # v1's wrapped key (with its key id and ARN) in v2's manifest, the XXH3 seal made good again
    path = os.path.join(root, layout.manifest_key("v2"))
    body, seal = split_file(open(path, "rb").read())
    d = json.loads(body)
    d["encryption"] = manifest_body(root, "v1")["encryption"]
    nb = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    mac = seal["hmac_sha256"]
    open(path, "wb").write(frame(nb, {"hmac_sha256": mac, "xxh3": seal_checksum(nb, mac)}))
    e = failure(lambda: load(root, "v2", ckptstore.KmsKey(arn)))
    assert isinstance(e, ckptstore.IntegrityError) and "encryption context" in str(e)


# -- failures: nothing written, nothing lost, nothing marked ------------------------------------------------


def test_a_wrong_key_id_fails_the_save_before_anything_is_written(kms, tmp_path):
    root = tmp_path / "s"
    for key in (ckptstore.KmsKey(f"alias/none-{uuid.uuid4().hex[:8]}"), f"kms://{uuid.uuid4()}"):
        e = failure(lambda: save(root, "v1", key))
        assert type(e) is ckptstore.KeyServiceError and e.exit_code == 14 and e.code == "NotFoundException"
        assert "does not exist" in str(e) and "CKPTSTORE_KMS_KEY_ID" in str(e)
        assert stored_objects(root) == set() and not os.path.exists(root / "versions" / "v1")


def managed(root, key, steps=()):
    """A single-process CheckpointManager over a small model; saves ``steps``. Returns it, closed."""
    torch.manual_seed(0)
    st = {"m": torch.nn.Linear(3, 2)}
    mgr = ckptstore.CheckpointManager(str(root), st, key=key, interval_steps=1)
    for s in steps:
        with torch.no_grad():
            st["m"].weight.add_(1.0)
        mgr.save(s)
    mgr.close()
    return mgr


def test_a_disabled_key_fails_saves_and_loads_typed_and_marks_nothing(kms, tmp_path):
    arn, alias = new_key(kms)
    root = str(tmp_path / "s")
    writer_key = ckptstore.KmsKey(alias)
    save(root, "v1", writer_key, seed=1)
    managed(tmp_path / "m", ckptstore.KmsKey(alias), steps=(1, 2))
    before, mbefore = files(root), store_files(tmp_path / "m")
    kms.disable_key(KeyId=arn.split("/")[-1])  # moto takes the key id here, not the ARN

    e = failure(lambda: save(root, "v2", ckptstore.KmsKey(alias), seed=2))
    assert type(e) is ckptstore.KeyServiceError and "is disabled" in str(e) and "enable-key" in str(e)
    e = failure(lambda: load(root, "v1", ckptstore.KmsKey(arn)))
    assert type(e) is ckptstore.KeyServiceError and "is disabled" in str(e)
    # through the manager: raised (no fallback to step 1, no mark, no restore log line)
    torch.manual_seed(0)
    mgr = ckptstore.CheckpointManager(str(tmp_path / "m"), {"m": torch.nn.Linear(3, 2)}, key=ckptstore.KmsKey(arn))
    e = failure(mgr.resume)
    mgr.close()
    assert type(e) is ckptstore.KeyServiceError and store_files(tmp_path / "m") == mbefore
    r = cli("scrub", root, "--deep", "--kms-key", arn, "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code == 12 and rep["summary"]["damaged"] == 0 and rep["versions"][0]["status"] == "unchecked"
    assert "is disabled" in json.dumps(rep)
    assert files(root) == before  # nothing written, no damaged.json
    assert ckptstore.Store(root).latest().version == "v1"
    # a data key this process already holds stays usable (docs/howto/kms.md), and enabling the key again is all it takes
    assert same(load(root, "v1", writer_key), state(1))
    kms.enable_key(KeyId=arn.split("/")[-1])
    assert same(load(root, "v1", ckptstore.KmsKey(arn)), state(1))


def test_an_unreachable_kms_is_transient_never_damage(kms, tmp_path):
    arn, alias = new_key(kms)
    root = str(tmp_path / "s")
    save(root, "v1", ckptstore.KmsKey(alias), seed=1)
    save(root, "v2", ckptstore.KmsKey(alias), seed=2)
    managed(tmp_path / "m", ckptstore.KmsKey(alias), steps=(1, 2))
    before, mbefore = files(root), store_files(tmp_path / "m")

    def down():  # a KMS endpoint where nothing listens: connection refused, botocore retries, then gives up
        return ckptstore.KmsKey(arn, endpoint_url=f"http://127.0.0.1:{free_port()}", max_attempts=2)

    e = failure(lambda: save(root, "v3", down()))
    assert isinstance(e, ckptstore.KeyServiceUnavailableError) and "did not answer" in str(e) and e.exit_code == 14
    e = failure(lambda: load(root, "v2", down()))
    assert isinstance(e, ckptstore.KeyServiceUnavailableError)
    # the manager does not fall back to step 1 (it would need KMS as much): it raises, and marks nothing
    mgr = ckptstore.CheckpointManager(str(tmp_path / "m"), {"m": torch.nn.Linear(3, 2)}, key=down())
    e = failure(mgr.resume)
    mgr.close()
    assert isinstance(e, ckptstore.KeyServiceUnavailableError) and store_files(tmp_path / "m") == mbefore
    from ckptstore.scrub import scrub

    rep = scrub(ckptstore.Store(root), deep=True, key=down())
    assert rep.exit_code == 12 and not rep.damage() and {v.status for v in rep.versions} == {"unchecked"}
    assert files(root) == before
    assert [v.version for v in ckptstore.Store(root).versions()] == ["v1", "v2"]
    assert same(load(root, "v2", ckptstore.KmsKey(arn)), state(2))  # KMS back: everything is there
    mgr = ckptstore.CheckpointManager(str(tmp_path / "m"), {"m": torch.nn.Linear(3, 2)}, key=ckptstore.KmsKey(arn))
    assert mgr.resume() == 3 and mgr.last_restore.version == ckptstore.Store(str(tmp_path / "m")).latest().version
    mgr.close()


# -- ranks, references, requests per rank ---------------------------------------------------------------------


def test_two_ranks_incremental_save_and_load_ask_kms_once_per_rank_and_version(kms, tmp_path):
    import kms_ranks

    arn, alias = new_key(kms)
    root = str(tmp_path / "s")
    saved = run_ranks(kms_ranks.save, 2, root, alias, 2, timeout=300, **FAST)
    # a save: GenerateDataKey on the coordinator, one Decrypt on every other rank; DescribeKey once per process
    assert [c for c, _ in saved] == [{"DescribeKey": 1, "GenerateDataKey": 2}, {"DescribeKey": 1, "Decrypt": 2}]
    refs = manifest_body(root, "v2")["refs"]
    assert refs and all(r["kms"] == {"key_arn": arn} and r["version"] == "v1" for r in refs)
    loaded = run_ranks(kms_ranks.load, 2, root, arn, "v2", timeout=300, **FAST)
    # a load: one Decrypt per rank for v2's data key, one for v1's (its referenced frames)
    assert [c for c, _ in loaded] == [{"DescribeKey": 1, "Decrypt": 2}] * 2
    assert [d for _, d in loaded] == [s["v2"] for _, s in saved]
    r = cli("scrub", root, "--deep", "--kms-key", alias)
    assert r.exit_code == 0, r.output


@pytest.mark.slow  # ≈ 30 s: DCP's checkpoint subprocess starts a fresh interpreter
def test_a_process_executor_save_takes_the_kms_key_into_its_subprocess(kms, tmp_path):
    import kms_ranks

    _arn, alias = new_key(kms)
    root = str(tmp_path / "s")
    saved, loaded, alg, calls = run_ranks(kms_ranks.process_save, 1, root, alias, timeout=300, **FAST)[0]
    # the trainer's KmsKey made no request: DCP's checkpoint subprocess drew the data key with its copy
    assert saved == loaded and alg == "AES-256-GCM/KMS" and calls == {}


# -- rekey between raw keys and KMS keys ------------------------------------------------------------------------


def test_rekey_raw_to_kms_to_another_kms_key_and_back_to_raw(kms, tmp_path):
    from ckptstore.rekey import rekey

    a_arn, a_alias = new_key(kms)
    b_arn, _b_alias = new_key(kms)
    root = str(tmp_path / "s")
    w = ckptstore.StorageWriter(root, key=RAW, incremental=True)
    for i in (1, 2, 3):  # v2 and v3 reference v1's frames
        dcp.save({"frozen": state(0)["w"], "live": torch.full((9,), float(i))}, checkpoint_id=f"v{i}", storage_writer=w)
    w.close()
    assert manifest_body(root, "v3")["refs"]
    objects = {k: v for k, v in files(root).items() if k.endswith(".ckd")}
    key_file = tmp_path / "raw.key"
    key_file.write_bytes(RAW)

    r = cli("rekey", root, "--key-file", key_file, "--new-kms-key", a_alias, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["counts"] == {"rekeyed": 3}
    for v in ("v1", "v2", "v3"):
        b = manifest_body(root, v)
        assert b["encryption"]["kms"] == {"key_arn": a_arn} and all(x["kms"] == {"key_arn": a_arn} for x in b.get("refs", ()))

    def loads(key, v="v3"):
        sd = {"frozen": torch.zeros(300, 70), "live": torch.zeros(9)}
        dcp.load(sd, checkpoint_id=v, storage_reader=ckptstore.StorageReader(root, key=key))
        return torch.equal(sd["frozen"], state(0)["w"]) and torch.equal(sd["live"], torch.full((9,), float(v[1:])))

    assert loads(ckptstore.KmsKey(a_arn))
    assert isinstance(failure(lambda: loads(RAW)), ckptstore.KeyMismatchError)

    # KMS -> KMS: Decrypt (old), Encrypt + a checking Decrypt (new), once per data key: v1's once for all refs
    old, new = ckptstore.KmsKey(a_alias), ckptstore.KmsKey(b_arn)
    rep = rekey(ckptstore.Store(root), old, new)
    assert rep.exit_code == 0 and {e.status for e in rep.entries} == {"rekeyed"}
    assert dict(old.calls) == {"DescribeKey": 1, "Decrypt": 3}
    assert dict(new.calls) == {"DescribeKey": 1, "Encrypt": 3, "Decrypt": 3}
    assert rekey(ckptstore.Store(root), old, new).entries[0].status == "already"
    assert loads(ckptstore.KmsKey(b_arn)) and loads(ckptstore.KmsKey(b_arn), "v1")
    assert isinstance(failure(lambda: loads(ckptstore.KmsKey(a_arn))), ckptstore.KeyMismatchError)

    # to a disabled key: refused before anything is read or written
    c_arn, _ = new_key(kms)
    kms.disable_key(KeyId=c_arn.split("/")[-1])
    before = files(root)
    r = cli("rekey", root, "--kms-key", b_arn, "--new-kms-key", c_arn)
    assert r.exit_code == 14 and "is disabled" in r.output and files(root) == before

    # back to a raw key
    new_file = tmp_path / "raw2.key"
    new_file.write_bytes(RAW2)
    r = cli("rekey", root, "--kms-key", b_arn, "--new-key-file", new_file)
    assert r.exit_code == 0, r.output
    assert "kms" not in manifest_body(root, "v3")["encryption"] and manifest_body(root, "v3")["encryption"]["alg"] == "AES-256-GCM"
    assert loads(RAW2) and loads(RAW2, "v2")
    assert {k: v for k, v in files(root).items() if k.endswith(".ckd")} == objects  # data never re-encrypted
    r = cli("rekey", root, "--key-file", key_file, "--kms-key", b_arn, "--new-key-file", new_file)
    assert r.exit_code == 2  # one current key, not two


def test_scrub_deep_and_remote_reads_use_the_kms_key(kms, tmp_path):
    arn, alias = new_key(kms)
    root = tmp_path / "s"
    remote = f"s3://ckptstore-test/kms-{uuid.uuid4().hex[:10]}/"  # moto's S3 (the session bucket), same server
    save(root, "v1", ckptstore.KmsKey(alias), seed=1, remote=remote, durability="remote")
    # the local copy gone: the load reads S3 and unwraps through KMS
    shutil.rmtree(root / "versions")
    assert same(load(None, "v1", ckptstore.KmsKey(arn), remote=remote), state(1))
    r = cli("scrub", "", "--remote", remote, "--deep", "--json", env={"CKPTSTORE_KMS_KEY_ID": alias})
    rep = json.loads(r.stdout)
    assert r.exit_code == 0 and rep["versions"][0]["deep"] is True, r.output
    r = cli("scrub", "", "--remote", remote, "--deep")
    assert r.exit_code == 12 and "--kms-key or CKPTSTORE_KMS_KEY_ID" in r.output
    r = cli("scrub", "", "--remote", remote, "--deep", "--key-file", __file__)  # not a key: exit 5 as before
    assert r.exit_code == 5
