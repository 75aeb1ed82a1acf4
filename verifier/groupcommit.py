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
no refusal may leave a trace: when a write raises, the group is rolled back, that write gets its
error (its outcome after the writes before it, a valid serial order) and the others are
committed again without it, each in its own SAVEPOINT so that further refusals among them roll
back only themselves. A group with refusals in it costs one rerun, however many it has, and a
group without any pays for no savepoint. A failure no single write caused (the database away, a COMMIT that raised)
goes to every write of the group, none rerun alone; a deadlock is tried once more. Each group runs
its writes sorted by `key` (the signer's wallet, then the nonce; a registration's key starts with
its stage), which makes two processes' groups lock the rows of their own wallets, and the stages'
membership epoch rows that registrations move, in the same order. Not every cycle is ruled out:
a late receipt that also moves its stage's epoch, or a group holding a registration (epoch row
first) beside another write of a wallet that is joining the same stage in another group, can
still meet that group in a deadlock, which PostgreSQL breaks; the group is then tried once more.

Durability is the caller's promise to keep: `submit` returns only after COMMIT returned, so
acknowledging after `await submit(...)` acknowledges a durable write (verifier.db.Database.write).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from .db import Database

T = TypeVar("T")

log = logging.getLogger(__name__)

WRITERS = 2
"""Writer threads per process, each holding a database connection while it commits. One writer
groups best while the machine is busy (verifier CPU per write 0.78x one transaction per request,
three writers 0.83x; bench/RESULTS.md). Two, the default, measured only on a quiet machine, where
groups stay small (0.98x), so that a group waiting on a row lock does not stall every write."""

MAX_GROUP = 128
"""Writes in one transaction at most: bounds how long one group holds its row locks (a chosen
bound, not a measured optimum: a burst of 1,000 receipts over 4 workers queues ~60 per writer)."""


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


class _Failed(Exception):
    """Raised out of a group's transaction to roll it back: write `index` raised `error`."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(index)
        self.index, self.error = index, error


def _retryable(exc: BaseException) -> bool:
    """A deadlock or serialization failure: PostgreSQL rolled the group back, a second try may pass."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) in ("40P01", "40001")


class GroupCommit:
    """`writers` threads that commit the queued writes of this process in groups."""

    def __init__(self, db: Database, *, writers: int = WRITERS, max_group: int = MAX_GROUP) -> None:
        if writers < 1 or max_group < 1:
            raise ValueError(f"GroupCommit: writers and max_group must be >= 1, got {writers}, {max_group}")
        self._db = db
        self._max_group = max_group
        self.writers = writers
        self._queue: queue.SimpleQueue[_Write[Any] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._lock = threading.Lock()
        self.groups = 0
        """Transactions tried, reruns included (shown in /metrics)."""
        self.retried = 0
        """Groups rolled back and run again: without a write that raised, or after a deadlock."""

    def start(self) -> None:
        if not self._threads:
            self._closing = False
            self._threads = [
                threading.Thread(target=self._serve, name=f"group-commit-{i}", daemon=True)
                for i in range(self.writers)
            ]
            for thread in self._threads:
                thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued, then stop the threads; a write submitted after this is refused,
        and one still queued when the threads are gone gets an error instead of no answer."""
        self._closing = True
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=timeout_s)
        self._threads = []
        while True:
            try:
                left = self._queue.get_nowait()
            except queue.Empty:
                break
            if left is not None:
                self._deliver(left, None, RuntimeError("the verifier is shutting down"))

    async def submit(self, work: Callable[[Session], T], *, key: str) -> T:
        """Run `work(session)` inside a write transaction; its result once that has committed.
        An exception `work` raises (a `Refused`, say) is raised here, with nothing of it committed.
        `work` may run more than once (when its group is rerun), so it must change nothing outside
        the session. `key` orders the writes of a group (the signer's wallet and the nonce)."""
        if not self._threads or self._closing:
            raise RuntimeError("GroupCommit.submit before start() or after close()")
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
            try:
                self._commit(group)
            except BaseException as exc:  # never leave a request without an answer
                for write in group:
                    self._deliver(write, None, exc)
                log.exception("group commit: a group failed outside its writes")

    def _commit(self, group: list[_Write[Any]], *, retry: bool = True, savepoints: bool = False) -> None:
        """Commit `group`. A write that raises gets its error (its outcome after the writes before it
        in the group, a valid serial order) and the others are committed again without it, each then
        in its own SAVEPOINT: a group with a refusal in it costs one rerun however many it has."""
        with self._lock:
            self.groups += 1
        refused: dict[int, BaseException] = {}
        try:
            with self._db.write() as session:
                results: list[Any] = []
                for index, write in enumerate(group):
                    result = None
                    try:
                        with session.begin_nested() if savepoints else nullcontext():
                            result = write.work(session)
                            session.flush()
                    except Exception as exc:
                        if isinstance(exc, SQLAlchemyError) and not isinstance(exc, IntegrityError):
                            raise  # the database's failure, not this write's (a deadlock among them)
                        if not savepoints:
                            raise _Failed(index, exc) from exc
                        refused[index] = exc  # rolled back to its savepoint: nothing of it stays
                    # Each write sees the database, not the ORM objects an earlier one loaded.
                    session.expunge_all()
                    results.append(result)
        except _Failed as failed:
            self._deliver(group[failed.index], None, failed.error)
            rest = group[: failed.index] + group[failed.index + 1 :]
            if rest:
                with self._lock:
                    self.retried += 1
                self._commit(rest, retry=retry, savepoints=True)
            return
        except Exception as exc:
            # Not one write's doing: a deadlock (tried once more), or the database failing (an outage,
            # the pool, COMMIT itself): every write of the group gets the error, and none is rerun
            # alone, which after a COMMIT that did land would refuse it as a replay.
            if retry and _retryable(exc):
                with self._lock:
                    self.retried += 1
                self._commit(group, retry=False, savepoints=savepoints)
                return
            for write in group:
                self._deliver(write, None, exc)
            return
        for index, (write, result) in enumerate(zip(group, results, strict=True)):
            self._deliver(write, result, refused.get(index))

    @staticmethod
    def _deliver(write: _Write[Any], result: Any, error: BaseException | None) -> None:
        try:
            write.loop.call_soon_threadsafe(_resolve, write.future, result, error)
        except RuntimeError:  # the request's event loop has closed (shutdown): nobody to answer
            log.debug("group commit: a write's event loop closed before its answer")
