"""Fixtures of the nixl tests: a real S3-compatible server (moto) on 127.0.0.1, one bucket per test.

The server is moto in server mode, started as a subprocess bound to 127.0.0.1 only; the
credentials it accepts are dummies put in the environment, where the backend reads them (and
``AWS_EC2_METADATA_DISABLED`` keeps the AWS SDK from probing any non-loopback address).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from nixl_util import HAVE_MOTO, NIXL_MISSING, S3Server, s3_env

_buckets = itertools.count()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if NIXL_MISSING:
        for item in items:
            if "tests/nixl/" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=NIXL_MISSING))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    if not HAVE_MOTO:
        pytest.skip("moto[server] is not installed: pip install -e 'plugins/nixl[testing]'")
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the running server, credentials in this process's environment."""
    for key, value in s3_env().items():
        monkeypatch.setenv(key, value)
    name = f"hicache-test-{next(_buckets)}"
    s3_server.create_bucket(name)
    return name
