"""The end of a pipeline run: a driver's signed `PipelineEnd` ends the later stage's replicas it fed,
and nothing else does (a stranger's end, another stage's, another wallet's, a forged one; a sender
still live)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from neuroshard.node.p2p.peers import PeerTable
from neuroshard.node.p2p.pipeline import PipelineClient
from neuroshard.node.p2p.pipeline_wire import encode_activations
from neuroshard.node.p2p.upstream import Upstream
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.peer import PeerRecord
from neuroshard.protocol.pipeline import END, PipelineEnd
from neuroshard.protocol.signing import sign_request
from tests.node.p2p.test_pipeline import PIPE, Served, _micro_batch, _serve, _signed


@pytest_asyncio.fixture
async def fed(make_node, wallets) -> AsyncIterator[Served]:  # type: ignore[no-untyped-def]
    """A stage-1 replica on loopback with its worker running (test_pipeline's)."""
    async with _serve(make_node(wallets[0], stage=1), wallets[0]) as (replica, _):
        yield replica


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _end(wallet: Wallet, stage: int = 0, round_: int = 6, step: int = 60) -> PipelineEnd:
    return PipelineEnd.create(wallet, stage=stage, round=round_, step=step)


def test_upstream_is_over_when_every_recent_sender_ended(wallets) -> None:
    clock = Clock()
    up = Upstream(ttl_s=100.0, clock=clock)
    a, b = (w.public_key_hex for w in wallets[:2])
    assert up.over() is None  # nobody sent, nobody ended: wait
    up.sent(a)
    up.sent(b)
    up.ended(_end(wallets[0]))
    assert up.over() is None  # b still sends
    up.ended(_end(wallets[1], round_=7, step=70))
    reason = up.over()
    assert reason is not None and "2 replica(s) of stage 0" in reason and "round 7, step 70" in reason
    up.sent(a)  # a restarted and sends again: live
    assert up.over() is None


def test_a_sender_silent_for_ttl_no_longer_holds_the_end_up(wallets) -> None:
    clock = Clock()
    up = Upstream(ttl_s=100.0, clock=clock)
    up.sent(wallets[0].public_key_hex)
    up.sent(wallets[1].public_key_hex)  # this one will vanish without a word
    clock.now += 50.0
    assert up.ended(_end(wallets[0]))
    assert up.over() is None
    clock.now += 51.0
    assert up.over() is not None  # wallet 1 quiet for 101 s; wallet 0's end still counts


def test_only_a_recent_sender_can_end_a_replica(wallets) -> None:
    """A stranger's end, or one from a sender gone quiet for ttl, is not recorded: an idle replica
    cannot be ended by anyone who holds a key."""
    clock = Clock()
    up = Upstream(ttl_s=100.0, clock=clock)
    assert not up.ended(_end(wallets[2]))  # never sent anything here
    assert up.over() is None
    up.sent(wallets[0].public_key_hex)
    clock.now += 101.0
    assert not up.ended(_end(wallets[0]))  # its last micro-batch is older than ttl
    assert up.over() is None


def test_the_tables_stay_bounded_whatever_a_flood_of_wallets_sends(wallets) -> None:
    clock = Clock()
    up = Upstream(ttl_s=100.0, clock=clock, max_senders=8)
    for i in range(100):
        up.sent(f"{i:064x}")
    assert len(up._last_sent) == 8 and f"{99:064x}" in up._last_sent and f"{0:064x}" not in up._last_sent
    for w in wallets[:3]:
        up.sent(w.public_key_hex)
        assert up.ended(_end(w))
    assert len(up._ended) == 3 and len(up._last_sent) <= 8


async def _post_end(replica: Served, sender: Wallet, body: bytes) -> tuple[int, str]:
    headers = dict(sign_request(sender, "POST", END, body, time.time()))
    async with replica.session.post(replica.server.make_url(END), data=body, headers=headers) as r:
        return r.status, (await r.read()).decode()


@pytest.mark.asyncio
async def test_the_end_route_refuses_what_is_not_a_valid_end_from_the_stage_before(fed, wallets) -> None:
    driver, other = wallets[1], wallets[2]
    forged = json.loads(_end(driver).to_json())
    forged["step"] = 61  # the signature no longer covers it
    cases = [
        (other, _end(driver).to_json(), 422, "not_own"),
        (driver, json.dumps(forged).encode(), 422, "bad_end_signature"),
        (driver, _end(driver, stage=1).to_json(), 422, "wrong_stage"),
        (driver, b"{not json", 400, "malformed"),
    ]
    got, text = await _post_end(fed, driver, _end(driver).to_json())
    assert (got, json.loads(text)["error"]) == (409, "not_a_sender"), text  # it sent nothing here yet
    hidden, labels = _micro_batch(7)
    body = encode_activations(hidden, labels, PIPE.codec)
    status, _, _ = await fed.send(driver, body, _signed(driver, body, micro_batch="07" * 16))
    assert status == 200
    for sender, body, status, code in cases:
        got, text = await _post_end(fed, sender, body)
        assert (got, json.loads(text)["error"]) == (status, code), text
    assert not fed.service.upstream._ended  # nothing refused changed anything
    assert await _post_end(fed, driver, _end(driver).to_json()) == (204, "")
    assert fed.service.upstream.over() is not None


@pytest.mark.asyncio
async def test_a_driver_ends_the_replica_it_fed_and_the_worker_ends_without_a_signal(fed, wallets) -> None:
    driver = wallets[1]
    now = time.time()
    table = PeerTable(own_wallet=driver.public_key_hex, ttl_s=60.0, ban_after=3, ban_s=30.0)
    table.merge([PeerRecord.create(fed.wallet, address=fed.address, stage=1, last_seen=now)], now)
    client = PipelineClient(
        wallet=driver, stage=0, peers=table, config=PIPE, clock=time.time, log=lambda line: None,
        stop=threading.Event(),
    )  # fmt: skip
    await client.start()
    try:
        assert await client.end(0, 0) == (0, 0)  # it fed nobody yet: nobody to tell
        hidden, labels = _micro_batch(5)
        await client.forward(hidden, labels, round_=0, micro_batch="05" * 16)
        assert fed.service.upstream.over() is None  # fed, not ended
        fed.worker.upstream_over = fed.service.upstream.over
        assert await client.end(0, 1) == (1, 1)
    finally:
        await client.close()
    deadline = time.monotonic() + 10.0
    while fed.worker.ended_because is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert fed.worker.ended_because is not None and "1 replica(s) of stage 0" in fed.worker.ended_because
    assert fed.worker.diloco.step == 1  # it trained what it was sent, then ended
