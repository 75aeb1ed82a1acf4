"""The verifier's database: URL handling, engine set-up, Alembic upgrades, sessions.

SQLite (a file) by default, PostgreSQL through `postgresql+psycopg://…` (plain
`postgresql://` and `postgres://` are normalised to the psycopg 3 driver). The schema is
owned by Alembic: `Database.upgrade()` runs `upgrade head` with the revisions shipped in
this package (migrations/), configured in code so no `alembic.ini` or working directory
is needed. An upgrade only ever adds; running it twice is a no-op.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

SQLITE_BUSY_TIMEOUT_S = 30.0
"""How long a SQLite writer waits for another process's lock (our own writers share a lock)."""

# Any constant works; it only has to be the same in every verifier process sharing a database.
_PG_MIGRATION_LOCK = 0x6E53_7666


class DatabaseURLError(ValueError):
    """A --db value that is not a usable SQLAlchemy URL."""


def normalise_url(url: str) -> str:
    """`postgresql://` / `postgres://` → `postgresql+psycopg://`; SQLite and explicit drivers unchanged."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix) :]
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DatabaseURLError(
            f"database URL {url!r} is not a URL; expected sqlite:///PATH or postgresql://HOST/DB"
        ) from None
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise DatabaseURLError(f"database URL {url!r}: only sqlite and postgresql are supported")
    if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
        raise DatabaseURLError(
            f"database URL {url!r}: SQLite needs a file (sqlite:///PATH); an in-memory database "
            "would vanish with the connection and lose acknowledged receipts"
        )
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() != "psycopg":
        raise DatabaseURLError(f"database URL {url!r}: use the psycopg 3 driver (postgresql+psycopg://)")
    return parsed.render_as_string(hide_password=False)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets the dashboard's reads run beside a write; synchronous=FULL keeps a committed
    # transaction on disk even if the machine (not just the process) dies right after the 2xx.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


DEFAULT_POOL_SIZE = 5
"""SQLAlchemy's default; the service passes its request thread count plus its background threads."""


def create_database_engine(url: str, pool_size: int = DEFAULT_POOL_SIZE) -> Engine:
    """An engine whose PostgreSQL pool holds `pool_size` connections and opens no others.

    Issue 15: with SQLAlchemy's default pool (5 kept, 10 overflow, overflow closed on return)
    under 40 request threads, PostgreSQL forked ~2,000 backends in 150 s. A pool as large as
    the threads that use it keeps every connection open and reused; the small overflow is a
    margin, not a working set.
    """
    url = normalise_url(url)
    if url.startswith("sqlite"):
        database = make_url(url).database
        if database:
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S}
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=3)


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic configured in code: this package's migrations, and optionally a live connection."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("path_separator", "os")
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no Alembic revisions under {MIGRATIONS_DIR}")
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> None:
    """`alembic upgrade head` in one transaction (PostgreSQL DDL is transactional)."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Two verifiers starting at once on one database: the second waits, then finds head.
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
        command.upgrade(alembic_config(conn), "head")


class Database:
    """An engine, its sessions, and (for SQLite) the lock that serialises this process's writers.

    SQLite allows one writer at a time; a deferred transaction that reads and then writes can
    fail with SQLITE_BUSY instead of waiting, so writers in this process take turns here.
    PostgreSQL needs no lock: uniqueness constraints settle races.
    """

    def __init__(self, url: str, pool_size: int = DEFAULT_POOL_SIZE) -> None:
        self.url = normalise_url(url)
        self.engine = create_database_engine(self.url, pool_size)
        self._generation = 0
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_lock: AbstractContextManager[Any] = (
            threading.Lock() if self.engine.dialect.name == "sqlite" else nullcontext()
        )

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def upgrade(self) -> None:
        upgrade(self.engine)

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for queries; nothing it does is committed."""
        with self._sessions() as session:
            yield session

    @contextmanager
    def write(self, *, stale_reads: bool = True) -> Iterator[Session]:
        """A transaction: committed when the block ends normally, rolled back on any exception.

        Code after the `with` block runs only once the commit has returned, which is what
        makes "the 2xx only after the commit" hold for the API. `stale_reads=False` for a write
        no read shows (forgetting expired nonces): cached reads are not re-rendered for it.
        """
        with self._write_lock, self._sessions.begin() as session:
            yield session
        if stale_reads:
            self.touch()

    def touch(self) -> None:
        """Cached reads rendered before now are stale (called after a commit)."""
        self._generation += 1

    @property
    def generation(self) -> int:
        """Write transactions this process has committed (api.cache re-renders reads when it moves).
        A bare int: increments race only by losing a count, and any change is enough to notice."""
        return self._generation

    def dispose(self) -> None:
        self.engine.dispose()
