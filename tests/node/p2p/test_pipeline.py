"""The pipeline transport: next-stage routing, retry after failure, and a forward route that
refuses bad micro-batches with a 4xx before they reach the model.

An in-process aiohttp server on loopback serving a real last stage (a `StageWorker` on its
own thread); requests are signed with the real signing code, then broken on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pickle
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import pytest_asyncio
import torch
from aiohttp import ClientSession, test_utils
from safetensors.torch import save as st_save

from neuroshard.node import actcodec
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.membership import Neighbours, StageRoster
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.p2p.pipeline import (
    BLAME_BAN_DOUBLINGS,
    BLAME_MEMORY_S,
    DISPUTE_ROUNDS,
    OUTSIDER_RETRY_S,
    Job,
    NextStageRouter,
    NotListed,
    PipelineClient,
    PipelineConfig,
    PipelineService,
    PipelineUnavailable,
)
from neuroshard.node.p2p.pipeline_wire import decode_gradient, encode_activations
from neuroshard.node.p2p.server import NodeState, build_app
from neuroshard.node.pipeline import NonFiniteStep, driver_inner_step, remote_loss
from neuroshard.node.segments import SegmentConfig, SegmentRecorder
from neuroshard.node.stage_worker import StageWorker, WorkerConfig
from neuroshard.node.vocab import vocab_cap
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.peer import ErrorReply, PeerRecord
from neuroshard.protocol.pipeline import (
    ACTIVATION_HEADER,
    FORWARD,
    REPLY_HEADER,
    ActivationHeader,
    GradientReply,
    micro_batch_id,
)
from neuroshard.protocol.reports import MAX_DISPUTES, Dispute
from neuroshard.protocol.signing import sign_request

MODEL = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_dim=32, max_seq_len=16)
B, T = 2, 8
PIPE = PipelineConfig(
    num_stages=2, max_batch=4, request_timeout_s=5.0, deadline_s=5.0, ban_s=30.0, audit_rate=0.0,
    probation_audit_rate=0.0,
)  # fmt: skip
"""No audits (the tests of audits set them): a test counts each replica's steps."""


# --- the router, no I/O -------------------------------------------------------------------


def test_ranking_puts_measured_peers_by_throughput_and_new_peers_at_the_back() -> None:
    router = NextStageRouter(ban_s=10.0, busy_s=1.0)
    router.succeeded("slow", tokens=100, seconds=1.0)
    router.succeeded("fast", tokens=1000, seconds=1.0)
    assert router.ranking(["fast", "slow", "new1", "new2"], now=0.0) == ["fast", "slow", "new1", "new2"]
    # Arrival order among the unmeasured, whatever order the peer table lists them in.
    assert router.ranking(["new2", "slow", "new1", "fast"], now=0.0) == ["fast", "slow", "new1", "new2"]
    router.succeeded("new2", tokens=5000, seconds=1.0)
    assert router.ranking(["fast", "slow", "new1", "new2"], now=0.0)[0] == "new2"


def test_choice_is_proportional_to_throughput_and_new_peers_get_the_slowest_weight() -> None:
    router = NextStageRouter(ban_s=10.0, busy_s=1.0, rng=random.Random(7))
    router.succeeded("a", tokens=300, seconds=1.0)
    router.succeeded("b", tokens=100, seconds=1.0)
    draws = [router.choose(["a", "b", "new"], now=0.0) for _ in range(5000)]
    share = {w: draws.count(w) / len(draws) for w in ("a", "b", "new")}
    # Weights 300 : 100 : 100 (new = slowest measured) -> 0.6 : 0.2 : 0.2.
    assert share["a"] == pytest.approx(0.6, abs=0.03)
    assert share["b"] == pytest.approx(0.2, abs=0.03)
    assert share["new"] == pytest.approx(0.2, abs=0.03)


def test_a_blamed_peer_is_banned_for_twice_as_long_at_each_blame_up_to_a_cap() -> None:
    router = NextStageRouter(ban_s=10.0, busy_s=1.0)
    router.succeeded("a", tokens=100, seconds=1.0)
    bans = [router.blamed("a", now=0.0) for _ in range(BLAME_BAN_DOUBLINGS + 3)]
    assert bans[:3] == [10.0, 20.0, 40.0] and bans[-1] == bans[-2] == 10.0 * 2**BLAME_BAN_DOUBLINGS
    assert router.throughput("a") is None  # forgotten, as after a failure
    router.succeeded("a", tokens=100, seconds=1.0)  # an answer later does not wipe the record
    assert router.blamed("a", now=0.0) == 10.0 * 2**BLAME_BAN_DOUBLINGS


def test_a_blame_long_after_the_last_ban_ended_starts_again_from_the_base_ban() -> None:
    router = NextStageRouter(ban_s=10.0, busy_s=1.0)
    assert [router.blamed("a", now=0.0) for _ in range(3)] == [10.0, 20.0, 40.0]
    # Blamed again right when its ban ends (a liar back at once): still doubling.
    assert router.blamed("a", now=40.0) == 80.0
    # Blamed again just within the memory after that ban (ends at 120): still doubling.
    assert router.blamed("a", now=120.0 + BLAME_MEMORY_S) == 160.0
    # An hour and more of no blame after its last ban: the record is wiped.
    last_end = 120.0 + BLAME_MEMORY_S + 160.0
    assert router.blamed("a", now=last_end + BLAME_MEMORY_S + 1.0) == 10.0


def test_a_failed_peer_is_banned_then_returns_at_the_back_and_busy_is_short() -> None:
    router = NextStageRouter(ban_s=10.0, busy_s=1.0)
    for w, rate in (("a", 300), ("b", 100)):
        router.succeeded(w, tokens=rate, seconds=1.0)
    router.ranking(["c"], now=0.0)  # c is seen (unmeasured)
    router.failed("a", now=100.0)
    assert router.ranking(["a", "b", "c"], now=105.0) == ["b", "c"]
    assert router.choose(["a"], now=105.0) is None
    # After the ban a is usable again, but its old measurement is gone: behind c.
    assert router.ranking(["a", "b", "c"], now=110.5) == ["b", "c", "a"]
    router.busy("b", now=200.0)
    assert router.ranking(["a", "b", "c"], now=200.5) == ["c", "a"]
    assert router.ranking(["a", "b", "c"], now=201.5)[0] == "b"


# --- a served last stage ------------------------------------------------------------------


@dataclass
class Served:
    node: NodeState
    worker: StageWorker
    service: PipelineService
    server: test_utils.TestServer
    session: ClientSession
    wallet: Wallet

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def send(
        self,
        sender: Wallet,
        body: bytes,
        header: ActivationHeader | str | None,
        *,
        signed_body: bytes | None = None,
    ) -> tuple[int, Any, bytes]:
        auth = sign_request(
            sender, "POST", FORWARD, body if signed_body is None else signed_body, time.time()
        )
        headers = dict(auth)
        if header is not None:
            headers[ACTIVATION_HEADER] = header if isinstance(header, str) else header.to_json().decode()
        async with self.session.post(self.server.make_url(FORWARD), data=body, headers=headers) as r:
            return r.status, r.headers, await r.read()

    def fingerprint(self) -> tuple[Any, ...]:
        d = self.worker.diloco
        return (d.step, d.round, [p.detach().clone() for p in d.params])


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[:2] == b[:2] and all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True))


def _micro_batch(seed: int = 0, batch: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, T, MODEL.dim, generator=g), torch.randint(
        0, MODEL.vocab_size, (batch, T), generator=g
    )


RECEIVER = Wallet.from_token("p2p-test-wallet-0")
"""`wallets[0]`, the receiving replica of most tests here."""


def _signed(sender: Wallet, body: bytes, **over: Any) -> ActivationHeader:
    values: dict[str, Any] = dict(
        to=RECEIVER.public_key_hex, micro_batch="ab" * 16, stage=1, round=0, batch=B, seq_len=T, dim=MODEL.dim, codec=PIPE.codec,
        payload_sha256=sha256_hex(body),
    )  # fmt: skip
    return ActivationHeader.create(sender, **{**values, **over})


@contextlib.asynccontextmanager
async def _serve(
    node: NodeState,
    wallet: Wallet,
    *,
    config: PipelineConfig = PIPE,
    run: bool = True,
    worker_type: type[StageWorker] = StageWorker,
    senders: Neighbours | None = None,
) -> AsyncIterator[tuple[Served, Callable[[], None]]]:
    """A last-stage replica on loopback, and a function that starts its worker (already started if `run`)."""
    torch.manual_seed(0)
    cfg = DiLoCoConfig(inner_steps=1000, warmup_steps=0, total_steps=1000)
    worker = worker_type(
        DiLoCo(build_stage(MODEL, 1, 2), cfg), WorkerConfig(log_every=1000), log=lambda s: None
    )
    service = PipelineService(
        wallet=wallet, stage=1, model_config=MODEL, config=config, worker=worker.jobs, senders=senders
    )
    server = test_utils.TestServer(build_app(node, window_s=60.0, extensions=[service]), host="127.0.0.1")
    await server.start_server()
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop, 0.01), daemon=True)
    if run:
        thread.start()
    try:
        async with ClientSession() as session:
            yield Served(node, worker, service, server, session, wallet), thread.start
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(10.0)
        await server.close()


@pytest_asyncio.fixture
async def served(make_node, wallets) -> AsyncIterator[Served]:  # type: ignore[no-untyped-def]
    async with _serve(make_node(wallets[0], stage=1), wallets[0]) as (s, _):
        yield s


@pytest.mark.asyncio
async def test_a_valid_micro_batch_is_trained_on_and_answered_with_a_signed_gradient(served, wallets) -> None:
    hidden, labels = _micro_batch()
    body = encode_activations(hidden, labels, PIPE.codec)
    status, headers, reply_body = await served.send(wallets[1], body, _signed(wallets[1], body))
    assert status == 200, reply_body
    reply = GradientReply.from_json(headers[REPLY_HEADER])
    assert reply.wallet == served.wallet.public_key_hex and reply.signature_valid()
    assert reply.micro_batch == "ab" * 16 and reply.payload_sha256 == sha256_hex(reply_body)
    grad = decode_gradient(reply_body, (B, T, MODEL.dim), PIPE.codec)
    assert grad.shape == (B, T, MODEL.dim) and grad.abs().sum() > 0
    assert 0 < reply.loss < 10 and served.worker.diloco.step == 1


def _pickle_body() -> bytes:
    return pickle.dumps({"hidden": torch.zeros(B, T, MODEL.dim)})


def _nan_body() -> bytes:
    """A NaN scale in the run's codec (an honest sender cannot encode NaN: encoding refuses it)."""
    hidden, labels = _micro_batch()
    tensors = actcodec.encode(hidden, actcodec.codec(PIPE.codec).forward, "hidden")
    tensors["hidden.scales"][0, 0, 0] = float("nan")
    return st_save({**tensors, "labels": labels.int()})


def _bf16_body() -> bytes:
    return encode_activations(*_micro_batch(), "bf16")


def _bad_labels_body() -> bytes:
    hidden, labels = _micro_batch()
    labels[1, 3] = MODEL.vocab_size
    return encode_activations(hidden, labels, PIPE.codec)


def _fp16_body() -> bytes:
    return encode_activations(*_micro_batch(), "fp16")


def _good_body() -> bytes:
    return encode_activations(*_micro_batch(), PIPE.codec)


def _truncated_body() -> bytes:
    return _good_body()[:-10]


def _extra_tensor_body() -> bytes:
    hidden, labels = _micro_batch()
    return st_save({"hidden": hidden.bfloat16(), "labels": labels.int(), "extra": torch.zeros(1)})


BadCase = tuple[Callable[[], bytes], dict[str, Any], int, str]
BAD_CASES: dict[str, BadCase] = {
    "pickle": (_pickle_body, {}, 400, "malformed"),
    "truncated safetensors": (_truncated_body, {}, 400, "malformed"),
    "extra tensor": (_extra_tensor_body, {}, 400, "malformed"),
    "codec differs from header": (_fp16_body, {}, 400, "malformed"),
    "codec not the run's": (_bf16_body, {"codec": "bf16"}, 422, "wrong_codec"),
    "NaN scale": (_nan_body, {}, 422, "invalid"),
    "label out of vocabulary": (_bad_labels_body, {}, 422, "invalid"),
    "wrong stage": (_good_body, {"stage": 2}, 422, "wrong_stage"),
    "wrong width": (_good_body, {"dim": MODEL.dim * 2}, 422, "wrong_shape"),
    "too long": (_good_body, {"seq_len": MODEL.max_seq_len + 1}, 422, "wrong_shape"),
    "payload hash": (_good_body, {"payload_sha256": "00" * 32}, 422, "payload_mismatch"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(BAD_CASES))
async def test_bad_micro_batches_are_refused_with_no_state_change(served, wallets, case) -> None:
    make_body, over, status, code = BAD_CASES[case]
    body = make_body()
    before = served.fingerprint()
    got, _, reply = await served.send(wallets[1], body, _signed(wallets[1], body, **over))
    assert (got, ErrorReply.from_json(reply).error) == (status, code)
    await asyncio.sleep(0.05)  # a micro-batch that slipped through would be stepped on by now
    assert _same(served.fingerprint(), before)


@pytest.mark.asyncio
async def test_a_micro_batch_the_layers_overflow_on_is_refused_with_no_state_change(
    make_node, wallets
) -> None:  # type: ignore[no-untyped-def]
    """Finite on the wire, not through the layers: values near float32's limit, which int8 carries
    (a rotating codec, as the default is, refuses to encode them: their rotated sums pass it)."""
    config = replace(PIPE, codec="int8")
    async with _serve(make_node(wallets[0], stage=1), wallets[0], config=config) as (served, _):
        hidden, labels = _micro_batch()
        body = encode_activations(torch.full_like(hidden, 3e38), labels, "int8")
        before = served.fingerprint()
        got, _, reply = await served.send(wallets[1], body, _signed(wallets[1], body, codec="int8"))
        assert (got, ErrorReply.from_json(reply).error) == (422, "non_finite")
        await asyncio.sleep(0.05)  # a micro-batch that slipped through would be stepped on by now
        assert _same(served.fingerprint(), before)
        # The sender is struck: its next micro-batches are refused for ban_s (a middle replica
        # records each such step as failed, and a segment holds only so many); others are served.
        good = encode_activations(hidden, labels, "int8")
        got, _, reply = await served.send(
            wallets[1], good, _signed(wallets[1], good, codec="int8", micro_batch="cd" * 16)
        )
        assert (got, ErrorReply.from_json(reply).error) == (429, "struck")
        got, _, reply = await served.send(
            wallets[2], good, _signed(wallets[2], good, codec="int8", micro_batch="cd" * 16)
        )
        assert got == 200, reply


@pytest.mark.asyncio
async def test_degenerate_activations_are_refused_before_the_queue_and_strike_their_sender(
    make_node, wallets
) -> None:  # type: ignore[no-untyped-def]
    """A micro-batch with an all-zero position (node.pipeline.degenerate_problem) is refused with
    422 `degenerate_activations` before it is queued, and its sender is struck: zeros come out
    of a stage as zeros, and refused here they cannot reach a stage further down, whose honest
    next stage would take the blame for the overflow they cause there."""
    async with _serve(make_node(wallets[0], stage=1), wallets[0]) as (served, _):
        lines: list[str] = []
        served.service.log = lines.append
        hidden, labels = _micro_batch()
        hidden[-1, -2] = 0.0  # one position, in the last sequence
        body = encode_activations(hidden, labels, PIPE.codec)
        before = served.fingerprint()
        got, _, reply = await served.send(wallets[1], body, _signed(wallets[1], body))
        refusal = ErrorReply.from_json(reply)
        assert (got, refusal.error) == (422, "degenerate_activations") and "1 of" in refusal.detail
        assert len(lines) == 1 and "struck (1)" in lines[0] and "degenerate activations" in lines[0], lines
        await asyncio.sleep(0.05)  # a micro-batch that slipped through would be stepped on by now
        assert _same(served.fingerprint(), before)
        good = encode_activations(*_micro_batch(), PIPE.codec)
        got, _, reply = await served.send(wallets[1], good, _signed(wallets[1], good, micro_batch="cd" * 16))
        assert (got, ErrorReply.from_json(reply).error) == (429, "struck")
        got, _, reply = await served.send(wallets[2], good, _signed(wallets[2], good, micro_batch="cd" * 16))
        assert got == 200, reply


@pytest.mark.asyncio
async def test_a_sender_whose_activations_are_refused_as_degenerate_sends_them_nowhere_else(
    make_node, wallets
) -> None:  # type: ignore[no-untyped-def]
    """A 422 `degenerate_activations` is the bytes' fault, not the replica's: every replica would
    refuse them (and strike the sender), so the step fails at once as its sender's fault, and
    the replica that said so is not banned."""
    driver = wallets[1]
    hidden, labels = _micro_batch(3)
    hidden[1, 0] = 0.0
    async with (
        _serve(make_node(wallets[0], stage=1), wallets[0]) as (a, _),
        _serve(make_node(wallets[2], stage=1), wallets[2]) as (b, _),
    ):
        client, router = _client_of_two(driver, a, b, PIPE, lambda s: None)
        await client.start()
        try:
            with pytest.raises(NonFiniteStep, match="degenerate") as refused:
                await client.forward(
                    hidden, labels, round_=0, micro_batch=micro_batch_id(driver.public_key_hex, 0, 0)
                )
        finally:
            await client.close()
    assert not refused.value.gradient_at_fault and client.retries == 1
    assert (a.worker.diloco.step, b.worker.diloco.step) == (0, 0)
    assert router.ranking([a.wallet.public_key_hex], time.time()) == [a.wallet.public_key_hex]  # not banned


@pytest.mark.asyncio
async def test_header_problems_and_oversized_bodies_are_refused(served, wallets) -> None:
    body = _good_body()
    before = served.fingerprint()
    cases = [
        (await served.send(wallets[1], body, None), 400, "malformed"),  # no activation header
        (await served.send(wallets[1], body, "{not json"), 400, "malformed"),
        (await served.send(wallets[1], body, _signed(wallets[2], body)), 422, "not_own"),
        (  # signed for another replica: a header is one exchange's
            await served.send(wallets[1], body, _signed(wallets[1], body, to=wallets[3].public_key_hex)),
            422,
            "misdirected",
        ),
        (  # of another run: a wallet may train several, whose ids and rounds repeat
            await served.send(wallets[1], body, _signed(wallets[1], body, network="5e" * 32)),
            422,
            "another_run",
        ),
        (
            await served.send(
                wallets[1], body, replace(_signed(wallets[1], body), round=5).to_json().decode()
            ),
            422,
            "bad_activation_signature",
        ),
        (
            await served.send(wallets[1], body, _signed(wallets[1], body), signed_body=b"other"),
            401,
            "bad_signature",
        ),
    ]
    limit = served.service.body_limit("pipeline_forward")
    assert limit is not None
    huge = b"\0" * (limit + 1)
    cases.append((await served.send(wallets[1], huge, _signed(wallets[1], huge)), 413, "too_large"))
    for (status, _, reply), want_status, want_code in cases:
        assert (status, ErrorReply.from_json(reply).error) == (want_status, want_code)
    assert _same(served.fingerprint(), before)


@pytest.mark.asyncio
async def test_a_replica_in_its_outer_round_answers_503_and_changes_nothing(make_node, wallets) -> None:
    node = make_node(wallets[0], stage=1)
    in_round, release = threading.Event(), threading.Event()

    def slow_round(diloco: DiLoCo) -> None:
        in_round.set()
        release.wait(10.0)
        diloco.outer_step(diloco.pseudo_gradient())

    cfg = DiLoCoConfig(inner_steps=1, warmup_steps=0, total_steps=10)
    worker = StageWorker(
        DiLoCo(build_stage(MODEL, 1, 2), cfg),
        WorkerConfig(log_every=100),
        log=lambda s: None,
        finish_round=slow_round,
    )
    service = PipelineService(wallet=wallets[0], stage=1, model_config=MODEL, config=PIPE, worker=worker.jobs)
    server = test_utils.TestServer(build_app(node, window_s=60.0, extensions=[service]), host="127.0.0.1")
    await server.start_server()
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop, 0.01), daemon=True)
    thread.start()
    try:
        async with ClientSession() as session:
            s = Served(node, worker, service, server, session, wallets[0])
            body = _good_body()
            first, second = "01" * 16, "02" * 16
            assert (await s.send(wallets[1], body, _signed(wallets[1], body, micro_batch=first)))[0] == 200
            assert await asyncio.to_thread(in_round.wait, 5.0)
            before = s.fingerprint()
            status, _, reply = await s.send(wallets[1], body, _signed(wallets[1], body, micro_batch=second))
            assert (status, ErrorReply.from_json(reply).error) == (503, "busy")
            assert _same(s.fingerprint(), before) and worker.jobs.refused == 1
            release.set()
            await asyncio.sleep(0.1)
            # Refused, so not taken: the same id trains once the replica is back.
            assert (await s.send(wallets[1], body, _signed(wallets[1], body, micro_batch=second)))[0] == 200
            for _ in range(100):  # H=1: the second step closes round 1 right after its reply
                if worker.diloco.round == 2:
                    break
                await asyncio.sleep(0.02)
            assert (worker.diloco.step, worker.diloco.round) == (2, 2)
    finally:
        release.set()
        stop.set()
        thread.join(10.0)
        await server.close()


# --- the client: retry elsewhere, ban the failed peer -------------------------------------


def _dead_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"  # closed on exit: connections are refused


@pytest.mark.asyncio
async def test_a_failed_peer_is_banned_and_the_micro_batch_retried_elsewhere(served, wallets) -> None:
    from neuroshard.node.p2p.peers import PeerTable

    now = time.time()
    driver, dead = wallets[1], wallets[2]
    table = PeerTable(own_wallet=driver.public_key_hex, ttl_s=60.0, ban_after=3, ban_s=30.0)
    table.merge(
        [
            PeerRecord.create(dead, address=_dead_address(), stage=1, last_seen=now),
            PeerRecord.create(served.wallet, address=served.address, stage=1, last_seen=now),
        ],
        now,
    )
    router = NextStageRouter(ban_s=30.0, busy_s=0.2, rng=random.Random(1))
    router.succeeded(dead.public_key_hex, tokens=10**9, seconds=1.0)  # looks fastest: drawn first
    router.succeeded(served.wallet.public_key_hex, tokens=1, seconds=1.0)
    lines: list[str] = []
    client = PipelineClient(
        wallet=driver, stage=0, peers=table, config=PIPE, clock=time.time, log=lines.append,
        stop=threading.Event(), router=router,
    )  # fmt: skip
    await client.start()
    try:
        hidden, labels = _micro_batch(3)
        grad, loss = await client.forward(hidden, labels, round_=0, micro_batch="03" * 16)
    finally:
        await client.close()
    assert grad.shape == hidden.shape and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert loss > 0 and served.worker.diloco.step == 1
    assert client.retries == 1
    assert router.ranking([dead.public_key_hex, served.wallet.public_key_hex], time.time()) == [
        served.wallet.public_key_hex
    ]
    assert any("banned" in line and dead.public_key_hex[:12] in line for line in lines)


@pytest.mark.asyncio
async def test_with_no_reachable_next_stage_the_client_gives_up_at_its_deadline(wallets) -> None:
    from neuroshard.node.p2p.peers import PeerTable
    from neuroshard.node.p2p.pipeline import PipelineUnavailable

    now = time.time()
    table = PeerTable(own_wallet=wallets[1].public_key_hex, ttl_s=60.0, ban_after=3, ban_s=30.0)
    table.merge([PeerRecord.create(wallets[2], address=_dead_address(), stage=1, last_seen=now)], now)
    config = replace(PIPE, deadline_s=0.5)
    client = PipelineClient(
        wallet=wallets[1], stage=0, peers=table, config=config, clock=time.time, log=lambda s: None,
        stop=threading.Event(),
    )  # fmt: skip
    await client.start()
    started = time.monotonic()
    try:
        with pytest.raises(PipelineUnavailable, match="no replica of stage 1"):
            await client.forward(*_micro_batch(), round_=0, micro_batch="04" * 16)
    finally:
        await client.close()
    assert time.monotonic() - started < 5.0 and client.retries == 1


@pytest.mark.asyncio
async def test_a_driver_without_the_bucket_leaves_next_stage_replicas_behind_nat_out(wallets) -> None:
    """A replica behind NAT is reached through the stage bucket only (node.p2p.mailbox): a driver
    given no --relay never picks it (it would only time out on it), and says so at its deadline."""
    from neuroshard.node.p2p.peers import PeerTable
    from neuroshard.node.p2p.pipeline import PipelineUnavailable
    from neuroshard.node.p2p.relay import relay_address

    now = time.time()
    table = PeerTable(own_wallet=wallets[1].public_key_hex, ttl_s=60.0, ban_after=3, ban_s=30.0)
    nat = relay_address(wallets[2].public_key_hex)
    table.merge([PeerRecord.create(wallets[2], address=nat, stage=1, last_seen=now)], now)
    client = PipelineClient(
        wallet=wallets[1], stage=0, peers=table, config=replace(PIPE, deadline_s=0.3), clock=time.time,
        log=lambda s: None, stop=threading.Event(),
    )  # fmt: skip
    await client.start()
    try:
        with pytest.raises(PipelineUnavailable, match="0 known"):
            await client.forward(*_micro_batch(), round_=0, micro_batch="05" * 16)
    finally:
        await client.close()
    assert client.retries == 0 and client.sent_to == set()


# --- exactly once per replica ---------------------------------------------------------------


def test_a_micro_batch_id_names_driver_round_and_step() -> None:
    a, b = Wallet.from_token("driver-a").public_key_hex, Wallet.from_token("driver-b").public_key_hex
    ids = {micro_batch_id(w, r, n) for w in (a, b) for r in (0, 1) for n in (0, 1)}
    assert len(ids) == 8 and all(len(i) == 32 for i in ids)
    assert micro_batch_id(a, 3, 7) == micro_batch_id(a, 3, 7)  # a retry or a resumed driver: the same id


@pytest.mark.asyncio
async def test_a_retried_micro_batch_is_trained_once_and_answered_the_same(served, wallets) -> None:
    body = _good_body()
    header = _signed(wallets[1], body, micro_batch="0a" * 16)
    first = await served.send(wallets[1], body, header)
    again = await served.send(wallets[1], body, header)  # a new request (nonce), the same micro-batch
    assert first[0] == again[0] == 200
    assert first[2] == again[2] and first[1][REPLY_HEADER] == again[1][REPLY_HEADER]
    assert served.worker.diloco.step == 1 and served.service.duplicates == 1
    # Sent twice at once (the retry overtakes the first attempt): still one step.
    other = _signed(wallets[1], body, micro_batch="0b" * 16)
    both = await asyncio.gather(served.send(wallets[1], body, other), served.send(wallets[1], body, other))
    assert [r[0] for r in both] == [200, 200] and both[0][2] == both[1][2]
    assert served.worker.diloco.step == 2
    # The id is per sender: another driver's micro-batch with the same id is its own work.
    theirs = await served.send(wallets[2], body, _signed(wallets[2], body, micro_batch="0a" * 16))
    assert theirs[0] == 200 and served.worker.diloco.step == 3


@pytest.mark.asyncio
async def test_an_id_taken_with_another_payload_is_refused_409_and_changes_nothing(served, wallets) -> None:
    body = _good_body()
    assert (await served.send(wallets[1], body, _signed(wallets[1], body, micro_batch="0c" * 16)))[0] == 200
    before = served.fingerprint()
    other = encode_activations(*_micro_batch(seed=5), PIPE.codec)
    status, _, reply = await served.send(wallets[1], other, _signed(wallets[1], other, micro_batch="0c" * 16))
    assert (status, ErrorReply.from_json(reply).error) == (409, "micro_batch_reused")
    await asyncio.sleep(0.05)
    assert _same(served.fingerprint(), before)


@pytest.mark.asyncio
async def test_a_micro_batch_whose_reply_was_lost_is_not_trained_again(make_node, wallets) -> None:
    """The replica takes the micro-batch but answers 503 before it is stepped (its reply deadline
    passes while the worker is held back); the step happens later. The retry gets that step's
    gradient, and the replica stepped once."""
    config = replace(PIPE, request_timeout_s=0.3)
    async with _serve(make_node(wallets[0], stage=1), wallets[0], config=config, run=False) as (s, start):
        body = _good_body()
        header = _signed(wallets[1], body, micro_batch="0d" * 16)
        status, _, reply = await s.send(wallets[1], body, header)
        assert (status, ErrorReply.from_json(reply).error) == (503, "busy")
        start()
        for _ in range(200):
            if s.worker.diloco.step == 1:
                break
            await asyncio.sleep(0.01)
        status, headers, grad_body = await s.send(wallets[1], body, header)
        assert status == 200 and GradientReply.from_json(headers[REPLY_HEADER]).micro_batch == "0d" * 16
        assert decode_gradient(grad_body, (B, T, MODEL.dim), PIPE.codec).abs().sum() > 0
        await asyncio.sleep(0.05)
        assert s.worker.diloco.step == 1 and s.service.duplicates == 1


def _client_of_two(
    driver: Wallet,
    first: Served,
    second: Served,
    config: PipelineConfig,
    log: Callable[[str], None],
    segments: SegmentRecorder | None = None,
    receivers: Neighbours | None = None,
) -> tuple[PipelineClient, NextStageRouter]:
    """A driver's client that knows two stage-1 replicas, `first` measured as the faster (drawn
    first), and its router."""
    return _client_of(driver, [first, second], config, log, segments, receivers)


def _client_of(
    driver: Wallet,
    replicas: list[Served],
    config: PipelineConfig,
    log: Callable[[str], None],
    segments: SegmentRecorder | None = None,
    receivers: Neighbours | None = None,
) -> tuple[PipelineClient, NextStageRouter]:
    """A driver's client that knows these stage-1 replicas, the first measured as by far the
    fastest (drawn first), and its router; its audits drawn from a seeded generator."""
    from neuroshard.node.p2p.peers import PeerTable

    now = time.time()
    table = PeerTable(own_wallet=driver.public_key_hex, ttl_s=60.0, ban_after=3, ban_s=30.0)
    table.merge(
        [PeerRecord.create(r.wallet, address=r.address, stage=1, last_seen=now) for r in replicas], now
    )
    router = NextStageRouter(ban_s=30.0, busy_s=0.2, rng=random.Random(1))
    for i, r in enumerate(replicas):
        router.succeeded(r.wallet.public_key_hex, tokens=10**9 if i == 0 else 1, seconds=1.0)
    client = PipelineClient(
        wallet=driver, stage=0, peers=table, config=config, clock=time.time, log=log,
        stop=threading.Event(), router=router, segments=segments, receivers=receivers,
        audit_rng=random.Random(7),
    )  # fmt: skip
    return client, router


@pytest.mark.asyncio
async def test_a_driver_refused_409_sends_the_micro_batch_elsewhere_without_a_ban(make_node, wallets) -> None:  # type: ignore[no-untyped-def]

    driver = wallets[1]
    hidden, labels = _micro_batch(3)
    id_ = micro_batch_id(driver.public_key_hex, 0, 0)
    async with (
        _serve(make_node(wallets[0], stage=1), wallets[0]) as (a, _),
        _serve(make_node(wallets[2], stage=1), wallets[2]) as (b, _),
    ):
        # Replica a trained micro-batch 0 before the driver restarted and recomputed it differently.
        earlier = encode_activations(*_micro_batch(4), PIPE.codec)
        assert (await a.send(driver, earlier, _signed(driver, earlier, micro_batch=id_)))[0] == 200
        client, router = _client_of_two(driver, a, b, PIPE, lambda s: None)
        await client.start()
        try:
            grad, _ = await client.forward(hidden, labels, round_=0, micro_batch=id_)
        finally:
            await client.close()
    assert grad.abs().sum() > 0 and client.retries == 1
    assert (a.worker.diloco.step, b.worker.diloco.step) == (1, 1)
    # Not banned: a still ranks first for the next micro-batch.
    assert (
        router.ranking([a.wallet.public_key_hex, b.wallet.public_key_hex], time.time())[0]
        == a.wallet.public_key_hex
    )


@pytest.mark.asyncio
async def test_a_middle_replica_whose_id_every_replica_holds_with_another_payload_gives_up_at_once(
    make_node, wallets
) -> None:  # type: ignore[no-untyped-def]
    """Audits upstream make one driver id reach a middle replica from two senders; the next stage
    then holds it with the first one's payload. A middle replica refused 409 by every replica it may
    ask gives the micro-batch up at once (its sender goes elsewhere), rather than holding its
    worker until `deadline_s`."""
    driver = wallets[1]
    id_ = micro_batch_id(driver.public_key_hex, 0, 0)
    async with (
        _serve(make_node(wallets[0], stage=1), wallets[0]) as (a, _),
        _serve(make_node(wallets[2], stage=1), wallets[2]) as (b, _),
    ):
        earlier = encode_activations(*_micro_batch(4), PIPE.codec)
        for r in (a, b):
            header = _signed(driver, earlier, micro_batch=id_, to=r.wallet.public_key_hex)
            assert (await r.send(driver, earlier, header))[0] == 200
        client, _ = _client_of_two(driver, a, b, replace(PIPE, deadline_s=60.0), lambda s: None)
        await client.start()
        started = time.monotonic()
        try:
            with pytest.raises(
                PipelineUnavailable, match="already took its id with another payload, and no other is left"
            ):
                await client.forward(*_micro_batch(3), round_=0, micro_batch=id_, patient=False)
        finally:
            await client.close()
    assert time.monotonic() - started < 10.0 and client.retries == 2


def test_only_the_last_stage_bounds_labels_by_its_head_and_a_growth_moves_the_bound(wallets) -> None:
    jobs = StageWorker(
        DiLoCo(build_stage(MODEL, 1, 2), DiLoCoConfig(inner_steps=5)), WorkerConfig(), log=lambda s: None
    ).jobs
    last = PipelineService(wallet=wallets[0], stage=1, model_config=MODEL, config=PIPE, worker=jobs)
    assert last.label_bound == MODEL.vocab_size
    last.set_vocab(MODEL.vocab_size + 40)  # its head grew at a round boundary (node.vocab)
    assert last.label_bound == MODEL.vocab_size + 40
    three = dataclasses.replace(PIPE, num_stages=3)
    middle = PipelineService(wallet=wallets[0], stage=1, model_config=MODEL, config=three, worker=jobs)
    assert middle.label_bound == vocab_cap(MODEL.vocab_size)  # no rows: it passes a grown tokenizer's ids on


class _Overflowing(StageWorker):
    """A hostile last stage: it trains as an honest one but answers every micro-batch with a
    gradient of 3e38s, finite on the wire (bf16) and fatal to an honest driver's backward."""

    def _settle(self, job: Job, grad: torch.Tensor, loss: float, round_: int) -> None:
        super()._settle(job, torch.full_like(grad, 3e38), loss, round_)


@pytest.mark.asyncio
async def test_a_driver_bans_a_replica_whose_gradient_overflows_its_backward_and_trains_elsewhere(
    make_node, wallets
) -> None:  # type: ignore[no-untyped-def]
    """Over loopback: the driver's step refuses the hostile gradient (no NaN weights), the client
    bans its sender (doubling with each blame), the step does not list it as received, and the
    micro-batch's retry, the same bytes under the same id, is trained on by the honest replica."""

    config = replace(PIPE, codec="bf16")
    driver = wallets[1]
    async with (
        _serve(make_node(wallets[0], stage=1), wallets[0], config=config, worker_type=_Overflowing) as (
            bad,
            _,
        ),
        _serve(make_node(wallets[2], stage=1), wallets[2], config=config) as (good, _),
    ):
        recorder = SegmentRecorder(SegmentConfig(segment_steps=4), stage=0)
        lines: list[str] = []
        client, router = _client_of_two(driver, bad, good, config, lines.append, recorder)
        loop = asyncio.get_running_loop()
        id_ = micro_batch_id(driver.public_key_hex, 0, 0)

        def downstream(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
            return asyncio.run_coroutine_threadsafe(
                client.forward(hidden, labels, round_=0, micro_batch=id_), loop
            ).result(20.0)

        def blame(why: str) -> bool:
            return asyncio.run_coroutine_threadsafe(client.blame(id_, why), loop).result(5.0) is not None

        torch.manual_seed(0)
        stage0 = DiLoCo(
            build_stage(MODEL, 0, 2), DiLoCoConfig(inner_steps=1000, warmup_steps=0, total_steps=1000),
            loss_fn=remote_loss(downstream, blame),
        )  # fmt: skip
        recorder.start_round(stage0)
        tokens = torch.randint(0, MODEL.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(5))
        await client.start()
        try:
            await asyncio.to_thread(driver_inner_step, stage0, tokens[:, :-1], tokens[:, 1:])
            recorder.record_step(stage0, data=(0, 0, 1), micro_batch=id_)
        finally:
            await client.close()
    assert stage0.step == 1 and all(bool(torch.isfinite(p).all()) for p in stage0.model.parameters())
    assert (bad.worker.diloco.step, good.worker.diloco.step) == (1, 1) and client.blamed == 1
    assert router.ranking([bad.wallet.public_key_hex, good.wallet.public_key_hex], time.time()) == [
        good.wallet.public_key_hex
    ]
    assert any("overflows" in line and bad.wallet.public_key_hex[:12] in line for line in lines)
    current = recorder._current
    assert current is not None
    assert [m.sender for m in current.steps[0].received] == [good.wallet.public_key_hex]


class _Failing:
    """A `JobSink` whose every job fails with `outcome`: a worker whose step overflowed."""

    def __init__(self, outcome: BaseException) -> None:
        self.outcome = outcome
        self.dropped: list[str] = []

    def offer(self, job: Job) -> None:
        job.done(self.outcome)

    def drop(self, sender: str, reason: str) -> int:
        self.dropped.append(sender)
        return 0


@pytest.mark.parametrize(
    ("at_fault", "first", "then"),
    [(False, (422, "non_finite"), (429, "struck")), (True, (502, "downstream"), (502, "downstream"))],
    ids=["the-sender-s-activations", "the-next-stage-s-gradients"],
)
@pytest.mark.asyncio
async def test_an_overflowing_step_strikes_its_sender_only_when_the_sender_is_at_fault(
    make_node, wallets, at_fault, first, then
) -> None:  # type: ignore[no-untyped-def]
    """A step the next stage's gradients overflowed (MAX_BLAMED times: the worker gave up) is not
    the sender's doing: 502, which its client takes as busy (no ban), and no strike. One its own
    activations overflowed strikes it: 429 for ban_s, while a retry of an id already answered
    still gets its answer."""
    failing = _Failing(NonFiniteStep("overflow", gradient_at_fault=at_fault))
    service = PipelineService(
        wallet=wallets[0], stage=1, model_config=MODEL, config=PIPE, worker=failing
    )  # fmt: skip
    node = make_node(wallets[0], stage=1)
    server = test_utils.TestServer(build_app(node, window_s=60.0, extensions=[service]), host="127.0.0.1")
    await server.start_server()
    try:
        async with ClientSession() as session:
            served = Served(node, None, service, server, session, wallets[0])  # type: ignore[arg-type]
            body = encode_activations(*_micro_batch(), PIPE.codec)
            for expected, mb in ((first, "ab" * 16), (then, "cd" * 16)):
                got, _, reply = await served.send(wallets[1], body, _signed(wallets[1], body, micro_batch=mb))
                assert (got, ErrorReply.from_json(reply).error) == expected
    finally:
        await server.close()
    # A strike also answers the sender's jobs still waiting (each would be stepped on, and fail).
    assert failing.dropped == ([] if at_fault else [wallets[1].public_key_hex])


# --- membership: whom a replica works with -------------------------------------------------


def _listed(stage: int, *admitted: Wallet) -> Neighbours:
    neighbours = Neighbours(stage)
    neighbours.set(
        StageRoster(stage=stage, policy="allowlist", admitted=frozenset(w.public_key_hex for w in admitted))
    )
    return neighbours


@pytest.mark.asyncio
async def test_a_replica_takes_micro_batches_only_from_the_previous_stage_s_members(
    make_node, wallets
) -> None:  # type: ignore[no-untyped-def]
    senders = _listed(0, wallets[1])
    async with _serve(make_node(wallets[0], stage=1), wallets[0], senders=senders) as (served, _):
        body = encode_activations(*_micro_batch(), PIPE.codec)
        before = served.fingerprint()
        status, _, reply = await served.send(wallets[2], body, _signed(wallets[2], body))
        refusal = ErrorReply.from_json(reply)
        assert (status, refusal.error) == (
            403,
            "not_a_member",
        ) and "not on stage 0's member list" in refusal.detail
        assert _same(served.fingerprint(), before) and served.service.outsiders == 1
        # A member's micro-batch is taken; a list that drops the member later still answers a
        # retry of what it took, and refuses what it sends next.
        assert (await served.send(wallets[1], body, _signed(wallets[1], body)))[0] == 200
        senders.set(StageRoster(stage=0, policy="allowlist", admitted=frozenset({wallets[3].public_key_hex})))
        assert (await served.send(wallets[1], body, _signed(wallets[1], body)))[0] == 200
        other = encode_activations(*_micro_batch(1), PIPE.codec)
        status, _, _ = await served.send(wallets[1], other, _signed(wallets[1], other, micro_batch="cd" * 16))
        assert status == 403 and served.worker.diloco.step == 1


@pytest.mark.asyncio
async def test_a_micro_batch_from_off_the_list_is_refused_before_its_body_is_read(make_node, wallets) -> None:  # type: ignore[no-untyped-def]
    """Over HTTP the refusal comes on the wallet the headers claim, before the body is read: a
    sender streaming a large body slowly gets its 403 after a few of its chunks and stops, and
    the connection is closed rather than drained. A listed sender's body is read as before."""
    senders = _listed(0, wallets[1])
    chunks, sent = 40, []

    async with _serve(make_node(wallets[0], stage=1), wallets[0], senders=senders) as (served, _):
        limit = served.service.body_limit(PipelineService.ROUTE)
        assert limit is not None
        chunk = limit // chunks  # within the route's limit: only the list refuses it

        async def slow() -> AsyncIterator[bytes]:
            for i in range(chunks):
                sent.append(i)
                yield b"\0" * chunk
                await asyncio.sleep(0.05)

        body = b"\0" * (chunk * chunks)
        headers = dict(sign_request(wallets[2], "POST", FORWARD, body, time.time()))
        headers[ACTIVATION_HEADER] = _signed(wallets[2], body).to_json().decode()
        headers["Content-Length"] = str(len(body))
        url = served.server.make_url(FORWARD)
        async with served.session.post(url, data=slow(), headers=headers) as reply:
            status, refusal = reply.status, ErrorReply.from_json(await reply.read())
        assert (status, refusal.error) == (403, "not_a_member") and "member list" in refusal.detail
        assert len(sent) < chunks // 2, f"{len(sent)} of {chunks} chunks went out before the refusal"
        assert served.service.outsiders == 1
        good = encode_activations(*_micro_batch(), PIPE.codec)
        assert (await served.send(wallets[1], good, _signed(wallets[1], good)))[0] == 200


def _raw_head(sender: Wallet, length: int) -> bytes:
    """The head of a forward POST from `sender` declaring `length` body bytes, for a raw socket
    (its signature covers an empty body: these tests are about what happens before it is checked)."""
    headers = dict(sign_request(sender, "POST", FORWARD, b"", time.time()))
    headers[ACTIVATION_HEADER] = _signed(sender, b"").to_json().decode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"POST {FORWARD} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n{head}\r\n".encode()


@pytest.mark.parametrize("listed", [False, True], ids=["off-the-list", "over-the-limit"])
@pytest.mark.asyncio
async def test_a_body_refused_before_it_is_read_is_not_taken_in(make_node, wallets, listed) -> None:  # type: ignore[no-untyped-def]
    """A sender that keeps writing after a refusal given before its body was read (a claimed
    sender off the list; a declared size over the route's limit) is cut off: the connection
    closes, and no more than the sockets' buffers of its 64 MiB gets through, where aiohttp would
    read and drop all of it to keep the connection open."""
    senders = _listed(0, wallets[1])
    sender = wallets[1] if listed else wallets[2]
    size = 64 << 20
    async with _serve(make_node(wallets[0], stage=1), wallets[0], senders=senders) as (served, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", served.server.port)
        writer.write(_raw_head(sender, size))
        status = asyncio.ensure_future(reader.readline())  # read as it arrives, as a client does
        sent, chunk = 0, b"\0" * (1 << 20)
        try:
            while sent < size:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 5.0)
                sent += len(chunk)
        except (ConnectionError, TimeoutError):
            pass
        status_line = await asyncio.wait_for(status, 5.0)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        received = served.node.traffic.bytes_received
    assert status_line.split()[1] == (b"413" if listed else b"403"), status_line
    assert sent < size // 2, f"{sent >> 20} MiB of {size >> 20} went out after the refusal"
    # The node counts what reached it, not the length the head declared.
    assert received < size // 4, f"{received >> 20} MiB counted as received"


@pytest.mark.asyncio
async def test_a_sender_gone_mid_body_is_answered_quietly(make_node, wallets, caplog) -> None:  # type: ignore[no-untyped-def]
    """A listed sender that hangs up halfway through its body: the server refuses it (truncated)
    without an error of its own in the log, and goes on serving."""
    async with _serve(make_node(wallets[0], stage=1), wallets[0], senders=_listed(0, wallets[1])) as (
        served,
        _,
    ):
        limit = served.service.body_limit(PipelineService.ROUTE)
        assert limit is not None
        _reader, writer = await asyncio.open_connection("127.0.0.1", served.server.port)
        writer.write(_raw_head(wallets[1], limit))
        writer.write(b"\0" * (limit // 2))
        await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        await asyncio.sleep(0.3)  # the server reads the half body and finds the end
        body = encode_activations(*_micro_batch(), PIPE.codec)
        assert (await served.send(wallets[1], body, _signed(wallets[1], body)))[0] == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


@pytest.mark.asyncio
async def test_listed_probationers_hold_at_most_probation_pending_micro_batches(make_node, wallets) -> None:  # type: ignore[no-untyped-def]
    """Probationers' micro-batches beyond `probation_pending` held (waiting or in the step) are
    answered busy, whoever of them sends, and so are those beyond one probationer's share
    (`probation_per_sender`) while places are free; an admitted sender's are still taken, and once
    the held ones are answered a probationer's are taken again."""
    senders = Neighbours(0)
    senders.set(
        StageRoster(
            stage=0,
            policy="probation",
            admitted=frozenset({wallets[1].public_key_hex}),
            probation=frozenset({wallets[2].public_key_hex, wallets[3].public_key_hex}),
        )
    )
    config = replace(PIPE, probation_pending=2)
    node = make_node(wallets[0], stage=1)
    async with _serve(node, wallets[0], config=config, senders=senders, run=False) as (served, start):

        async def send(sender: Wallet, seed: int) -> tuple[int, str]:
            body = encode_activations(*_micro_batch(seed), PIPE.codec)
            status, _, reply = await served.send(
                sender, body, _signed(sender, body, micro_batch=f"{seed:032x}")
            )
            return status, "" if status == 200 else ErrorReply.from_json(reply).error

        async def held_reaches(count: int) -> None:
            for _ in range(200):  # queued: the worker is not running yet
                if served.service.probation_held == count:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"{served.service.probation_held} held, not {count}")

        held = [asyncio.ensure_future(send(wallets[2], 1))]
        await held_reaches(1)
        # One place is free, but not to the probationer that holds its share (one) already.
        assert await send(wallets[2], 6) == (503, "busy") and served.service.probation_busy == 1
        held.append(asyncio.ensure_future(send(wallets[3], 2)))
        await held_reaches(2)
        assert await send(wallets[3], 3) == (503, "busy") and served.service.probation_busy == 2
        admitted = asyncio.ensure_future(send(wallets[1], 4))
        start()
        assert await asyncio.gather(*held, admitted) == [(200, "")] * 3
        assert served.service.probation_held == 0
        assert await send(wallets[2], 5) == (200, "")
        assert served.worker.diloco.step == 4
    with pytest.raises(ValueError, match="probation_pending"):
        replace(PIPE, probation_pending=0)
    with pytest.raises(ValueError, match="probation_per_sender"):
        replace(PIPE, probation_per_sender=3)


@pytest.mark.asyncio
async def test_a_driver_offers_micro_batches_only_to_the_next_stage_s_members(make_node, wallets) -> None:  # type: ignore[no-untyped-def]
    driver = wallets[1]
    hidden, labels = _micro_batch(3)
    async with (
        _serve(make_node(wallets[0], stage=1), wallets[0]) as (a, _),
        _serve(make_node(wallets[2], stage=1), wallets[2]) as (b, _),
    ):
        # a is measured as far the faster, and is drawn first whenever it may be: it is off the list.
        client, _ = _client_of_two(driver, a, b, PIPE, lambda s: None, receivers=_listed(1, b.wallet))
        await client.start()
        try:
            for step in range(3):
                id_ = micro_batch_id(driver.public_key_hex, 0, step)
                await client.forward(hidden, labels, round_=0, micro_batch=id_)
        finally:
            await client.close()
        assert (a.worker.diloco.step, b.worker.diloco.step) == (0, 3) and client.retries == 0
        # With nobody on the list, nobody is offered it, and the error says why.
        nobody = replace(PIPE, deadline_s=0.3)
        client, _ = _client_of_two(driver, a, b, nobody, lambda s: None, receivers=_listed(1, wallets[3]))
        await client.start()
        try:
            with pytest.raises(PipelineUnavailable, match="2 not taken by the stage's member list"):
                await client.forward(
                    hidden, labels, round_=0, micro_batch=micro_batch_id(driver.public_key_hex, 0, 9)
                )
        finally:
            await client.close()


@pytest.mark.asyncio
async def test_a_sender_off_the_next_stage_s_lists_is_told_it_is_not_listed(make_node, wallets) -> None:  # type: ignore[no-untyped-def]
    """Refused as not a member by every next-stage replica: `NotListed` at its deadline (which a
    driver waits out, below), not a plain failure; each refusing replica is asked again after ban_s."""
    driver = wallets[1]
    hidden, labels = _micro_batch(3)
    lines: list[str] = []
    config = replace(PIPE, deadline_s=0.5)
    async with (
        _serve(make_node(wallets[0], stage=1), wallets[0], senders=_listed(0, wallets[3])) as (a, _),
        _serve(make_node(wallets[2], stage=1), wallets[2], senders=_listed(0, wallets[3])) as (b, _),
    ):
        client, router = _client_of_two(driver, a, b, config, lines.append)
        await client.start()
        try:
            with pytest.raises(
                NotListed, match="2 replica\\(s\\) of stage 1 do not take micro-batches from this one"
            ):
                await client.forward(
                    hidden, labels, round_=0, micro_batch=micro_batch_id(driver.public_key_hex, 0, 0)
                )
        finally:
            await client.close()
    assert (a.worker.diloco.step, b.worker.diloco.step) == (0, 0)
    assert sum("takes no micro-batch from this one" in line for line in lines) == 2
    assert router.ranking([a.wallet.public_key_hex, b.wallet.public_key_hex], time.time()) == []


def test_a_driver_not_yet_listed_waits_for_a_list_that_names_it(wallets) -> None:
    """`PipelineLink.downstream` (a driver's, patient) asks again while the next stage refuses it as
    not listed. (A stop during the wait ends the client's loop with "the node is stopping", which
    the trainer takes as the stop: tests/node/test_trainer.py.)"""
    from types import SimpleNamespace

    from neuroshard.node.p2p.stages import PipelineLink

    lines: list[str] = []
    refusals = [NotListed("2 replica(s) of stage 1 do not take micro-batches from this one")] * 2
    link = PipelineLink.__new__(PipelineLink)  # its network is not needed: `forward` is stood in for
    link.network, link.log, link.stop = SimpleNamespace(wallet=wallets[1]), lines.append, threading.Event()  # type: ignore[assignment]
    link.round_of, link.step_of = (lambda: 0), (lambda: 0)
    answer = (torch.zeros(B, T, MODEL.dim), 1.0)

    def forward(
        hidden: torch.Tensor, labels: torch.Tensor, micro_batch: str, *, patient: bool = False
    ) -> tuple[torch.Tensor, float]:
        assert patient  # a driver has nobody to hand the micro-batch back to
        if refusals:
            raise refusals.pop()
        return answer

    link.forward = forward  # type: ignore[method-assign]
    assert link.downstream(*_micro_batch()) is answer
    assert len(lines) == 2 and all("waiting for a member list that names this replica" in x for x in lines)


@pytest.mark.asyncio
async def test_not_listed_is_remembered_across_micro_batches_and_a_middle_replica_gives_up_at_once(
    make_node, wallets
) -> None:  # type: ignore[no-untyped-def]
    """A replica refused as not a member is skipped for OUTSIDER_RETRY_S, not banned; the next
    micro-batch, finding only such replicas, is `NotListed` at its deadline, not "nobody there".
    A middle replica (not patient) gives a micro-batch up at once when every replica refused it so."""
    hidden, labels = _micro_batch(3)
    async with (
        _serve(make_node(wallets[0], stage=1), wallets[0], senders=_listed(0, wallets[3])) as (a, _),
        _serve(make_node(wallets[2], stage=1), wallets[2], senders=_listed(0, wallets[3])) as (b, _),
    ):
        client, router = _client_of_two(wallets[1], a, b, replace(PIPE, deadline_s=0.3), lambda s: None)

        async def send(step: int, patient: bool = True) -> float:
            """Seconds until the micro-batch of `step` is `NotListed`."""
            started = time.monotonic()
            with pytest.raises(NotListed):
                id_ = micro_batch_id(wallets[1].public_key_hex, 0, step)
                await client.forward(hidden, labels, round_=0, micro_batch=id_, patient=patient)
            return time.monotonic() - started

        await client.start()
        try:
            assert await send(0) >= 0.3 and await send(1) >= 0.3
            assert router.throughput(a.wallet.public_key_hex) is not None  # not a failure: still measured
            for r in (a, b):  # their skips are over
                router.outsider(r.wallet.public_key_hex, time.time() - OUTSIDER_RETRY_S)
            assert await send(9, patient=False) < 0.3
        finally:
            await client.close()
    assert (a.worker.diloco.step, b.worker.diloco.step) == (0, 0)


def test_a_replica_behind_nat_reads_a_recent_sender_s_requests_whatever_its_list_says(wallets) -> None:
    """What `MailboxRoutes.refuses` leaves unread: a sender off the list, unless this replica took a
    micro-batch of it lately (a retry of it, or its end, is then read and answered as over HTTP)."""
    jobs = _Failing(NonFiniteStep("unused"))
    service = PipelineService(
        wallet=wallets[0], stage=1, model_config=MODEL, config=PIPE, worker=jobs, senders=_listed(0, wallets[3])
    )  # fmt: skip
    refuses = service.mailbox().refuses
    assert refuses is not None
    assert refuses(wallets[3].public_key_hex) is None
    why = refuses(wallets[1].public_key_hex)
    assert why is not None and "not on stage 0's member list" in why
    service.upstream.sent(wallets[1].public_key_hex)  # it sent a micro-batch before the list dropped it
    assert refuses(wallets[1].public_key_hex) is None
    open_service = PipelineService(wallet=wallets[0], stage=1, model_config=MODEL, config=PIPE, worker=jobs)
    assert open_service.mailbox().refuses is None


# --- audits: a share of the answers checked against another replica's ------------------------


class _Negating(StageWorker):
    """A hostile last stage: it trains as an honest one but answers with the gradient negated
    (finite, of the right size, and harmful: the sender's step climbs the loss)."""

    def _settle(self, job: Job, grad: torch.Tensor, loss: float, round_: int) -> None:
        super()._settle(job, -grad, loss, round_)


AUDITED = replace(PIPE, audit_rate=1.0, probation_audit_rate=1.0)


def _assert_disputed(
    dispute: Dispute, micro_batch: str, driver: Wallet, first: Served, repliers: list[Served]
) -> None:
    """`dispute` names `micro_batch` with one reply from each of `repliers`, `first`'s first (the
    answer the audit checked), each as its replica signed it to the driver."""
    assert dispute.micro_batch == micro_batch
    assert dispute.replies[0].wallet == first.wallet.public_key_hex
    assert sorted(r.wallet for r in dispute.replies) == sorted(s.wallet.public_key_hex for s in repliers)
    assert all(r.signature_valid() for r in dispute.replies)
    assert {(r.to, r.stage, r.micro_batch) for r in dispute.replies} == {
        (driver.public_key_hex, 1, micro_batch)
    }


def _honest_gradient(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What an honest replica of `_serve` (same seed, no step yet) answers, both ways through the codec."""
    from neuroshard.node.p2p.pipeline_wire import decode_activations_as, encode_gradient
    from neuroshard.node.pipeline import stage_inner_step

    body = encode_activations(hidden, labels, PIPE.codec)
    hidden, labels = decode_activations_as(body, tuple(hidden.shape), PIPE.codec, MODEL.vocab_size)
    torch.manual_seed(0)
    cfg = DiLoCoConfig(inner_steps=1000, warmup_steps=0, total_steps=1000)
    grad, _ = stage_inner_step(DiLoCo(build_stage(MODEL, 1, 2), cfg), hidden, labels, None)
    return decode_gradient(encode_gradient(grad, PIPE.codec), tuple(grad.shape), PIPE.codec)


@pytest.mark.asyncio
async def test_an_audit_outvotes_a_negated_answer_uses_an_honest_one_and_bans_its_sender(
    make_node, wallets
) -> None:  # type: ignore[no-untyped-def]
    """The hostile replica answers at once (measured far the fastest, drawn first); the audit asks
    the two honest ones, both disagree with it and agree with each other: the step gets an honest
    gradient, the step's record names an honest sender, and the hostile one is banned, for twice
    as long at its second ban. Every replica trained on the micro-batch once (an audit copy is
    real work)."""
    driver = wallets[1]
    hidden, labels = _micro_batch(4)
    async with (
        _serve(make_node(wallets[0], stage=1), wallets[0], worker_type=_Negating) as (bad, _),
        _serve(make_node(wallets[2], stage=1), wallets[2]) as (good, _),
        _serve(make_node(wallets[3], stage=1), wallets[3]) as (other, _),
    ):
        recorder = SegmentRecorder(SegmentConfig(segment_steps=4), stage=0)
        torch.manual_seed(0)
        stage0 = DiLoCo(
            build_stage(MODEL, 0, 2), DiLoCoConfig(inner_steps=1000, warmup_steps=0, total_steps=1000)
        )
        recorder.start_round(stage0)
        lines: list[str] = []
        client, router = _client_of(driver, [bad, good, other], AUDITED, lines.append, recorder)
        id_ = micro_batch_id(driver.public_key_hex, 0, 0)
        await client.start()
        try:
            grad, _ = await client.forward(hidden, labels, round_=0, micro_batch=id_)
            recorder.record_step(stage0, data=(0, 0, 1), micro_batch=id_)
            current = recorder._current
            assert current is not None
            first_ban = router._links[bad.wallet.public_key_hex].skip_until - time.time()
            # Its ban over, it is drawn again (still measured the fastest) and caught again.
            router._links[bad.wallet.public_key_hex].skip_until = 0.0
            router.succeeded(bad.wallet.public_key_hex, tokens=10**9, seconds=1.0)
            await client.forward(
                hidden, labels, round_=0, micro_batch=micro_batch_id(driver.public_key_hex, 0, 1)
            )
            second_ban = router._links[bad.wallet.public_key_hex].skip_until - time.time()
        finally:
            await client.close()
    assert torch.equal(grad, _honest_gradient(hidden, labels))
    assert (bad.worker.diloco.step, good.worker.diloco.step, other.worker.diloco.step) == (2, 2, 2)
    assert (client.audits, client.audit_blamed, client.audits_unsettled) == (2, 2, 0)
    assert 25.0 < first_ban <= 30.0 and 55.0 < second_ban <= 60.0
    honest = {good.wallet.public_key_hex, other.wallet.public_key_hex}
    assert set(router.ranking([bad.wallet.public_key_hex, *honest], time.time())) == honest
    assert any(
        "disagrees with two others' that agree" in line and bad.wallet.public_key_hex[:12] in line
        for line in lines
    )
    assert current.steps[0].received[0].sender in honest
    assert len(current.steps[0].received) == 1
    # Every replica it offered the micro-batch to is named by a header it signed and recorded.
    assert {h.to for h in current.headers} == honest | {bad.wallet.public_key_hex}
    # Outvoted or not, each dispute goes to the verifier in round 0's receipt: the liar's reply
    # (answered first) and both honest ones.
    disputes = client.disputes_of(0)
    assert disputes is not None and len(disputes) == 2
    for step, dispute in enumerate(disputes):
        _assert_disputed(
            dispute, micro_batch_id(driver.public_key_hex, 0, step), driver, bad, [bad, good, other]
        )
    assert client.disputes_of(0) is None  # handed over once
    assert (client.disputes_reported, client.disputes_dropped) == (2, 0)


@pytest.mark.asyncio
async def test_an_audit_of_honest_replicas_agrees_and_keeps_the_first_answer(make_node, wallets) -> None:  # type: ignore[no-untyped-def]
    driver = wallets[1]
    hidden, labels = _micro_batch(5)
    async with (
        _serve(make_node(wallets[0], stage=1), wallets[0]) as (a, _),
        _serve(make_node(wallets[2], stage=1), wallets[2]) as (b, _),
    ):
        lines: list[str] = []
        client, router = _client_of(driver, [a, b], AUDITED, lines.append)
        await client.start()
        try:
            for step in range(2):
                id_ = micro_batch_id(driver.public_key_hex, 0, step)
                await client.forward(hidden, labels, round_=0, micro_batch=id_)
                assert client._answered[id_] == a.wallet.public_key_hex  # the first answer is the one used
        finally:
            await client.close()
    assert (client.audits, client.audit_blamed, client.audits_unsettled, client.audits_unchecked) == (
        2,
        0,
        0,
        0,
    )
    assert (a.worker.diloco.step, b.worker.diloco.step) == (2, 2) and not lines
    assert len(router.ranking([a.wallet.public_key_hex, b.wallet.public_key_hex], time.time())) == 2
    assert client.disputes_of(0) is None  # answers that agree are no dispute


class _Zeroing(StageWorker):
    """A hostile last stage answering zeros."""

    def _settle(self, job: Job, grad: torch.Tensor, loss: float, round_: int) -> None:
        super()._settle(job, torch.zeros_like(grad), loss, round_)


def _roster(admitted: list[Served], probation: list[Served]) -> Neighbours:
    neighbours = Neighbours(1)
    neighbours.set(StageRoster(
        stage=1, policy="probation", admitted=frozenset(r.wallet.public_key_hex for r in admitted),
        probation=frozenset(r.wallet.public_key_hex for r in probation),
    ))  # fmt: skip
    return neighbours


@pytest.mark.parametrize(
    "case", ["two-open", "two-by-standing", "three-apart", "probationers-against-admitted"]
)
@pytest.mark.asyncio
async def test_without_a_majority_that_may_ban_nobody_is_banned(make_node, wallets, case) -> None:  # type: ignore[no-untyped-def]
    """Honest replicas far apart in a round can disagree, so a dispute bans only on a majority, and
    without one the first answer is used, as it would have been without the audit:
    - two replicas, no member list: the first answer (the lie, here) is used; nobody banned;
    - two, a lying probationer and an admitted replica: the same (standing decides no answer);
    - three answers all apart (negated, zeros, honest): the first; nobody banned;
    - an admitted liar against two probationers that agree: probationers cannot vote it out, but
      theirs is the answer used.
    What the audit sees is logged."""
    driver = wallets[1]
    hidden, labels = _micro_batch(6)
    async with (
        _serve(make_node(wallets[0], stage=1), wallets[0], worker_type=_Negating) as (bad, _),
        _serve(
            make_node(wallets[2], stage=1),
            wallets[2],
            worker_type=_Zeroing if case == "three-apart" else StageWorker,
        ) as (second, _),
        _serve(make_node(wallets[3], stage=1), wallets[3]) as (third, _),
    ):
        replicas, receivers, expect = [bad, second], None, bad
        if case == "two-by-standing":
            receivers = _roster([second], [bad])
        elif case == "three-apart":
            replicas = [bad, second, third]
        elif case == "probationers-against-admitted":
            replicas, receivers, expect = [bad, second, third], _roster([bad], [second, third]), second
        lines: list[str] = []
        client, router = _client_of(driver, replicas, AUDITED, lines.append, receivers=receivers)
        await client.start()
        id_ = micro_batch_id(driver.public_key_hex, 0, 0)
        try:
            grad, _ = await client.forward(hidden, labels, round_=0, micro_batch=id_)
        finally:
            await client.close()
    # Unsettled here, so the verifier's replay is what can settle it: every answer compared goes in.
    [dispute] = client.disputes_of(0) or ()
    _assert_disputed(dispute, id_, driver, bad, replicas)
    honest = _honest_gradient(hidden, labels)
    if expect is second:
        assert torch.equal(grad, honest)
    else:  # the negated gradient, encoded by the liar (a codec is not symmetric: not -honest bit for bit)
        assert float(torch.nn.functional.cosine_similarity(grad.flatten(), honest.flatten(), dim=0)) < -0.95
    assert (client.audit_blamed, client.audits_unsettled) == (0, 1)
    wallets_asked = [r.wallet.public_key_hex for r in replicas]
    assert len(router.ranking(wallets_asked, time.time())) == len(replicas)  # nobody banned
    told = (
        "whose standing is lower; not used, nobody banned" if expect is second else "no majority settles it"
    )
    assert any(told in line for line in lines)


# --- the audit's concurrent ask, with the transport mocked: the edges a live run rarely shows ----


def _mocked(
    wallets: list[Wallet], outcomes: dict[str, Any], delays: dict[str, float], **over: Any
) -> tuple[PipelineClient, NextStageRouter, list[str]]:
    """A driver's client over three stage-1 replicas (wallets 0-2; 0 drawn first), every answer
    audited, whose `_ask` returns `outcomes[wallet]` after `delays[wallet]` seconds: a signed answer
    ("answer" a gradient of ones; "negated", "zeros": answers that disagree with it and each other),
    a failure string, or an exception to raise; and the wallets asked, in order."""
    from neuroshard.node.p2p.peers import PeerTable
    from neuroshard.node.p2p.pipeline import _Answer

    now = time.time()
    table = PeerTable(own_wallet=wallets[3].public_key_hex, ttl_s=60.0, ban_after=3, ban_s=30.0)
    table.merge([PeerRecord.create(w, address=f"127.0.0.1:{9000 + i}", stage=1, last_seen=now)
                 for i, w in enumerate(wallets[:3])], now)  # fmt: skip
    router = NextStageRouter(ban_s=30.0, busy_s=0.2, rng=random.Random(1))
    router.succeeded(wallets[0].public_key_hex, tokens=10**9, seconds=1.0)
    config = replace(AUDITED, retry_pause_s=0.01, **over)
    client = PipelineClient(
        wallet=wallets[3], stage=0, peers=table, config=config, clock=time.time, log=lambda s: None,
        stop=threading.Event(), router=router, audit_rng=random.Random(7),
    )  # fmt: skip
    asked: list[str] = []
    signers = {w.public_key_hex: w for w in wallets[:3]}
    gradients = {"answer": 1.0, "negated": -1.0, "zeros": 0.0}

    async def ask(peer: Any, offer: Any) -> Any:
        asked.append(peer.wallet)
        await asyncio.sleep(delays.get(peer.wallet, 0.0))
        outcome = outcomes[peer.wallet]
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome in gradients:
            reply = GradientReply.create(
                signers[peer.wallet], to=wallets[3].public_key_hex, micro_batch=offer.micro_batch, stage=1,
                round=offer.round, loss=1.0, codec=config.codec, payload_sha256=sha256_hex(b""),
            )  # fmt: skip
            grad = gradients[outcome] * torch.ones(*offer.shape)
            return _Answer(wallet=peer.wallet, grad=grad, loss=1.0, reply=reply, body=b"")
        return outcome

    client._ask = ask  # type: ignore[method-assign]
    return client, router, asked


@pytest.mark.asyncio
async def test_when_the_first_ask_fails_and_the_audit_copy_is_answered_that_answer_is_used(wallets) -> None:  # type: ignore[no-untyped-def]
    a, b, c = (w.public_key_hex for w in wallets[:3])
    client, router, asked = _mocked(wallets, {a: "status 500: down", b: "answer", c: "answer"}, {})
    await client.forward(*_micro_batch(1), round_=0, micro_batch="ab" * 16)
    auditor = asked[1]
    assert asked == [a, auditor] and client._answered["ab" * 16] == auditor  # nobody asked a third time
    assert client.retries == 1 and client.audits == 0
    assert router.ranking([a], time.time()) == []  # the one that failed is banned, as before


@pytest.mark.asyncio
async def test_an_audit_copy_answered_after_the_deadline_still_counts(wallets) -> None:  # type: ignore[no-untyped-def]
    """The pair of asks ends past the deadline: the copy's outcome, in hand, is still read (its
    failure reaches the router), and no new ask starts."""
    a, b, c = (w.public_key_hex for w in wallets[:3])
    outcomes = {a: "answer", b: "status 500: down", c: "status 500: down"}
    client, router, asked = _mocked(wallets, outcomes, {a: 0.3, b: 0.3, c: 0.3}, deadline_s=0.2)
    await client.forward(*_micro_batch(1), round_=0, micro_batch="cd" * 16)
    assert len(asked) == 2 and client.audits_unchecked == 1
    assert router.ranking([asked[1]], time.time()) == []  # the failed copy's replica is banned


@pytest.mark.asyncio
async def test_when_one_ask_of_the_pair_raises_the_other_is_cancelled(wallets) -> None:  # type: ignore[no-untyped-def]
    a, b, c = (w.public_key_hex for w in wallets[:3])
    client, _, _ = _mocked(wallets, {a: RuntimeError("boom"), b: "answer", c: "answer"}, {b: 5.0, c: 5.0})
    with pytest.raises(RuntimeError, match="boom"):
        await client.forward(*_micro_batch(1), round_=0, micro_batch="ef" * 16)
    await asyncio.sleep(0)
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


@pytest.mark.asyncio
async def test_an_audit_copy_refused_409_is_not_offered_the_id_again(wallets) -> None:  # type: ignore[no-untyped-def]
    a, b, c = (w.public_key_hex for w in wallets[:3])
    client, _, asked = _mocked(wallets, {a: "reused", b: "reused", c: "reused"}, {}, deadline_s=30.0)
    started = time.monotonic()
    with pytest.raises(PipelineUnavailable, match="3 replica"):
        await client.forward(*_micro_batch(1), round_=0, micro_batch="01" * 16, patient=False)
    assert sorted(asked) == sorted([a, b, c])  # each asked once: the copy's 409 counts as the first's
    assert time.monotonic() - started < 10.0


@pytest.mark.asyncio
async def test_disputes_are_kept_by_round_the_first_max_disputes_each_and_only_recent_rounds(wallets) -> None:  # type: ignore[no-untyped-def]
    """Three answers all apart (no majority, nobody banned): every micro-batch is a dispute of
    three. A round keeps its first MAX_DISPUTES, each micro-batch once; a round whose receipt never
    took them goes once a round DISPUTE_ROUNDS later has disputes; the rest are counted dropped."""
    a, b, c = (w.public_key_hex for w in wallets[:3])
    client, router, _ = _mocked(wallets, {a: "answer", b: "negated", c: "zeros"}, {})

    async def disputed(round_: int, micro_batch: str) -> None:
        await client.forward(*_micro_batch(1), round_=round_, micro_batch=micro_batch)

    for i in range(MAX_DISPUTES + 1):
        await disputed(0, f"{i:02x}" * 16)
    await disputed(1, "10" * 16)
    await disputed(1, "10" * 16)  # sent again (after a blame, say): its receipt names it once
    assert (client.audits_unsettled, client.disputes_dropped) == (MAX_DISPUTES + 3, 2)
    assert len(router.ranking([a, b, c], time.time())) == 3  # nobody banned
    disputes = client.disputes_of(1)
    assert disputes is not None and [d.micro_batch for d in disputes] == ["10" * 16]
    assert sorted(r.wallet for r in disputes[0].replies) == sorted([a, b, c])
    assert client.disputes_of(1) is None
    await disputed(DISPUTE_ROUNDS, "20" * 16)
    kept = client.disputes_of(0)
    assert kept is not None and [d.micro_batch for d in kept] == ["00" * 16, "01" * 16]
    await disputed(0, "02" * 16)
    await disputed(DISPUTE_ROUNDS + 1, "21" * 16)  # round 0, never taken, is now too old to keep
    assert client.disputes_of(0) is None
    assert (client.disputes_reported, client.disputes_dropped) == (3, 3)
