"""Spot checks of replicas behind NAT, live on loopback: two relay replicas (``--relay``, no port)
of a single-stage run record round 0 by segments; the replay checker, given the stage bucket (a
moto S3 server), challenges them through it and the replicas answer from their gossip loop. The
honest one passes, the one that inflated its last segment is caught with a fraud proof, and one
that never answers fails after the answer window: the bucket is no way around a check. A fourth
answers every piece but its last: it holds none of the checker's fetch slots while it waits (the
checker has one here, and the others are checked meanwhile), and fails after the window too."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import PublishedData
from sqlalchemy import select

from neuroshard.data import BatchStream, assign_shards
from neuroshard.node.diloco import DiLoCo, copy_into_parameters, flat_parameters, tensor_digest
from neuroshard.node.model import build_stage
from neuroshard.node.p2p.bucket import RelayConfig, make_s3_client
from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig
from neuroshard.node.p2p.relay import is_relay, relay_address
from neuroshard.node.p2p.replay import SEGMENT, SegmentService
from neuroshard.node.segment_store import SegmentStore
from neuroshard.node.segments import SegmentConfig, SegmentRecorder
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.segments import SegmentLog
from neuroshard.testing.verifier import small_network
from neuroshard.verifier import models as m
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.db import Database
from neuroshard.verifier.network import NetworkDefinition
from neuroshard.verifier.replaycheck import ReplayCheckConfig, ReplayChecker

pytestmark = pytest.mark.usefixtures("aws_env")

OPERATOR = Wallet.from_token("relay-live-operator")
HONEST, LIAR, SILENT, PARTIAL = (
    Wallet.from_token(f"relay-live-{n}") for n in ("honest", "liar", "silent", "partial")
)
H, K, B, T = 8, 2, 2, 32


def _network(published: PublishedData) -> NetworkDefinition:
    return small_network(
        model={"size": "micro", "vocab_size": 512},
        diloco={"inner_steps": H, "warmup_steps": 2, "total_steps": 100},
        training={"batch_size": B, "seq_len": T, "segment_steps": K},
        data={"manifest_url": str(published.directory), "publisher_key": published.public_key_hex},
    )


class WithholdsItsLast(SegmentService):
    """Answers every route but the last segment of round 0, which it says it does not hold."""

    async def answer(self, path: str, peer_wallet: str) -> bytes | None:
        if path == SEGMENT.format(round=0, segment=H // K - 1):
            raise Refused("not_held", f"{path} is not held here")
        return await super().answer(path, peer_wallet)


@dataclass
class Replica:
    wallet: Wallet
    net: PeerPlane | None
    log: SegmentLog
    base_hash: str
    delta_digest: str
    spans: list[list[int]]


def _replica(
    published: PublishedData, tmp: Path, wallet: Wallet, relay: RelayConfig, *, lie: bool
) -> Replica:
    """A relay replica that trained round 0 by segments; `lie`: it inflated its last segment's
    update by 25% (and committed to it, as a liar must)."""
    network = _network(published)
    config = SegmentConfig(segment_steps=K)
    store = SegmentStore(tmp / wallet.wallet_id, config, log=lambda _: None)
    recorder = SegmentRecorder(config, stage=0, sink=store, network=network.digest())
    diloco = DiLoCo(build_stage(network.model, 0, 1), network.diloco)
    manifest = published.dataset.manifest
    stream = BatchStream(
        source=published.dataset.source, manifest=manifest, seed=wallet.wallet_id, batch_size=B, seq_len=T,
        order=assign_shards(wallet.wallet_id, manifest, exclude={network.held_out_shard}),
    )  # fmt: skip
    recorder.start_round(diloco)
    base, spans, start = tensor_digest(diloco.theta_round), [], None
    for i in range(H):
        if i == H - K:
            start = flat_parameters(diloco.params)
        before = stream.position.offset
        inputs, labels = stream.next_batch()
        span = (stream.shard_id, before, stream.position.offset)
        spans.append(list(span))
        diloco.inner_step(inputs, labels)
        if lie and i == H - 1:
            assert start is not None
            copy_into_parameters(start + 1.25 * (flat_parameters(diloco.params) - start), diloco.params)
        recorder.record_step(diloco, data=span, micro_batch=None, received=[])
    recorder.end_round(diloco)
    delta = diloco.pseudo_gradient()
    diloco.outer_step(delta)
    closed = recorder.close_round(wallet)
    assert closed is not None
    net = None
    service = WithholdsItsLast if wallet == PARTIAL else SegmentService
    if wallet != SILENT:  # the silent replica never runs its gossip loop: nothing answers for it
        net = PeerPlane(
            PeerPlaneConfig(listen=False, relay=relay, join_timeout_s=0, gossip_interval_s=0.2),
            wallet,
            stage=0,
            log=lambda _: None,
            extensions=[service(store, allowed_wallet=OPERATOR.public_key_hex)],
        )
        net.start()
        assert net.node.address is not None and is_relay(net.node.address)
    merged: list[list[int]] = []
    for s, a, b in spans:
        if merged and merged[-1][0] == s and merged[-1][2] == a:
            merged[-1][2] = b
        else:
            merged.append([s, a, b])
    return Replica(wallet, net, closed[0], base, tensor_digest(delta), merged)


@pytest.fixture
def relay(endpoint: str) -> RelayConfig:
    config = RelayConfig(
        url=f"s3://ns-{uuid.uuid4().hex[:12]}/run1",
        endpoint_url=endpoint,
        poll_interval_s=0.05,
        max_poll_s=0.2,
    )
    make_s3_client(config).create_bucket(Bucket=config.bucket)
    return config


@pytest.fixture
def replicas(published: PublishedData, tmp_path: Path, relay: RelayConfig) -> Iterator[list[Replica]]:
    made = [  # the partial one first: a slot it held would keep the checker from the others
        _replica(published, tmp_path, PARTIAL, relay, lie=False),
        _replica(published, tmp_path, HONEST, relay, lie=False),
        _replica(published, tmp_path, LIAR, relay, lie=True),
        _replica(published, tmp_path, SILENT, relay, lie=False),
    ]
    yield made
    for r in made:
        if r.net is not None:
            r.net.stop()


def _receipt(r: Replica) -> m.Receipt:
    first = r.spans[0]
    return m.Receipt(
        wallet_id=r.wallet.wallet_id, stage=0, round=0, inner_steps=H, start_step=0,
        tokens=H * B * T, shard_id=first[0], offset_start=first[1], offset_end=first[2],
        data_spans=r.spans, losses=[], base_hash=r.base_hash, result_hash="1" * 64,
        delta_digest=r.delta_digest, inner_state_digest=None, accepted=[], rejected=[], equivocators=[],
        segment_root=r.log.root(), segments=r.log.segments,
        body_sha256=sha256_hex(r.wallet.public_key), received_at=time.time(),
    )  # fmt: skip


def test_relay_replicas_are_challenged_through_the_bucket(
    replicas: list[Replica], db: Database, published: PublishedData, relay: RelayConfig
) -> None:
    now = time.time()
    with db.write() as s:
        for r in replicas:
            s.add(m.Wallet(wallet_id=r.wallet.wallet_id, public_key=r.wallet.public_key_hex, reputation=0.5,
                           status=m.STATUS_ACTIVE, registered_at=now, software_version="0.1.0"))  # fmt: skip
        s.flush()
        for r in replicas:
            s.add(m.Peer(wallet_id=r.wallet.wallet_id, address=relay_address(r.wallet.public_key_hex), stage=0,
                         registered_at=now, last_heartbeat=now))  # fmt: skip
    lines: list[str] = []
    config = ReplayCheckConfig(
        sample_rate=1.0, segments_per_check=4, max_queue=1, answer_window_s=30.0, relay=relay
    )
    checker = ReplayChecker(
        JobContext(db=db, network=_network(published), operator=OPERATOR, log=lines.append),
        config=config,
        dataset=lambda: published.dataset,
    )
    checker.run_once()  # the first pass notes where the receipts end
    with db.write() as s:
        for r in replicas:
            s.add(_receipt(r))
    deadline = time.monotonic() + 60
    while checker.passed + checker.failed < 2 and time.monotonic() < deadline:
        for challenge in checker.queue:
            challenge.next_try = 0.0  # no RETRY_EVERY_S between tries here
        checker.run_once()
        time.sleep(0.2)
    assert checker.passed == 1 and checker.failed == 1, lines
    with db.read() as s:
        events = {e.wallet_id: e.reason for e in s.scalars(select(m.ReputationEvent))}
    assert "segments [0, 1, 2, 3] of 4 replayed" in events[HONEST.wallet_id], events
    assert "segment 3 of 4: norm ratio" in events[LIAR.wallet_id], events
    (proof,) = checker.fraud_proofs
    assert LIAR.public_key_hex in proof.decode("latin-1")

    # The silent one is asked on every try and never answers; the partial one answered all its
    # pieces but the last, and holds none of them. Both are judged once the window has passed.
    waiting = {c.receipt.wallet_id: c for c in checker.queue}
    assert sorted(waiting) == sorted([SILENT.wallet_id, PARTIAL.wallet_id])
    assert all(c.tries >= 3 and c.first_try is not None and not c.holding for c in waiting.values())
    # Through a bucket the window is longer by the upload of its pieces at the rate floor.
    params = list(build_stage(_network(published).model, 0, 1).parameters())
    numel, tensors = sum(p.numel() for p in params), len(params)
    window = checker._window(waiting[SILENT.wallet_id])
    assert window == pytest.approx(30.0 + 4 * 4 * (7 * numel + 2 * tensors) / (256 << 10))
    for challenge in waiting.values():
        challenge.first_try = time.time() - (window - 1.0)
        challenge.next_try = 0.0
    checker.run_once()
    assert checker.failed == 1 and len(checker.queue) == 2  # not yet
    for challenge in waiting.values():
        challenge.first_try = time.time() - (window + 1.0)
        challenge.next_try = 0.0
    checker.run_once()
    assert checker.failed == 3 and checker.unanswered == 2 and not checker.queue, lines
    with db.read() as s:
        reasons = {
            e.wallet_id: e.reason
            for e in s.scalars(
                select(m.ReputationEvent).where(
                    m.ReputationEvent.wallet_id.in_([SILENT.wallet_id, PARTIAL.wallet_id])
                )
            )
        }
    expected = f"did not answer its challenge within {window:.0f} s (not answered: "
    assert all(expected in reason for reason in reasons.values()), reasons
    assert f"/p2p/segment/0/{H // K - 1} not in the bucket yet" in reasons[PARTIAL.wallet_id], reasons
    assert "/p2p/segment/0/0" not in reasons[PARTIAL.wallet_id], reasons

    # Nothing is left in the bucket's challenge area, and the holders delete their answers in turn.
    client = make_s3_client(relay)

    def left() -> list[str]:
        listing = client.list_objects_v2(Bucket=relay.bucket, Prefix="run1/")
        return [str(o["Key"]) for o in listing.get("Contents", []) if "/check/" in str(o["Key"])]

    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []
