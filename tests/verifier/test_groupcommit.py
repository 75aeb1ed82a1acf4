"""Group commit (verifier.groupcommit): queued writes share one transaction, each answered only
after it committed, and one write's failure costs its neighbours nothing and leaves no trace."""

import asyncio
import threading
from collections.abc import Callable

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.reports import HeartbeatRequest
from neuroshard.protocol.signing import SignedBy
from neuroshard.verifier import ledger
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database
from neuroshard.verifier.groupcommit import GroupCommit
from tests.verifier.test_ledger import CFG, GOOD, NOW, receipt, register_all, theta, who


def _nonce(nonce: str, *, refuse: bool = False, outage: bool = False) -> Callable[[Session], str]:
    def write(session: Session) -> str:
        session.add(m.Nonce(public_key="ab" * 32, nonce=nonce, expires_at=1.0))
        session.flush()
        if refuse:
            raise Refused("conflict", f"{nonce} refused after its write")
        if outage:
            raise OperationalError("INSERT ...", {}, ConnectionError("the database went away"))
        return nonce

    return write


def _stored(db: Database) -> set[str]:
    with db.read() as session:
        return set(session.scalars(select(m.Nonce.nonce)))


async def _burst(
    writer: GroupCommit, db: Database, writes: dict[str, Callable[[Session], str]]
) -> dict[str, object]:
    """Hold the writer on a first write, queue `writes` behind it, then let it go: they form a group."""
    before = _stored(db)
    entered, release = threading.Event(), threading.Event()

    def hold(session: Session) -> None:
        entered.set()
        release.wait(10)

    first = asyncio.ensure_future(writer.submit(hold, key="0"))
    await asyncio.to_thread(entered.wait, 10)
    tasks = {n: asyncio.ensure_future(writer.submit(work, key=n)) for n, work in writes.items()}
    await asyncio.sleep(0.05)  # every submit has queued its write
    assert not any(t.done() for t in tasks.values())
    release.set()
    await first
    outcomes: dict[str, object] = {}
    for name, task in tasks.items():
        try:
            outcomes[name] = await task
        except Exception as exc:
            outcomes[name] = exc
        # Answered only once committed: a separate session already sees what succeeded.
        assert (name in _stored(db) - before) == (outcomes[name] == name)
    return outcomes


def test_queued_writes_commit_as_one_group(db: Database) -> None:
    writer = GroupCommit(db, writers=1)
    writer.start()
    try:
        outcomes = asyncio.run(_burst(writer, db, {f"n{i}": _nonce(f"n{i}") for i in range(10)}))
    finally:
        writer.close()
    assert outcomes == {f"n{i}": f"n{i}" for i in range(10)}
    assert writer.groups == 2 and writer.retried == 0  # the held write, then all ten together
    assert _stored(db) == {f"n{i}" for i in range(10)}


def test_a_refused_write_leaves_no_trace_and_costs_its_group_nothing(db: Database) -> None:
    writer = GroupCommit(db, writers=1)
    writer.start()
    try:
        writes = {
            "a": _nonce("a"),
            "b": _nonce("b", refuse=True),
            "c": _nonce("c"),
            "d": _nonce("d", refuse=True),
        }
        outcomes = asyncio.run(_burst(writer, db, writes))
    finally:
        writer.close()
    assert outcomes["a"] == "a" and outcomes["c"] == "c"
    assert isinstance(outcomes["b"], Refused) and isinstance(outcomes["d"], Refused)
    assert _stored(db) == {"a", "c"}  # the refused writes' rows were rolled back with them
    # The held write, then a-b-c-d (b raises), then a-c-d with a savepoint each (d rolls back
    # to its own): one rerun for the group, not one per refusal or per neighbour.
    assert writer.groups == 3 and writer.retried == 1


def test_a_constraint_failure_in_a_group_is_that_write_alone(db: Database) -> None:
    """A duplicate key aborts a PostgreSQL transaction: the group is committed again without it."""
    writer = GroupCommit(db, writers=1)
    writer.start()
    try:
        asyncio.run(writer.submit(_nonce("x"), key="x"))
        outcomes = asyncio.run(_burst(writer, db, {"w": _nonce("w"), "x": _nonce("x"), "y": _nonce("y")}))
    finally:
        writer.close()
    assert outcomes["w"] == "w" and outcomes["y"] == "y"
    assert isinstance(outcomes["x"], IntegrityError)
    assert _stored(db) == {"w", "x", "y"} and writer.retried == 1


def test_a_database_failure_goes_to_the_whole_group_and_nothing_is_rerun(db: Database) -> None:
    """Not one write's doing (here a write sees the connection fail): every write of the group gets
    the error and none is rerun alone, which after a COMMIT that landed would refuse it as a replay."""
    writer = GroupCommit(db, writers=1)
    writer.start()
    try:
        outcomes = asyncio.run(_burst(writer, db, {"p": _nonce("p"), "q": _nonce("q", outage=True)}))
    finally:
        writer.close()
    assert all(isinstance(o, OperationalError) for o in outcomes.values())
    assert _stored(db) == set() and writer.retried == 0


def test_close_finishes_what_is_queued_and_refuses_what_comes_after(db: Database) -> None:
    writer = GroupCommit(db, writers=1)
    with pytest.raises(RuntimeError, match="before start"):
        asyncio.run(writer.submit(_nonce("z"), key="z"))
    writer.start()
    entered, release = threading.Event(), threading.Event()

    def hold(session: Session) -> str:
        entered.set()
        release.wait(10)
        return "held"

    async def run() -> list[str]:
        held = asyncio.ensure_future(writer.submit(hold, key="0"))
        await asyncio.to_thread(entered.wait, 10)
        queued = [asyncio.ensure_future(writer.submit(_nonce(n), key=n)) for n in ("q1", "q2", "q3")]
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(asyncio.to_thread(writer.close))
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="after close"):
            await writer.submit(_nonce("late"), key="late")
        release.set()
        await closing
        return [await task for task in (held, *queued)]

    assert asyncio.run(run()) == ["held", "q1", "q2", "q3"]
    assert _stored(db) == {"q1", "q2", "q3"}
    with pytest.raises(ValueError, match="max_group"):
        GroupCommit(db, max_group=0)
    with pytest.raises(ValueError, match="writers"):
        GroupCommit(db, writers=0)


def test_real_writes_in_one_group_keep_their_own_outcomes(db: Database) -> None:
    """The ledger's own heartbeats and receipts, grouped: a stranger's heartbeat, a replayed nonce
    and a conflicting receipt are refused and leave no nonce; their neighbours are stored."""
    register_all(db, GOOD)
    a, b, c = GOOD
    stranger = Wallet.from_token("never-registered")
    replayed = who(b)

    def beat(signed: SignedBy) -> Callable[[Session], str]:
        def write(session: Session) -> str:
            ledger.use_nonce(session, signed, window_s=60)
            ledger.heartbeat(
                session, signed, HeartbeatRequest(stage=0, round=1, steps_in_round=2), now=NOW, cfg=CFG
            )
            return "alive"

        return write

    def send(signed: SignedBy, result: str) -> Callable[[Session], str]:
        def write(session: Session) -> str:
            ledger.use_nonce(session, signed, window_s=60)
            return ledger.submit_receipt(
                session, signed, receipt(0, result), body_sha256=result, now=NOW, cfg=CFG
            )

        return write

    asyncio.run(_run_alone(db, beat(replayed)))  # b's nonce is used once already
    writer = GroupCommit(db, writers=1)
    writer.start()
    try:
        writes = {
            "1-a-beat": beat(who(a)),
            "2-stranger": beat(who(stranger)),
            "3-a-receipt": send(who(a), theta(0)),
            "4-b-replay": beat(replayed),
            "5-c-receipt": send(who(c), theta(0)),
            "6-c-conflict": send(who(c), theta(0, honest=False)),
        }
        outcomes = asyncio.run(_burst(writer, db, writes))
    finally:
        writer.close()
    assert outcomes["1-a-beat"] == "alive"
    assert outcomes["3-a-receipt"] == outcomes["5-c-receipt"] == "recorded"
    refused = {name: o.code for name, o in outcomes.items() if isinstance(o, Refused)}
    assert set(refused) == {"2-stranger", "4-b-replay", "6-c-conflict"}, outcomes
    with db.read() as session:
        keys = {k for (k,) in session.execute(select(m.Nonce.public_key))}
        receipts = set(session.scalars(select(m.Receipt.wallet_id)))
    assert stranger.public_key_hex not in keys  # the refused heartbeat's nonce went with it
    assert receipts == {a.wallet_id, c.wallet_id}


async def _run_alone(db: Database, work: Callable[[Session], str]) -> None:
    writer = GroupCommit(db, writers=1)
    writer.start()
    try:
        await writer.submit(work, key="0")
    finally:
        await asyncio.to_thread(writer.close)
