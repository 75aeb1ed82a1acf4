"""Background work in exactly one verifier process: a PostgreSQL advisory lock held as a lease.

Several worker processes (neuroshard-verifier --workers N) serve one database. Requests can go
to any of them, but the held-out evaluation, the replay spot checks and the reputation they
move must run once: two evaluators would fetch and measure every model twice, two replay
checkers would draw and replay the same receipts twice.

Every process runs a `LeaderLease`. It asks PostgreSQL for a session-level advisory lock
(`pg_try_advisory_lock`) on a connection it keeps open; the one that gets it starts the
background jobs and keeps the connection. PostgreSQL releases a session lock when its
connection ends, and the kernel closes a process's sockets when it dies, SIGKILL included:
the others find the lock free at their next try (every `poll_s`) and one of them takes over.
A leader that is alive but lost its connection (PostgreSQL restarted, a backend terminated)
finds out at its own next check and stops its jobs: for up to `poll_s` the old and the new
leader can overlap. The jobs tolerate that (an evaluation or replay verdict recorded twice
for one round is a repeat, not a corruption); a dead process never overlaps.

SQLite serves one process (the CLI refuses --workers > 1 on it), which always leads.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import Connection, text
from sqlalchemy.exc import SQLAlchemyError

from .db import Database

LEADER_LOCK_CLASS = 0x6E53_4C44
"""First half of the lease's advisory-lock key (an int4); the second is a hash of the schema.
Advisory locks are database-wide: keyed by schema too, two runs kept in two schemas of one
database (and tests in scratch schemas) each get their own leader."""

Log = Callable[[str], None]


class Job(Protocol):
    """A background worker with its own threads (verifier.evaluator, verifier.replaycheck,
    verifier.vocab, verifier.housekeeping)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass(kw_only=True)
class LeaseConfig:
    poll_s: float = 1.0
    """Seconds between a follower's tries for the lock and a leader's checks of its connection:
    at most this long (plus PostgreSQL noticing the dead connection) without a leader."""

    def __post_init__(self) -> None:
        if self.poll_s <= 0:
            raise ValueError(f"LeaseConfig: poll_s must be > 0, got {self.poll_s}")


class LeaderLease:
    """Runs `jobs` (built afresh for every term, since a stopped job cannot be restarted) while
    this process holds the lease."""

    def __init__(
        self, db: Database, jobs: Sequence[Callable[[], Job]], *, config: LeaseConfig, log: Log
    ) -> None:
        self.db = db
        self.config = config
        self._factories = list(jobs)
        self._log = log
        self._running: list[Job] = []
        self._conn: Connection | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._leading = False
        self.terms = 0
        """Times this process became the leader."""

    @property
    def is_leader(self) -> bool:
        """True once every job of the term has started (taken under the lock _lead holds meanwhile)."""
        with self._lock:
            return self._leading

    def running(self) -> Counter[str]:
        """Background jobs running in this process, by class name (/metrics)."""
        with self._lock:
            return Counter(type(job).__name__ for job in self._running)

    def start(self) -> None:
        if self.db.dialect != "postgresql":
            self._lead()  # one process per SQLite file: nobody to share with
            return
        self.try_once()  # a lone worker leads from its first request on, not one poll later
        self._thread = threading.Thread(target=self._run, name="leader-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10 * self.config.poll_s + 5)
            self._thread = None
        with self._lock:
            self._step_down("shutting down")

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            self.try_once()

    def try_once(self) -> None:
        """Take the lease if it is free; if held, check the connection that holds it is alive."""
        with self._lock:
            try:
                if self._conn is not None:
                    self._conn.execute(text("SELECT 1"))
                    self._conn.commit()
                    return
                conn = self.db.engine.connect()
                try:
                    got = conn.execute(
                        text("SELECT pg_try_advisory_lock(:cls, hashtext(current_schema()))"),
                        {"cls": LEADER_LOCK_CLASS},
                    ).scalar()
                    conn.commit()  # the lock is the session's; no transaction stays open
                except BaseException:
                    conn.close()
                    raise
                if not got:
                    conn.close()
                    return
                self._conn = conn
            except SQLAlchemyError as exc:
                if self._conn is not None:
                    self._step_down(f"lease connection failed: {type(exc).__name__}: {exc}")
                return
        self._lead()

    def _lead(self) -> None:
        with self._lock:
            self.terms += 1
            self._log(f"background work: process {os.getpid()} leads (term {self.terms})")
            for make in self._factories:
                job = make()
                job.start()
                self._running.append(job)
            self._leading = True

    def _step_down(self, why: str) -> None:
        """Stop the jobs and end the session that holds the lock; the caller holds self._lock."""
        jobs, self._running = self._running, []
        for job in reversed(jobs):
            try:
                job.stop()
            except Exception as exc:  # the others must still stop, and the lock be released
                self._log(f"background work: stopping {type(job).__name__}: {type(exc).__name__}: {exc}")
        if self._leading:
            self._log(f"background work: process {os.getpid()} stopped leading ({why})")
        self._leading = False
        conn, self._conn = self._conn, None
        if conn is not None:
            # Closed for real, not returned to the pool: ending the session releases the lock.
            conn.invalidate()
            conn.close()
