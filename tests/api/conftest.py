"""An in-process verifier app on each available database (SQLite; PostgreSQL when
NEUROSHARD_TEST_DATABASE_URL is set), with a hand-moved clock."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from neuroshard.api.app import create_app
from neuroshard.api.testing import Harness, test_config
from neuroshard.verifier.testing import ManualClock, TestDatabases, database_backends, scratch_database


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


@pytest.fixture
def harness(database_url: str) -> Iterator[Harness]:
    clock = ManualClock()
    config = test_config(database_url, clock)
    with TestClient(create_app(config)) as client:
        yield Harness(client, clock, config)
