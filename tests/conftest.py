"""Shared pytest set-up: a deliberate thread count, a small signed data set, database URLs, and a
real S3-compatible endpoint (moto in server mode) on loopback with dummy credentials.

Tests that take `database_url` run on SQLite and, when NEUROSHARD_TEST_DATABASE_URL is set
(CI sets it), again on a fresh schema of that PostgreSQL."""

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from moto.server import ThreadedMotoServer
from nacl.signing import SigningKey
from tests_support import small_corpus

from neuroshard.data import Dataset, open_dataset
from neuroshard.data.publish import TOKENIZER_NAME, publish_shards
from neuroshard.testing.verifier import TestDatabases, database_backends, scratch_database
from neuroshard.tokenizer import BPETokenizer

# The CI machine has 2 cores; one thread per test process keeps results reproducible
# (reduction order inside matmul kernels depends on the thread count).
torch.set_num_threads(1)


@dataclass(frozen=True)
class PublishedData:
    directory: Path
    key: SigningKey
    dataset: Dataset

    @property
    def public_key_hex(self) -> str:
        return bytes(self.key.verify_key).hex()


@pytest.fixture(scope="session")
def published(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PublishedData]:
    """A small signed data set (vocab 512, 20k-token shards), built once per test session."""
    directory = tmp_path_factory.mktemp("dataset")
    docs = small_corpus()
    tokenizer = BPETokenizer.train(docs[:40], 512)
    tokenizer.save(directory / TOKENIZER_NAME)
    key = SigningKey(bytes(range(32)))
    publish_shards(docs, out=directory, key=key, shard_tokens=20_000)
    yield PublishedData(directory, key, open_dataset(directory, bytes(key.verify_key)))


@pytest.fixture(scope="session")
def test_databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestDatabases]:
    databases = TestDatabases(tmp_path_factory.mktemp("databases"), os.environ)
    yield databases
    databases.close()


@pytest.fixture(params=database_backends(os.environ))
def database_url(request: pytest.FixtureRequest, test_databases: TestDatabases) -> str:
    """A clean database already at Alembic head."""
    return test_databases.clean(request.param)


@pytest.fixture(params=database_backends(os.environ))
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database with no tables at all (for migration tests)."""
    with scratch_database(request.param, tmp_path, os.environ) as url:
        yield url


@pytest.fixture(scope="session")
def endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy credentials, and nothing from the developer's ~/.aws or an instance role."""
    for name in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
