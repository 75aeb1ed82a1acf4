"""Database fixtures: every test that takes `db` runs on SQLite and, when
NEUROSHARD_TEST_DATABASE_URL is set, again on a fresh schema of that PostgreSQL."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuroshard.verifier.db import Database
from neuroshard.verifier.testing import TestDatabases, database_backends, scratch_database


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
def db(database_url: str) -> Iterator[Database]:
    database = Database(database_url)
    database.upgrade()
    yield database
    database.dispose()
