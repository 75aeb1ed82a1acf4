"""Group commit (verifier.groupcommit): queued writes share one transaction, each answered only
after it committed, and one write's failure costs its neighbours nothing and leaves no trace."""

import asyncio
import threading

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from neuroshard.protocol.refusal import Refused
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database
from neuroshard.verifier.groupcommit import GroupCommit


def _nonce(nonce: str, *, refuse: bool = False):  # type: ignore[no-untyped-def]
    def write(session: Session) -> str:
        session.add(m.Nonce(public_key="ab" * 32, nonce=nonce, expires_at=1.0))
        session.flush()
        if refuse:
            raise Refused("conflict", f"{nonce} refused after its write")
        return nonce

    return write


def _stored(db: Database) -> set[str]:
    with db.read() as session:
        return set(session.scalars(select(m.Nonce.nonce)))


async def _burst(writer: GroupCommit, db: Database, writes: dict[str, bool]) -> dict[str, object]:
    """Hold the writer on a first write, queue `writes` behind it, then let it go: they form a group."""
    entered, release = threading.Event(), threading.Event()

    def hold(session: Session) -> None:
        entered.set()
        release.wait(10)

    first = asyncio.ensure_future(writer.submit(hold, key="0"))
    await asyncio.to_thread(entered.wait, 10)
    tasks = {n: asyncio.ensure_future(writer.submit(_nonce(n, refuse=r), key=n)) for n, r in writes.items()}
    await asyncio.sleep(0.05)  # every submit has queued its write
    assert not any(t.done() for t in tasks.values())
    release.set()
    await first
    outcomes: dict[str, object] = {}
    for name, task in tasks.items():
        try:
            outcomes[name] = await task
        except Refused as exc:
            outcomes[name] = exc
        # Answered only once committed: a separate session already sees what succeeded.
        assert (name in _stored(db)) == (outcomes[name] == name)
    return outcomes


def test_queued_writes_commit_as_one_group(db: Database) -> None:
    writer = GroupCommit(db, writers=1)
    writer.start()
    try:
        outcomes = asyncio.run(_burst(writer, db, {f"n{i}": False for i in range(10)}))
    finally:
        writer.close()
    assert outcomes == {f"n{i}": f"n{i}" for i in range(10)}
    assert writer.groups == 2 and writer.retried == 0  # the held write, then all ten together
    assert _stored(db) == {f"n{i}" for i in range(10)}


def test_a_refused_write_leaves_no_trace_and_costs_its_group_nothing(db: Database) -> None:
    writer = GroupCommit(db, writers=1)
    writer.start()
    try:
        outcomes = asyncio.run(_burst(writer, db, {"a": False, "b": True, "c": False, "d": True}))
    finally:
        writer.close()
    assert outcomes["a"] == "a" and outcomes["c"] == "c"
    assert isinstance(outcomes["b"], Refused) and isinstance(outcomes["d"], Refused)
    assert _stored(db) == {"a", "c"}  # the refused writes' rows were rolled back with them
    assert writer.retried == 1


def test_a_constraint_failure_in_a_group_is_that_write_alone(db: Database) -> None:
    """A duplicate key aborts a PostgreSQL transaction: the group is rerun one write at a time."""
    writer = GroupCommit(db)
    writer.start()

    async def run() -> list[object]:
        await writer.submit(_nonce("x"), key="x")
        return await asyncio.gather(
            writer.submit(_nonce("y"), key="y"), writer.submit(_nonce("x"), key="x"), return_exceptions=True
        )

    try:
        y, again = asyncio.run(run())
    finally:
        writer.close()
    assert y == "y" and "IntegrityError" in type(again).__name__
    with db.read() as session:
        assert session.scalar(select(func.count()).select_from(m.Nonce)) == 2


def test_close_finishes_what_is_queued_and_submit_needs_a_started_writer(db: Database) -> None:
    writer = GroupCommit(db)
    with pytest.raises(RuntimeError, match="before start"):
        asyncio.run(writer.submit(_nonce("z"), key="z"))
    writer.start()

    async def run() -> str:
        task = asyncio.ensure_future(writer.submit(_nonce("z"), key="z"))
        await asyncio.sleep(0)
        await asyncio.to_thread(writer.close)
        return await task

    assert asyncio.run(run()) == "z" and _stored(db) == {"z"}
    with pytest.raises(ValueError, match="max_group"):
        GroupCommit(db, max_group=0)
    with pytest.raises(ValueError, match="writers"):
        GroupCommit(db, writers=0)
