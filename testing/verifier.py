"""Helpers for tests that need a verifier: scratch databases, a settable clock, signed bodies.

Not used by the service itself. Lives in the package (like starlette.testclient) so the
verifier's own tests, the API's and the integration tests share one implementation.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.signing import sign_request
from neuroshard.verifier.db import Database, normalise_url
from neuroshard.verifier.models import Base
from neuroshard.verifier.network import NetworkDefinition, parse_network

TEST_DATABASE_ENV = "NEUROSHARD_TEST_DATABASE_URL"
"""Set (e.g. postgresql://127.0.0.1:5432/test) to run database tests against PostgreSQL as well."""


def database_backends(env: Mapping[str, str]) -> list[str]:
    """'sqlite' always; 'postgresql' too when TEST_DATABASE_ENV is set."""
    return ["sqlite", "postgresql"] if env.get(TEST_DATABASE_ENV) else ["sqlite"]


@contextmanager
def scratch_database(backend: str, directory: Path, env: Mapping[str, str]) -> Iterator[str]:
    """A URL to an empty database, removed afterwards.

    SQLite: a new file in `directory`. PostgreSQL: a fresh schema in the database named by
    TEST_DATABASE_ENV, made the connection's search_path, dropped with everything in it.
    """
    if backend == "sqlite":
        yield f"sqlite:///{directory / f'verifier-{uuid.uuid4().hex[:8]}.sqlite3'}"
        return
    if backend != "postgresql":
        raise ValueError(f"unknown backend {backend!r}")
    base = env.get(TEST_DATABASE_ENV)
    if not base:
        raise ValueError(f"{TEST_DATABASE_ENV} is not set")
    base = normalise_url(base)
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    finally:
        admin.dispose()


class TestDatabases:
    """Clean, migrated databases for one test after another, cheaply.

    Migrating a fresh database per test costs ~0.1–0.3 s; this migrates once per backend and
    then hands out copies (SQLite: a copy of a migrated template file) or the same schema
    emptied (PostgreSQL: TRUNCATE of every table but alembic_version). Tests of migrations
    themselves need a truly empty database: use `scratch_database`.
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, directory: Path, env: Mapping[str, str]) -> None:
        self._directory = directory
        self._env = env
        self._sqlite_template: Path | None = None
        self._postgres: tuple[str, Any] | None = None  # (url, context manager owning the schema)

    def clean(self, backend: str) -> str:
        if backend == "sqlite":
            return self._sqlite()
        if backend == "postgresql":
            return self._postgresql()
        raise ValueError(f"unknown backend {backend!r}")

    def _sqlite(self) -> str:
        if self._sqlite_template is None:
            template = self._directory / "template.sqlite3"
            db = Database(f"sqlite:///{template}")
            db.upgrade()
            db.dispose()  # the last connection to close checkpoints the WAL into the file
            self._sqlite_template = template
        copy = self._directory / f"verifier-{uuid.uuid4().hex[:8]}.sqlite3"
        shutil.copyfile(self._sqlite_template, copy)
        return f"sqlite:///{copy}"

    def _postgresql(self) -> str:
        if self._postgres is None:
            owner = scratch_database("postgresql", self._directory, self._env)
            url = owner.__enter__()
            db = Database(url)
            db.upgrade()
            db.dispose()
            self._postgres = (url, owner)
            return url
        url = self._postgres[0]
        tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
        engine = create_engine(normalise_url(url))
        with engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
        engine.dispose()
        return url

    def close(self) -> None:
        if self._postgres is not None:
            self._postgres[1].__exit__(None, None, None)
            self._postgres = None


class ManualClock:
    """A clock tests move by hand: call it for the time, `advance` it by seconds."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def signed_json(
    signer: Wallet, path: str, doc: Any, *, timestamp: float, method: str = "POST"
) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of a signed JSON request, as a node would send it at Unix time `timestamp`."""
    body = json.dumps(doc).encode("utf-8")
    headers = sign_request(signer, method, path, body, now=timestamp)
    headers["Content-Type"] = "application/json"
    return body, headers


def small_network(**tables: dict[str, Any]) -> NetworkDefinition:
    """A valid single-stage network definition on the tiny model; override any table by name."""
    doc: dict[str, Any] = {
        "name": "test",
        "model": {"size": "tiny", "vocab_size": 512},
        "stages": {"count": 1},
        "diloco": {"inner_steps": 4, "warmup_steps": 0, "total_steps": 1000},
        "training": {"batch_size": 2, "seq_len": 32},
        "data": {"manifest_url": "http://127.0.0.1:1/data/", "publisher_key": "ab" * 32},
    }
    doc.update(tables)
    return parse_network(doc, "test network")
