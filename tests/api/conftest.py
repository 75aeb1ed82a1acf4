"""An in-process verifier app on each available database (SQLite; PostgreSQL when
NEUROSHARD_TEST_DATABASE_URL is set), with a hand-moved clock."""

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from neuroshard.api.app import create_app
from neuroshard.testing.api import Harness, test_config
from neuroshard.testing.verifier import ManualClock


@pytest.fixture
def harness(database_url: str) -> Iterator[Harness]:
    clock = ManualClock()
    config = test_config(database_url, clock)
    with TestClient(create_app(config)) as client:
        yield Harness(client, clock, config)
