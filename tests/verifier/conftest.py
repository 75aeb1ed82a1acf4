"""`db`: a migrated Database on each available backend (the URL fixtures are in tests/conftest.py)."""

from collections.abc import Iterator

import pytest

from neuroshard.verifier.db import Database


@pytest.fixture
def db(database_url: str) -> Iterator[Database]:
    database = Database(database_url)
    database.upgrade()
    yield database
    database.dispose()
