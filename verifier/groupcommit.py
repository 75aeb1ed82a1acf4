"""Group commit: the writes of many concurrent requests in one transaction, each request
answered only once that transaction has committed.

When a thousand replicas end an outer round they send their receipts within seconds of each
other (issue 15's burst). Written one transaction per request, every receipt pays for its own
session, its own hop to a request thread and its own COMMIT (a WAL flush in PostgreSQL). Here
the route hands its write to a few writer threads per process (`WRITERS`) and awaits it; a free
writer takes everything queued while the others committed, runs it in one transaction and wakes
each request with its own result. Under light load a group is one write and nothing waits; under a
burst the groups grow by themselves, and the per-write cost falls with them. No write is
delayed on purpose to gather a group.

A write that fails (a refusal, a constraint) must not take its neighbours' writes with it, and
no refusal may leave a trace: a group in which anything fails is rolled back whole and its
writes are run again one transaction each, so each gets exactly the outcome it would have had
alone. Refusals are rare on the write path (replayed nonces, unregistered wallets), so the
retry costs little. Each group runs its writes sorted by `key` (the signer's wallet), so two
processes' groups take row locks in the same order.

Durability is the caller's promise to keep: `submit` returns only after COMMIT returned, so
acknowledging after `await submit(...)` acknowledges a durable write (verifier.db.Database.write).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy.orm import Session

from .db import Database

T = TypeVar("T")

log = logging.getLogger(__name__)

WRITERS = 2
"""Writer threads per process, each holding a database connection while it commits. One writer
groups best (verifier CPU per write 0.78x one transaction per request, three writers 0.83x:
bench/RESULTS.md); a second keeps a group that waits on a row lock from stalling every write."""

MAX_GROUP = 128
"""Writes in one transaction at most: bounds how long one group holds its row locks."""


@dataclass
class _Write(Generic[T]):
    work: Callable[[Session], T]
    key: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[T]


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # the client went away; its write stands (or not) all the same
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class GroupCommit:
    """`writers` threads that commit the queued writes of this process in groups. More than one,
    so that one group's round trips to the database overlap another's work in Python."""

    def __init__(self, db: Database, *, writers: int = WRITERS, max_group: int = MAX_GROUP) -> None:
        if writers < 1 or max_group < 1:
            raise ValueError(f"GroupCommit: writers and max_group must be >= 1, got {writers}, {max_group}")
        self._db = db
        self._max_group = max_group
        self.writers = writers
        self._queue: queue.SimpleQueue[_Write[Any] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.groups = 0
        """Transactions committed or tried, reruns included (shown in /metrics)."""
        self.retried = 0
        """Groups rolled back and run again one write at a time."""

    def start(self) -> None:
        if not self._threads:
            self._threads = [
                threading.Thread(target=self._serve, name=f"group-commit-{i}", daemon=True)
                for i in range(self.writers)
            ]
            for thread in self._threads:
                thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued, then stop the threads."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=timeout_s)
        self._threads = []

    async def submit(self, work: Callable[[Session], T], *, key: str) -> T:
        """Run `work(session)` inside a write transaction; its result once that has committed.
        An exception `work` raises (a `Refused`, say) is raised here, with nothing committed."""
        if not self._threads:
            raise RuntimeError("GroupCommit.submit before start()")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put(_Write(work, key, loop, future))
        return await future

    def _serve(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            group = [first]
            while len(group) < self._max_group:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                group.append(more)
            group.sort(key=lambda w: w.key)
            self._commit(group)

    def _commit(self, group: list[_Write[Any]]) -> None:
        with self._lock:
            self.groups += 1
        try:
            with self._db.write() as session:
                results = [write.work(session) for write in group]
        except Exception as exc:
            if len(group) == 1:
                self._deliver(group[0], None, exc)
                return
            with self._lock:
                self.retried += 1
            for write in group:  # nothing of the group committed: each alone, with its own outcome
                self._commit(group=[write])
            return
        for write, result in zip(group, results, strict=True):
            self._deliver(write, result, None)

    @staticmethod
    def _deliver(write: _Write[Any], result: Any, error: BaseException | None) -> None:
        try:
            write.loop.call_soon_threadsafe(_resolve, write.future, result, error)
        except RuntimeError:  # the request's event loop has closed (shutdown): nobody to answer
            log.debug("group commit: a write's event loop closed before its answer")
