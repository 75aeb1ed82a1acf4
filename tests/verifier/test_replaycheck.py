"""The replay checker in-process: a node's peer server serves its committed round; the checker
replays it (pass), refuses material other than the receipt committed to, fails a receipt
that commits to no inner state, and fails a challenge left unanswered for the answer window
(SQLite, and PostgreSQL when configured)."""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from conftest import PublishedData
from sqlalchemy import select

from neuroshard.data import BatchStream, assign_shards
from neuroshard.node.actcodec import DEFAULT_CODEC
from neuroshard.node.diloco import DiLoCo, tensor_digest
from neuroshard.node.model import build_stage
from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig
from neuroshard.node.p2p.relay import relay_address
from neuroshard.node.p2p.replay import ReplayService
from neuroshard.node.replay import InnerState, ReplayArchive, ReplayRecord, capture_inner_state
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.pipeline import ActivationHeader, micro_batch_id
from neuroshard.protocol.segments import Received, segment_boundaries
from neuroshard.testing.verifier import small_network
from neuroshard.verifier import members, replaycheck
from neuroshard.verifier import models as m
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.db import Database
from neuroshard.verifier.members import MembershipConfig
from neuroshard.verifier.network import NetworkDefinition
from neuroshard.verifier.relaychallenge import BucketHolder, BucketUnavailable, NotAnswered
from neuroshard.verifier.replaycheck import (
    ANSWER_KEPT_S,
    MAX_ADMISSION_CHECKS,
    MAX_QUEUED_PER_WALLET,
    MAX_SENDER_LOGS,
    MAX_SENDER_RESTARTS,
    MAX_WAITING,
    MIN_TRIES,
    RETRY_EVERY_S,
    Challenge,
    ReplayCheckConfig,
    ReplayChecker,
    SenderMatch,
)
from neuroshard.verifier.reputation import ReputationConfig
from neuroshard.verifier.segmentlive import SegmentsJudged

NODE = Wallet.from_token("replaycheck-node")
OPERATOR = Wallet.from_token("replaycheck-operator")
H, B, T = 4, 2, 32


def _network(published: PublishedData) -> NetworkDefinition:
    return small_network(
        model={"size": "micro", "vocab_size": 512},
        diloco={"inner_steps": H, "warmup_steps": 2, "total_steps": 100},
        training={"batch_size": B, "seq_len": T},
        data={"manifest_url": str(published.directory), "publisher_key": published.public_key_hex},
    )


@pytest.fixture
def node(published: PublishedData) -> Iterator[tuple[PeerPlane, ReplayArchive, list[list[int]]]]:
    """A replica that ran round 0 on its assigned data and serves it to the operator."""
    network = _network(published)
    manifest = published.dataset.manifest
    order = assign_shards(NODE.wallet_id, manifest, exclude={network.held_out_shard})
    stream = BatchStream(
        source=published.dataset.source,
        manifest=manifest,
        order=order,
        seed=NODE.wallet_id,
        batch_size=B,
        seq_len=T,
    )
    diloco = DiLoCo(build_stage(network.model, 0, 1), network.diloco)
    inner, theta = capture_inner_state(diloco), diloco.theta_round.detach().clone()
    assert inner is not None
    for _ in range(H):
        diloco.inner_step(*stream.next_batch())
    archive = ReplayArchive()
    archive.add(ReplayRecord(round=0, theta_round=theta, inner=inner, delta=diloco.pseudo_gradient()))
    service = ReplayService(archive, allowed_wallet=OPERATOR.public_key_hex)
    net = PeerPlane(
        PeerPlaneConfig(port=0, join_timeout_s=0), NODE, stage=0, log=lambda line: None, extensions=[service]
    )
    net.start()
    yield net, archive, [[order[0], 0, H * B]]
    net.stop()


def _receipt(round_: int, record: ReplayRecord, spans: list[list[int]], **overrides: object) -> m.Receipt:
    fields: dict[str, object] = {
        "wallet_id": NODE.wallet_id, "stage": 0, "round": round_, "inner_steps": H, "start_step": round_ * H,
        "tokens": H * B * T, "shard_id": spans[0][0], "offset_start": spans[0][1], "offset_end": spans[0][2],
        "data_spans": spans, "losses": [], "base_hash": tensor_digest(record.theta_round),
        "result_hash": "1" * 64, "delta_digest": tensor_digest(record.delta),
        "inner_state_digest": record.inner.digest(), "accepted": [], "rejected": [], "equivocators": [],
        "body_sha256": f"{round_:064d}", "received_at": time.time(),
    }  # fmt: skip
    fields.update(overrides)
    return m.Receipt(**fields)


def _checker(db: Database, published: PublishedData, lines: list[str], **config: float) -> ReplayChecker:
    """A checker that draws every receipt, logging to `lines`."""
    return ReplayChecker(
        JobContext(db=db, network=_network(published), operator=OPERATOR, log=lines.append),
        config=ReplayCheckConfig(sample_rate=1.0, **config),
        dataset=lambda: published.dataset,
    )


def _verdicts(db: Database) -> list[str]:
    with db.read() as s:
        return [e.reason for e in s.scalars(select(m.ReputationEvent).order_by(m.ReputationEvent.id))]


def test_an_honest_round_passes_and_other_material_or_no_commitment_fails(
    node: tuple[PeerPlane, ReplayArchive, list[list[int]]], db: Database, published: PublishedData
) -> None:
    net, archive, spans = node
    record = archive.get(0)
    assert record is not None
    _register(db, f"http://{net.address}")
    lines: list[str] = []
    checker = _checker(db, published, lines)
    checker.run_once()  # the first pass only notes where the receipts end
    with db.write() as s:
        s.add(_receipt(0, record, spans))
    checker.run_once()
    assert checker.passed == 1 and checker.failed == 0, lines
    assert "replay: cosine 1.0000" in _verdicts(db)[-1] and "spot check passed" in _verdicts(db)[-1]

    # Round 0 again under other claims (as rounds 1 and 2): what the node serves is round 0's.
    archive.add(ReplayRecord(round=1, theta_round=record.theta_round, inner=record.inner, delta=record.delta))
    with db.write() as s:
        s.add(_receipt(1, record, spans, delta_digest="d" * 64))
        s.add(_receipt(2, record, spans, inner_state_digest=None))
    checker.run_once()
    failed = [v for v in _verdicts(db) if "spot check failed" in v]
    assert any("round 1: replay: served Δ other than its receipt committed to" in v for v in failed), failed
    assert any("round 2: replay: the receipt commits to no inner optimizer state" in v for v in failed), (
        failed
    )
    with db.read() as s:
        assert s.get(m.Wallet, NODE.wallet_id).reputation < 0.5  # type: ignore[union-attr]


def test_an_exception_on_the_replay_thread_is_logged(db: Database, published: PublishedData) -> None:
    """Nothing reads a replay future's result: what it raised (say, the verdict's transaction
    failing) reaches the log through its done-callback instead of vanishing."""
    lines: list[str] = []
    checker = _checker(db, published, lines)

    def fails() -> None:
        raise RuntimeError("the verdict's transaction failed")

    with ThreadPoolExecutor(1) as pool:
        pool.submit(fails).add_done_callback(checker._log_failure)
        pool.submit(lambda: None).add_done_callback(checker._log_failure)
    assert lines == ["replay check: a replay failed: RuntimeError: the verdict's transaction failed"]


def _register(db: Database, address: str) -> None:
    now = time.time()
    with db.write() as s:
        s.add(m.Wallet(wallet_id=NODE.wallet_id, public_key=NODE.public_key_hex, reputation=0.5,
                       status=m.STATUS_ACTIVE, registered_at=now, software_version="0.1.0"))  # fmt: skip
        s.flush()
        s.add(
            m.Peer(wallet_id=NODE.wallet_id, address=address, stage=0, registered_at=now, last_heartbeat=now)
        )


def _reputation(db: Database) -> float:
    with db.read() as s:
        wallet = s.get(m.Wallet, NODE.wallet_id)
        assert wallet is not None
        return wallet.reputation


def _age(checker: ReplayChecker, seconds: float) -> None:
    """Move every waiting challenge `seconds` into the past, due for its next try (the requests
    stay signed at the real time, which the node's clock-skew check wants)."""
    for challenge in checker.queue:
        if challenge.first_try is not None:
            challenge.first_try -= seconds
        challenge.next_try = 0.0


def test_a_challenge_left_unanswered_for_the_window_fails_at_the_unanswered_penalty(
    node: tuple[PeerPlane, ReplayArchive, list[list[int]]], db: Database, published: PublishedData
) -> None:
    """A replica that declines (404) is tried again within the answer window and answers in time
    when it can; one that still declines when the window ends fails at `unanswered_penalty`, and
    a receipt that reached the verifier after its round settled gets no verdict."""
    net, archive, spans = node
    record = archive.get(0)
    assert record is not None
    _register(db, f"http://{net.address}")
    lines: list[str] = []
    checker = _checker(db, published, lines, answer_window_s=600.0)
    checker.run_once()
    now = time.time()
    with db.write() as s:  # rounds 0..2 settled on the replica's own θ, so every round replays from it
        # (settled after the receipts came: a receipt after settlement is not drawn)
        for r in range(3):
            s.add(m.Round(stage=0, round=r, majority_hash=tensor_digest(record.theta_round), votes=1,
                          agreeing=1, synced=1, sync_checked=1, settled_at=now + 10.0))  # fmt: skip
        s.add(_receipt(0, record, spans))
    archive._records.clear()  # the node does not hold round 0 at first (restarting, say)
    checker.run_once()  # declined: no verdict yet
    assert checker.passed == 0 and checker.failed == 0 and len(checker.queue) == 1, lines
    archive.add(record)
    checker.run_once()
    assert checker.passed == 0 and len(checker.queue) == 1  # not tried again before RETRY_EVERY_S
    _age(checker, RETRY_EVERY_S)
    checker.run_once()  # the node came back with it: checked as usual
    assert checker.passed == 1 and checker.failed == 0 and not checker.queue, lines

    with db.write() as s:
        s.add(_receipt(3, record, spans))
    checker.run_once()
    _age(checker, 599.0)
    checker.run_once()
    assert checker.failed == 0 and len(checker.queue) == 1, lines  # still inside the window
    _age(checker, 2.0)
    checker.run_once()
    assert checker.failed == 1 and checker.unanswered == 1 and not checker.queue, lines
    verdict = _verdicts(db)[-1]
    assert (
        "spot check failed in stage 0 round 3" in verdict
        and "did not answer its challenge within 600 s" in verdict
    )
    assert "declined: HTTP 404" in verdict, verdict
    assert _reputation(db) == pytest.approx(0.5 - ReputationConfig().unanswered_penalty)

    # A receipt that came after its round settled: the node may have dropped it, so no verdict
    # could be given if it went unanswered, and it is not drawn at all (a pass would count).
    with db.write() as s:
        settled = s.get(m.Round, (0, 2))
        assert settled is not None
        settled.settled_at = time.time() - 1.0
        s.add(_receipt(2, record, spans, delta_digest="d" * 64))
    checker.run_once()
    assert checker.failed == 1 and not checker.queue, lines
    assert "round 2 came after its round settled; not checked" in lines[-1], lines[-1]


def test_a_relay_replica_is_not_challenged_without_a_bucket_and_an_unreachable_one_fails_after_the_window(
    db: Database, published: PublishedData
) -> None:
    lines: list[str] = []
    _register(db, relay_address(NODE.public_key_hex))
    checker = _checker(db, published, lines, answer_window_s=60.0, timeout_s=2.0)
    checker.run_once()
    theta = torch.zeros(4)
    fake = ReplayRecord(round=0, theta_round=theta, inner=InnerState(theta, theta, theta), delta=theta)
    order = assign_shards(
        NODE.wallet_id, published.dataset.manifest, exclude={_network(published).held_out_shard}
    )
    spans = [[order[0], 0, H * B]]  # the wallet's own data: no verdict before the fetch
    with db.write() as s:
        s.add(_receipt(0, fake, spans))
    checker.run_once()
    assert not checker.queue and checker.failed == 0
    assert any("is a relay replica and the verifier has no bucket" in line for line in lines), lines

    with socket.socket() as held:  # a port nobody listens on: connections are refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
    with db.write() as s:
        peer = s.get(m.Peer, NODE.wallet_id)
        assert peer is not None
        peer.address = f"http://127.0.0.1:{port}"
        s.add(_receipt(1, fake, spans))
    checker.run_once()
    assert checker.failed == 0 and len(checker.queue) == 1
    _age(checker, 61.0)
    checker.run_once()
    assert checker.failed == 0 and len(checker.queue) == 1  # two tries: not yet judged (MIN_TRIES)
    _age(checker, 1.0)
    checker.run_once()
    assert checker.failed == 1 and checker.unanswered == 1, lines
    assert "(unreachable: " in _verdicts(db)[-1], _verdicts(db)[-1]


def test_the_senders_matched_are_drawn_not_taken_in_the_replicas_order(
    db: Database, published: PublishedData
) -> None:
    """A receiver's records list its senders in an order it chooses; the checker matches
    MAX_SENDER_LOGS of them by the operator's draw, so reordering the records changes nothing
    (taking the first ones would match senders[:4] one way and senders[4:] the other)."""
    senders = [Wallet.from_token(f"replaycheck-sender-{i}") for i in range(8)]

    def received(sender: Wallet) -> Received:
        header = ActivationHeader.create(
            sender, to=NODE.public_key_hex, micro_batch=micro_batch_id(sender.public_key_hex, 0, 0), stage=1,
            round=0,
            batch=1, seq_len=1, dim=1, codec=DEFAULT_CODEC, payload_sha256="0" * 64,
        )  # fmt: skip
        return Received("activations", sender.public_key_hex, header.to_json(), b"")

    queued = []
    for order in (senders, senders[::-1]):
        checker = _checker(db, published, [])
        piece = SimpleNamespace(
            received=[[received(s)] for s in order],
            failed=(),
            commitment=SimpleNamespace(wallet=NODE.public_key_hex),
        )
        receipt = m.Receipt(wallet_id=NODE.wallet_id, stage=1, round=0)
        challenge = Challenge(receipt, "http://127.0.0.1:1", segments=(0,), pieces={0: piece})
        checker._queue_senders(challenge)
        queued.append({match.sender for match in checker._senders})
    assert len(queued[0]) == MAX_SENDER_LOGS and queued[0] == queued[1]


def _sender_receipt(
    db: Database,
    round_: int,
    *,
    received_at: float | None = None,
    segment_root: str | None = None,
    stage: int = 0,
) -> None:
    """NODE's receipt of `round_` at `stage` as a sender's (committing to a segment log when
    `segment_root` is given), received at `received_at` (default now)."""
    with db.write() as s:
        s.add(m.Receipt(
            wallet_id=NODE.wallet_id, stage=stage, round=round_, inner_steps=H, start_step=round_ * H, tokens=1,
            shard_id=0, offset_start=0, offset_end=1, data_spans=[[0, 0, 1]], losses=[], base_hash="0" * 64,
            result_hash="1" * 64, delta_digest="2" * 64, accepted=[], rejected=[], equivocators=[],
            body_sha256=f"{round_:064d}", segment_root=segment_root,
            received_at=time.time() if received_at is None else received_at,
        ))  # fmt: skip


def test_a_sender_whose_headers_name_a_round_it_never_reports_fails_as_unanswered(
    db: Database, published: PublishedData
) -> None:
    """Headers naming a round the sender never sends a receipt for cannot be matched: once the
    wait is over, a sender that went on to report a later round, or only earlier ones since the
    match was queued, fails as an unanswered challenge (once a round). No verdict for one that
    reported nothing since (it may be down), nor for one that registered again after the named
    round began (a restart drops an unfinished round), nor when the receipt came in after all."""
    _register(db, "http://127.0.0.1:1")
    lines: list[str] = []
    checker = _checker(db, published, lines)
    wait = checker.config.sender_wait_s
    queued = time.time() - wait - 1

    def registered(at: float) -> None:
        with db.write() as s:
            peer = s.get(m.Peer, NODE.wallet_id)
            assert peer is not None
            peer.registered_at = at

    def receipt(round_: int, received_at: float) -> None:
        _sender_receipt(db, round_, received_at=received_at)

    def match(round_: int) -> SenderMatch:
        return SenderMatch(NODE.public_key_hex, 0, round_, NODE.wallet_id, "ab" * 32, [], queued)

    def expire(round_: int) -> list[str]:
        checker._senders.append(match(round_))
        checker._match_senders()
        assert not checker._senders  # the wait is over either way
        return [v for v in _verdicts(db) if "spot check failed" in v]

    registered(queued - 1000)  # running since long before
    receipt(2, queued - 100)  # before the match was queued: says nothing of round 5
    assert expire(5) == [] and "it reported nothing since" in lines[-1], lines
    receipt(3, queued + 10)  # alive since, reporting only rounds before the one named
    (failed,) = expire(5)
    assert (
        "round 5: records: its headers name round 5, ahead of every round it reported since (up to 3)"
        in failed
    )
    assert checker.unanswered == 1
    receipt(6, queued + 20)  # went past round 4 without reporting it
    failed = expire(4)
    assert len(failed) == 2 and "reported stage 0 up to round 6 but never round 4" in failed[-1], failed
    assert len(expire(4)) == 2 and checker.unanswered == 2  # once a round
    # Round 7 began when round 6's receipt came in; the sender registered again after that.
    registered(queued + 25)
    receipt(8, queued + 30)
    assert len(expire(7)) == 2 and "registered again since that round began" in lines[-1], lines
    # The receipt of the round named came in between the two looks: left to be matched.
    assert checker._sender_missing(match(8)) is False and len(_verdicts(db)) == 2


def test_a_sender_behind_nat_is_asked_for_its_log_through_the_bucket(
    db: Database, published: PublishedData
) -> None:
    """Pipeline stages may run behind NAT (node.p2p.mailbox), so a sender may be a relay replica: its
    round's log is asked for through the bucket like a segment, waited for while unanswered, and it
    fails as unanswered after the window. A checker without a bucket leaves it unmatched, saying why."""
    _register(db, relay_address(NODE.public_key_hex))
    _sender_receipt(db, 2, segment_root="3" * 64)
    lines: list[str] = []
    checker = _checker(db, published, lines, answer_window_s=60.0)
    match = SenderMatch(NODE.public_key_hex, 0, 2, "receiver-wallet", "ab" * 32, [], time.time())
    assert checker._match_sender(match) is True and "needs the verifier's --relay" in lines[-1], lines

    asked: list[object] = []

    def unanswered(where: object, round_: int, **kwargs: object) -> None:
        asked.append((where, round_))
        raise NotAnswered("no answer to /p2p/segment-log/2 in the bucket yet")

    released: list[tuple[str, list[str]]] = []
    checker._bucket = SimpleNamespace(release=lambda holder, paths: released.append((holder, list(paths))))  # type: ignore[assignment]
    checker._get_log = unanswered  # type: ignore[method-assign,assignment]
    checker._senders.append(match)
    checker._match_senders()
    assert asked == [(BucketHolder(NODE.public_key_hex), 2)] and len(checker._senders) == 1
    assert match.found is not None and "not read yet (no answer" in lines[-1], lines
    match.found = (match.found[0] - 61.0, match.found[1])  # the answer window is over
    checker._match_senders()
    assert not checker._senders and checker.unanswered == 1
    assert "did not serve its round log within 60 s" in _verdicts(db)[-1], _verdicts(db)
    assert released == [(NODE.public_key_hex, ["/p2p/segment-log/2"])]  # its challenge goes with it

    # The bucket failing the verifier is no verdict on the sender: its window starts again, and after
    # MAX_SENDER_RESTARTS the match ends unmatched (and its challenge is released).
    def broken(where: object, round_: int, **kwargs: object) -> None:
        raise BucketUnavailable("cannot read s3://stage/...: endpoint down")

    checker._get_log = broken  # type: ignore[method-assign,assignment]
    later = SenderMatch(NODE.public_key_hex, 0, 3, "receiver-wallet", "ab" * 32, [], time.time())
    _sender_receipt(db, 3, segment_root="3" * 64)
    checker._senders.append(later)
    for _ in range(MAX_SENDER_RESTARTS):
        checker._match_senders()
        assert list(checker._senders) == [later] and later.found is None
        assert later.not_before > time.time() + 10  # tried again RETRY_EVERY_S later, not at once
        tries = later.restarts
        checker._match_senders()
        assert later.restarts == tries  # not due yet: not tried
        later.not_before = 0.0  # time passes
    checker._match_senders()
    assert not checker._senders and checker.unanswered == 1 and len(released) == 2
    assert "the bucket failed the verifier 4 times" in lines[-1], lines[-1]


@pytest.mark.parametrize(
    ("missing", "said", "stage"),
    [("headers", "lists no signed headers", 0), ("failed", "lists no failed steps", 1)],
)
def test_a_sender_log_that_lists_no_signed_headers_is_not_its_log(
    db: Database, published: PublishedData, missing: str, said: str, stage: int
) -> None:
    """Logs list every header their replica signed since 2026-12-07 (protocol.segments.SignedHeader),
    and later that day a middle stage's failed steps (FailedStep): one without either list, which
    a sender could serve to keep its headers from being held to it (only its steps would count),
    is not read as its log for a round received since the checker started; tried again until the
    window ends. For a round received before (a node of the older code, across an upgrade) it is
    held to its steps, as then. (Run in a 3-stage network; failed steps are a middle stage's.)"""
    from neuroshard.protocol.segments import SegmentCommitment, SegmentLog, SignedSegmentLog, StepRecord

    _register(db, "http://127.0.0.1:9")
    network = dataclasses.replace(_network(published), num_stages=3)
    run = network.digest()

    def unlisted(round_: int) -> SignedSegmentLog:
        log = SegmentLog(stage=stage, round=round_, segment_steps=1, start_step=0, steps=(StepRecord(),),
                         checkpoints=("ab" * 32, "cd" * 32), **{missing: None})  # fmt: skip
        commitment = SegmentCommitment.create(NODE, stage=stage, round=round_, root=log.root(), network=run)
        return SignedSegmentLog(log, commitment)

    _sender_receipt(db, 1, segment_root=unlisted(1).log.root(), received_at=time.time() - 60, stage=stage)
    lines: list[str] = []
    checker = _checker(db, published, lines)
    checker.ctx = dataclasses.replace(checker.ctx, network=network)
    _sender_receipt(db, 2, segment_root=unlisted(2).log.root(), stage=stage)
    checker._get_log = lambda where, round_, **kwargs: unlisted(round_)  # type: ignore[method-assign,assignment,misc]
    for round_, ended in ((2, False), (1, True)):
        match = SenderMatch(NODE.public_key_hex, stage, round_, "receiver-wallet", "ab" * 32, [], time.time())
        assert checker._match_sender(match) is ended, lines
    assert any("round 2 not read yet" in line and said in line for line in lines), lines
    log = unlisted(2).log
    assert SegmentLog(**{**log.__dict__, missing: ()}).root() != log.root()  # the list is in the root


def test_a_first_or_last_stage_log_that_lists_no_failed_steps_is_still_its_log(
    db: Database, published: PublishedData
) -> None:
    """Only a middle stage fails a step after offering its output: a first or last stage's log
    without the list (an older node's) has nothing missing and is read, whenever its round came."""
    from neuroshard.protocol.segments import SegmentCommitment, SegmentLog, SignedSegmentLog, StepRecord

    _register(db, "http://127.0.0.1:9")
    run = _network(published).digest()

    def unlisted(round_: int) -> SignedSegmentLog:
        log = SegmentLog(stage=0, round=round_, segment_steps=1, start_step=0, steps=(StepRecord(),),
                         checkpoints=("ab" * 32, "cd" * 32), failed=None)  # fmt: skip
        commitment = SegmentCommitment.create(NODE, stage=0, round=round_, root=log.root(), network=run)
        return SignedSegmentLog(log, commitment)

    lines: list[str] = []
    checker = _checker(db, published, lines)
    _sender_receipt(db, 2, segment_root=unlisted(2).log.root())
    checker._get_log = lambda where, round_, **kwargs: unlisted(round_)  # type: ignore[method-assign,assignment,misc]
    match = SenderMatch(NODE.public_key_hex, 0, 2, "receiver-wallet", "ab" * 32, [], time.time())
    assert checker._match_sender(match), lines
    assert not any("lists no failed steps" in line for line in lines), lines


def _bucket_check(
    db: Database, published: PublishedData, lines: list[str]
) -> tuple[ReplayChecker, Challenge]:
    """A checker holding one segment check of a relay replica's round 1 (segments 0 and 1 wanted),
    whose pieces are stand-ins: `_get_segment` is replaced by the test."""
    _register(db, relay_address(NODE.public_key_hex))
    checker = _checker(db, published, lines, answer_window_s=60.0)
    theta = torch.zeros(4)
    fake = ReplayRecord(round=1, theta_round=theta, inner=InnerState(theta, theta, theta), delta=theta)
    with db.write() as s:
        s.add(_receipt(1, fake, [[0, 0, H * B]]))
    with db.read() as s:
        receipt = s.scalars(select(m.Receipt)).one()
        s.expunge(receipt)
    challenge = Challenge(receipt, BucketHolder(NODE.public_key_hex), segments=(0,), last=1)
    checker.queue.append(challenge)
    return checker, challenge


def test_a_bucket_check_waiting_for_the_previous_rounds_log_has_a_window_of_its_own(
    db: Database, published: PublishedData
) -> None:
    """A relay replica's pieces may be read long after it answered them (the fetch slots were
    busy); the log of its round before is asked only then, so it may be answered until the later
    of the pieces' window and `answer_window_s` (plus a log's upload) from that ask."""
    lines: list[str] = []
    checker, challenge = _bucket_check(db, published, lines)
    checker._get_segment = lambda address, receipt, j: SimpleNamespace(segment=j)  # type: ignore[method-assign,assignment,return-value]
    checker._starts_fresh = lambda c: False  # type: ignore[method-assign]

    def no_log(*args: object, **kwargs: object) -> None:
        raise NotAnswered("no answer to /p2p/segment-log/0 in the bucket yet")

    checker._get_log = no_log  # type: ignore[method-assign,assignment]
    now = time.time()
    window = checker._window(challenge)
    challenge.first_try, challenge.tries, challenge.answered = now - 3 * window, 5, True
    checker._fetch(challenge)
    assert set(challenge.pieces) == {0, 1} and challenge.log_asked is not None and challenge.tries == 1
    for _ in range(MIN_TRIES):
        checker._fetch(challenge)
    assert checker.failed == 0 and checker.queue == [challenge], lines  # seconds into its 60 s
    challenge.log_asked = now - 65.0  # 60 s and a log's upload at the rate floor (under a second)
    challenge.first_try = now - window + 30.0  # the pieces' window is the later: not yet
    checker._fetch(challenge)
    assert checker.failed == 0 and checker.queue == [challenge], lines
    challenge.first_try = now - 3 * window
    checker._fetch(challenge)
    assert checker.failed == 1 and checker.unanswered == 1 and not checker.queue, lines
    assert (
        "(not answered: no answer to /p2p/segment-log/0" in _verdicts(db)[-1]
        and "did not answer its challenge within 6" in _verdicts(db)[-1]
    )


def test_an_answer_withdrawn_from_the_bucket_after_it_was_found_fails_the_check(
    db: Database, published: PublishedData
) -> None:
    """`_poll` found every answer; one is gone when it is read. Within ANSWER_KEPT_S of their
    writing only the holder can have taken it back: it fails at once instead of keeping the slot
    the download took. Later, the bucket's lifecycle rule may have expired it (the verifier was
    slow): the check starts over, holding nothing."""
    lines: list[str] = []
    checker, challenge = _bucket_check(db, published, lines)

    def piece(address: object, receipt: object, j: int) -> object:
        if j == 1:
            raise NotAnswered("no answer to /p2p/segment/1/1 in the bucket yet")
        return SimpleNamespace(segment=j)

    checker._get_segment = piece  # type: ignore[method-assign,assignment]
    now = time.time()
    challenge.first_try, challenge.tries = now, 1
    challenge.answered, challenge.written = True, now - ANSWER_KEPT_S - 60.0
    checker._fetch(challenge)
    assert checker.failed == 0 and checker.queue == [challenge], lines
    assert not challenge.pieces and not challenge.answered and challenge.first_try is None  # over
    assert "expired before they were read" in lines[-1], lines

    challenge.first_try, challenge.tries = now, 1
    challenge.answered, challenge.written = True, now - 60.0
    checker._fetch(challenge)
    assert checker.failed == 1 and checker.unanswered == 1 and not checker.queue, lines
    assert "withdrew or spoiled an answer in the bucket after it was found there" in _verdicts(db)[-1]


def _checker_with_a_receipt(db: Database, published: PublishedData, lines: list[str]) -> ReplayChecker:
    """A checker that has run once, and NODE's round-0 receipt (an unreachable address) waiting for it."""
    _register(db, "http://127.0.0.1:9")
    checker = _checker(db, published, lines)
    checker.run_once()
    theta = torch.zeros(4)
    fake = ReplayRecord(round=0, theta_round=theta, inner=InnerState(theta, theta, theta), delta=theta)
    order = assign_shards(
        NODE.wallet_id, published.dataset.manifest, exclude={_network(published).held_out_shard}
    )
    with db.write() as s:
        s.add(_receipt(0, fake, [[order[0], 0, H * B]]))
    return checker


def test_a_receipt_drawn_when_the_queue_is_full_is_not_counted_as_checked(
    db: Database, published: PublishedData
) -> None:
    """The budget's draw skips a wallet it picked lately (`_picked`); one whose challenge could not
    be queued was not checked, so it must stay due rather than pass as checked."""
    lines: list[str] = []
    checker = _checker_with_a_receipt(db, published, lines)
    full = checker.config.max_queue + MAX_WAITING
    checker.queue = [SimpleNamespace(ready=True, holding=True, receipt=None, disputed=None)] * full  # type: ignore[list-item]
    checker._replay_next = lambda: None  # type: ignore[method-assign]
    checker.run_once()
    assert f"{full} challenges already waiting; {NODE.wallet_id} round 0 not checked" in lines[-1], lines
    assert NODE.wallet_id not in checker._picked


def test_one_wallet_holds_at_most_two_places_in_the_queue(db: Database, published: PublishedData) -> None:
    """Wallets that never answer must not fill the waiting places with their own rounds for their
    windows (no one else would be checked meanwhile): a wallet with MAX_QUEUED_PER_WALLET challenges
    queued gets no more, stays due for the budget's draw, and one with fewer is queued as before."""
    lines: list[str] = []
    checker = _checker_with_a_receipt(db, published, lines)
    mine = SimpleNamespace(
        ready=True, holding=False, receipt=SimpleNamespace(wallet_id=NODE.wallet_id), disputed=None
    )
    checker.queue = [mine] * MAX_QUEUED_PER_WALLET  # type: ignore[list-item]
    checker._replay_next = lambda: None  # type: ignore[method-assign]
    checker.run_once()
    assert (
        f"{NODE.wallet_id} has {MAX_QUEUED_PER_WALLET} challenges in the queue already; round 0 not checked"
        in lines[-1]
    ), lines
    assert NODE.wallet_id not in checker._picked and len(checker.queue) == MAX_QUEUED_PER_WALLET

    checker.queue = [mine] * (MAX_QUEUED_PER_WALLET - 1)  # type: ignore[list-item]
    checker.last_id = 0
    checker.run_once()
    assert (
        len(checker.queue) == MAX_QUEUED_PER_WALLET and checker.queue[-1].receipt.wallet_id == NODE.wallet_id
    ), lines

    # A dispute's challenges (which a replier may leave unanswered for free) have places of their
    # own: they neither fill the wallet's two nor the waiting places drawn checks need.
    disputed = SimpleNamespace(
        ready=True, holding=False, receipt=SimpleNamespace(wallet_id=NODE.wallet_id), disputed="ab" * 16
    )
    checker.queue = [disputed] * (checker.config.max_queue + MAX_WAITING)  # type: ignore[list-item]
    checker.last_id = 0
    checker.run_once()
    assert checker.queue[-1].receipt.wallet_id == NODE.wallet_id and checker.queue[-1].disputed is None, lines


def test_a_pass_on_inputs_from_wallets_never_registered_for_their_stage_counts_for_nothing(
    db: Database, published: PublishedData, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `probation` or `allowlist` a replica takes micro-batches only from its neighbours'
    member lists, and only registered (or rostered) wallets are on them: a check whose segments
    consumed a stranger's messages passes without credit (no verdict: a replica that could not
    read the lists yet takes everyone). A registration for another stage does not count; a
    roster that names the wallet does; under `open` nobody is a stranger."""
    sender = Wallet.from_token("replaycheck-stranger")
    header = ActivationHeader.create(
        sender, to=NODE.public_key_hex, micro_batch=micro_batch_id(sender.public_key_hex, 0, 0), stage=1,
        round=0, batch=1, seq_len=1, dim=1, codec=DEFAULT_CODEC, payload_sha256="0" * 64,
    )  # fmt: skip
    piece = SimpleNamespace(
        received=[[Received("activations", sender.public_key_hex, header.to_json(), b"")]],
        failed=(),
        commitment=SimpleNamespace(wallet=NODE.public_key_hex),
    )
    receipt = m.Receipt(wallet_id=NODE.wallet_id, stage=1, round=0)
    challenge = Challenge(receipt, "http://127.0.0.1:1", segments=(0,), pieces={0: piece})  # type: ignore[dict-item]

    def checker(policy: str, lines: list[str]) -> ReplayChecker:
        return ReplayChecker(
            JobContext(db=db, network=_network(published), operator=OPERATOR, log=lines.append),
            config=ReplayCheckConfig(sample_rate=1.0),
            membership=MembershipConfig(policy=policy),
        )

    assert checker("open", [])._strangers(challenge) is None
    why = checker("probation", [])._strangers(challenge)
    assert why is not None and f"{sender.wallet_id} (stage 0)" in why

    # The check itself: the replay passes, and the pass is not counted (no verdict recorded).
    lines: list[str] = []
    probation = checker("probation", lines)
    recorded: list[bool] = []
    monkeypatch.setattr(replaycheck, "judge_segments", lambda *a, **k: SegmentsJudged(True, "replayed"))
    monkeypatch.setattr(probation, "_continuity", lambda c: None)
    monkeypatch.setattr(probation, "_record", lambda receipt, ok, *a, **k: recorded.append(ok))
    probation._check_segments(challenge)
    assert recorded == [] and "passed, not counted" in lines[-1] and "never registered" in lines[-1], lines

    now = time.time()
    with db.write() as s:
        s.add(m.Wallet(wallet_id=sender.wallet_id, public_key=sender.public_key_hex, reputation=0.5,
                       status=m.STATUS_ACTIVE, registered_at=now, software_version="0.1.0"))  # fmt: skip
        s.flush()
        s.add(m.Membership(stage=1, wallet_id=sender.wallet_id, status=m.MEMBER_PROBATION, streak=0,
                           checks_passed=0, since=now, reason="registered"))  # fmt: skip
    assert probation._strangers(challenge) is not None  # registered, but for stage 1, not 0
    monkeypatch.setattr(
        members,
        "current_roster",
        lambda session, now: SimpleNamespace(wallets=lambda stage: {sender.public_key_hex}),
    )
    assert probation._strangers(challenge) is None  # the operator's roster names it
    monkeypatch.undo()
    with db.write() as s:
        s.add(m.Membership(stage=0, wallet_id=sender.wallet_id, status=m.MEMBER_PROBATION, streak=0,
                           checks_passed=0, since=now, reason="registered"))  # fmt: skip
    assert probation._strangers(challenge) is None
    monkeypatch.setattr(replaycheck, "judge_segments", lambda *a, **k: SegmentsJudged(True, "replayed"))
    monkeypatch.setattr(probation, "_continuity", lambda c: None)
    monkeypatch.setattr(probation, "_record", lambda receipt, ok, *a, **k: recorded.append(ok))
    monkeypatch.setattr(probation, "_queue_senders", lambda c: None)
    probation._check_segments(challenge)
    assert recorded == [True]


def test_a_later_stage_probationer_that_did_its_rounds_is_checked_on_its_next_receipt(
    db: Database, published: PublishedData
) -> None:
    """With nothing sampled (rate 0), a probationer whose admission waits only on a spot check is
    still challenged on its next receipt, at a later pipeline stage as at stage 0 (segment checks
    replay every stage, so every stage's probationers need one; before, only stage 0's were drawn
    so); one that has not done its rounds yet is not."""
    lines: list[str] = []
    other = Wallet.from_token("replaycheck-other")
    network = _network(published)
    checker = ReplayChecker(
        JobContext(db=db, network=network, operator=OPERATOR, log=lines.append),
        config=ReplayCheckConfig(sample_rate=0.0),
        dataset=lambda: published.dataset,
        membership=MembershipConfig(policy="probation", admission_rounds=2, spot_checks_required=1),
    )
    checker._replay_next = lambda: None  # type: ignore[method-assign]
    checker.run_once()
    now = time.time()
    segments = len(segment_boundaries(H, network.segment_k)) - 1
    with db.write() as s:
        for wallet, streak in ((NODE, 1), (other, 0)):
            s.add(m.Wallet(wallet_id=wallet.wallet_id, public_key=wallet.public_key_hex, reputation=0.5,
                           status=m.STATUS_ACTIVE, registered_at=now, software_version="0.1.0"))  # fmt: skip
            s.flush()
            s.add(m.Peer(wallet_id=wallet.wallet_id, address="http://127.0.0.1:9", stage=1,
                         registered_at=now, last_heartbeat=now))  # fmt: skip
            s.add(m.Membership(stage=1, wallet_id=wallet.wallet_id, status=m.MEMBER_PROBATION,
                               streak=streak, checks_passed=0, since=now))  # fmt: skip
        for wallet in (NODE, other):
            s.add(m.Receipt(wallet_id=wallet.wallet_id, stage=1, round=1, inner_steps=H, start_step=H,
                            tokens=H * B * T, shard_id=None, offset_start=None, offset_end=None, data_spans=[],
                            losses=[], base_hash="0" * 64, result_hash="1" * 64, delta_digest="2" * 64,
                            inner_state_digest="3" * 64, segment_root="4" * 64, segments=segments,
                            accepted=[], rejected=[], equivocators=[], body_sha256=wallet.wallet_id.ljust(64, "0"),
                            received_at=now))  # fmt: skip
    first = checker.last_id
    checker.run_once()
    queued = [(c.receipt.wallet_id, c.receipt.stage, c.receipt.round) for c in checker.queue]
    assert queued == [(NODE.wallet_id, 1, 1)], lines
    assert checker.queue[0].admission

    # Each stage's admission checks hold at most MAX_ADMISSION_CHECKS places: with stage 1's full
    # (keys that vote the majority hash without working, say), its receipt is left to the draw,
    # while a stage whose places are free is not held up by stage 1's.
    def held(stage: int) -> list[SimpleNamespace]:
        fake = SimpleNamespace(
            ready=True, holding=False, admission=True, disputed=None,
            receipt=SimpleNamespace(wallet_id=f"{stage}-flood", stage=stage),
        )  # fmt: skip
        return [fake] * MAX_ADMISSION_CHECKS

    for full, taken in ((1, False), (0, True)):
        checker.queue, checker.last_id = held(full), first  # type: ignore[assignment]
        checker.run_once()
        assert (checker.queue[-1].receipt.wallet_id == NODE.wallet_id) is taken, (full, lines)
