"""The GCS and Azure Blob tiers: the tier conformance suite against fake-gcs-server and Azurite,
the registry of remote tiers by URL scheme, the ignoring-server probe of each tier, options and
bounded timeouts. Cross-tier end-to-end cases (save, upload, restore from the remote tier only; gc;
scrub; the CLI; the conditional-write race) live in tests/test_remote_e2e.py."""

from __future__ import annotations

import contextlib
import pickle
import socket

import pytest

from ckptstore.errors import (
    ConditionalWritesError,
    InvalidNameError,
    ObjectExistsError,
    StorageError,
    TransientStorageError,
)
from ckptstore.testing.tier_conformance import TierConformanceTests

MiB = 1 << 20


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ------------------------------------------------------------------------------------------------
# conformance


class TestGCSTier(TierConformanceTests):
    """The tier conformance suite on fake-gcs-server."""

    list_count = 1100  # crosses the 1000-object listing page
    writer_size = 9 * MiB + 17  # larger than the 8 MiB part: a resumable upload of several chunks
    big_size = 5 * MiB

    def make_tier(self):
        from ckptstore.tiers.gcs import GCSTier

        return GCSTier(self.request.getfixturevalue("gs_url"))

    def raw_get(self, tier, key):
        return tier._conn.bucket.blob(tier.prefix + key).download_as_bytes()

    def raw_set(self, tier, key, data):
        tier._conn.bucket.blob(tier.prefix + key).upload_from_string(data)

    @contextlib.contextmanager
    def transient_tier(self):
        from ckptstore.tiers.gcs import GCSTier

        self.request.getfixturevalue("gs_url")
        t = GCSTier("gs://ckptstore-test/te/", endpoint_url=f"http://127.0.0.1:{_closed_port()}", anonymous=True,
                    deadline=1.0, connect_timeout=0.5, read_timeout=0.5, conditional_writes="trust")
        try:
            yield t
        finally:
            t.close()


class TestAzureTier(TierConformanceTests):
    """The tier conformance suite on Azurite."""

    list_count = 1100  # crosses two pages of 500 (list_page_size below)
    writer_size = 9 * MiB + 17  # larger than the 8 MiB part: staged blocks
    big_size = 5 * MiB

    def make_tier(self):
        from ckptstore.tiers.azure import AzureTier

        return AzureTier(self.request.getfixturevalue("az_url"), list_page_size=500)

    def raw_get(self, tier, key):
        return tier._conn.container.get_blob_client(tier.prefix + key).download_blob().readall()

    def raw_set(self, tier, key, data):
        tier._conn.container.get_blob_client(tier.prefix + key).upload_blob(data, overwrite=True)

    @contextlib.contextmanager
    def transient_tier(self):
        from ckptstore.testing.azurite import ACCOUNT, ACCOUNT_KEY
        from ckptstore.tiers.azure import AzureTier

        self.request.getfixturevalue("az_url")
        t = AzureTier("az://ckptstore-test/te/", endpoint_url=f"http://127.0.0.1:{_closed_port()}/{ACCOUNT}",
                      account_name=ACCOUNT, account_key=ACCOUNT_KEY, max_attempts=1, connect_timeout=0.5,
                      read_timeout=0.5, conditional_writes="trust")
        try:
            yield t
        finally:
            t.close()


# ------------------------------------------------------------------------------------------------
# the registry


def test_registry_builds_each_tier_by_scheme():
    from ckptstore.tiers import REGISTRY, make_remote
    from ckptstore.tiers.azure import AzureTier
    from ckptstore.tiers.gcs import GCSTier
    from ckptstore.tiers.s3 import S3Tier

    assert set(REGISTRY) == {"s3", "gs", "az"}
    s3 = make_remote("s3://bkt/p", endpoint_url="http://127.0.0.1:1")
    gs = make_remote("gs://bkt/a//b/", project="proj")
    az = make_remote("az://ctr/p", account_name="acct", account_key="a2V5")
    assert (type(s3), s3.url) == (S3Tier, "s3://bkt/p/")
    assert (type(gs), gs.url) == (GCSTier, "gs://bkt/a/b/")
    assert (type(az), az.url) == (AzureTier, "az://ctr/p/")
    assert make_remote(gs) is gs and make_remote(None) is None
    with pytest.raises(InvalidNameError, match="registered"):
        make_remote("abfs://ctr@acct.dfs.core.windows.net/p")
    with pytest.raises(TypeError):  # an option of another tier is refused by the tier, not ignored
        make_remote("gs://bkt/p", region_name="eu-west-1")


@pytest.mark.parametrize("url", ["gs://", "gs://B/p", "gs://ab", "gs://goog-x/p", "gs://a..b/p", "gs://bkt/a/../b",
                                 "az://", "az://Ctr/p", "az://ab/p", "az://a--b/p", "az://ctr-/p", "az://ctr/a\\b"])
def test_bad_urls_rejected_up_front(url):
    from ckptstore.tiers import make_remote

    with pytest.raises(InvalidNameError):
        make_remote(url)


def test_bounded_timeouts_through_the_registry():
    """``timeout_s`` (what the torchft integration passes) becomes each tier's own timeouts; an
    option given explicitly wins."""
    from ckptstore.tiers import make_remote

    s3 = make_remote("s3://bkt/p", timeout_s=8.0)
    assert (s3._kwargs["connect_timeout"], s3._kwargs["read_timeout"], s3._kwargs["max_attempts"]) == (2.0, 4.0, 3)
    gs = make_remote("gs://bkt/p", timeout_s=8.0, read_timeout=1.0)
    assert (gs._kwargs["connect_timeout"], gs._kwargs["read_timeout"], gs._kwargs["deadline"]) == (2.0, 1.0, 8.0)
    az = make_remote("az://ctr/p", timeout_s=400.0, account_name="a")
    assert (az._kwargs["connect_timeout"], az._kwargs["read_timeout"], az._kwargs["max_attempts"]) == (10.0, 60.0, 3)


def test_torchft_builds_its_tier_through_the_registry():
    """``DurableTier._remote_tier``: any scheme, each request bounded below torchft's timeout (it
    built an S3Tier itself before, so gs:// and az:// had no durable tier under torchft)."""
    pytest.importorskip("torchft")
    import types

    from ckptstore.integrations.torchft import DurableTier
    from ckptstore.tiers.gcs import GCSTier

    me = types.SimpleNamespace(timeout_s=20.0)
    gs = DurableTier._remote_tier(me, "gs://bkt/p", None)
    assert isinstance(gs, GCSTier) and (gs._kwargs["read_timeout"], gs._kwargs["deadline"]) == (10.0, 20.0)
    s3 = DurableTier._remote_tier(me, "s3://bkt/p", "http://127.0.0.1:1")
    assert (s3._kwargs["endpoint_url"], s3._kwargs["connect_timeout"], s3._kwargs["max_attempts"]) == \
        ("http://127.0.0.1:1", 5.0, 3)


def test_tiers_pickle_with_their_options():
    from ckptstore.tiers.azure import AzureTier
    from ckptstore.tiers.gcs import GCSTier

    gs = pickle.loads(pickle.dumps(GCSTier("gs://bkt/p", project="x", part_size=16 * MiB, deadline=5.0)))
    assert (gs.url, gs.part_size, gs._kwargs["project"], gs._kwargs["deadline"]) == ("gs://bkt/p/", 16 * MiB, "x", 5.0)
    az = pickle.loads(pickle.dumps(AzureTier("az://ctr/p", account_name="a", max_attempts=2)))
    assert (az.url, az._kwargs["account_name"], az._kwargs["max_attempts"]) == ("az://ctr/p/", "a", 2)


def test_deprecated_endpoint_url_maps_onto_remote_options(tmp_path):
    import ckptstore

    with pytest.warns(DeprecationWarning, match="remote_options"):
        st = ckptstore.Store(tmp_path, remote="s3://bkt/p", endpoint_url="http://127.0.0.1:1")
    assert st.remote._kwargs["endpoint_url"] == "http://127.0.0.1:1"
    st2 = ckptstore.Store(tmp_path, remote="gs://bkt/p", remote_options={"endpoint_url": "http://127.0.0.1:2",
                                                                         "anonymous": True})
    assert st2.remote._kwargs["endpoint_url"] == "http://127.0.0.1:2"
    with pytest.raises(TypeError):
        ckptstore.Store(tmp_path, remote="s3://bkt/p", no_such_option=1)


def test_missing_azure_account_is_a_storage_error(monkeypatch):
    from ckptstore.tiers.azure import AzureTier

    for k in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_BLOB_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(StorageError, match="AZURE_STORAGE_CONNECTION_STRING"):
        AzureTier("az://ctr/p").stat("x")


def test_missing_bucket_and_container_are_storage_errors(gs_url, az_url):
    from ckptstore.errors import ObjectNotFoundError
    from ckptstore.tiers import make_remote

    for url in ("gs://no-such-bucket-ckpt/p/", "az://no-such-container/p/"):
        t = make_remote(url)
        with pytest.raises(StorageError, match="does not exist") as ei:
            t.get("a")
        assert not isinstance(ei.value, ObjectNotFoundError)
        t.close()


# ------------------------------------------------------------------------------------------------
# the ignoring-server probe (docs/FORMAT.md, "Conditional writes")


@pytest.fixture
def ignoring_gcs(gs_url):
    """A GCS tier whose endpoint drops ``ifGenerationMatch`` (fake-gcs-server behind a proxy)."""
    import os

    from header_proxy import HeaderStrippingProxy

    with HeaderStrippingProxy(os.environ["STORAGE_EMULATOR_HOST"], strip=(), strip_query=("ifGenerationMatch",)) as p:
        yield p, dict(endpoint_url=p.url, anonymous=True), gs_url


@pytest.fixture
def ignoring_azure(az_url, azurite):
    """An Azure tier whose endpoint drops ``If-None-Match`` (Azurite behind a proxy; a SAS token,
    which signs no header, so that the stripped request is still authorised)."""
    import datetime

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from ckptstore.testing.azurite import ACCOUNT, ACCOUNT_KEY
    from header_proxy import HeaderStrippingProxy

    sas = generate_container_sas(ACCOUNT, "ckptstore-test", account_key=ACCOUNT_KEY,
                                 permission=ContainerSasPermissions(read=True, write=True, delete=True, list=True,
                                                                    create=True, add=True),
                                 expiry=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1))
    with HeaderStrippingProxy(azurite.endpoint, strip=("if-none-match",)) as p:
        yield p, dict(endpoint_url=f"{p.url}/{ACCOUNT}", credential=sas), az_url


@pytest.mark.parametrize("which", ["ignoring_gcs", "ignoring_azure"])
def test_endpoint_that_ignores_the_precondition_is_refused(request, which):
    from ckptstore.tiers import make_remote

    proxy, opts, url = request.getfixturevalue(which)
    t = make_remote(url, **opts)
    with pytest.raises(ConditionalWritesError, match="does not enforce put-if-absent") as ei:
        t.put_if_absent("manifest.json", b"{}")
    assert proxy.stripped >= 2 and "=trust" in str(ei.value)
    assert [i.key for i in t.list("")] == []  # the probe was cleaned up, nothing was committed
    with pytest.raises(ConditionalWritesError):  # cached: no second probe
        t.put_if_absent("manifest.json", b"{}")
    trusting = make_remote(url, conditional_writes="trust", **opts)
    trusting.put_if_absent("m2", b"1")
    trusting.put_if_absent("m2", b"2")  # the endpoint overwrites: what "trust" accepts
    assert trusting.get("m2") == b"2"
    t.close()
    trusting.close()


@pytest.mark.parametrize("which", ["gs_url", "az_url"])
def test_enforcing_endpoint_passes_the_probe(request, which):
    from ckptstore.tiers import make_remote

    t = make_remote(request.getfixturevalue(which))
    t.check_conditional_writes()
    t.put_if_absent("m", b"1")
    with pytest.raises(ObjectExistsError):
        t.put_if_absent("m", b"2")
    assert [i.key for i in t.list("")] == ["m"]
    t.close()


def test_transient_outage_is_typed_and_bounded():
    """A server that is down: every call raises TransientStorageError within about the deadline."""
    import time

    from ckptstore.tiers.gcs import GCSTier

    t = GCSTier("gs://bkt/p/", endpoint_url=f"http://127.0.0.1:{_closed_port()}", anonymous=True, deadline=1.5,
                connect_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(TransientStorageError):
        t.get("x")
    assert time.monotonic() - t0 < 10
