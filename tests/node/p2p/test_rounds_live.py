"""Replicas on real sockets (threads in one process, loopback): rounds that agree, and the failure paths.

Each replica is a real `Trainer` with a real `PeerNetwork`, exactly as the CLI wires
them; only the process boundary is missing (test_swarm.py has that).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig
from neuroshard.node.p2p import wire
from neuroshard.node.p2p.auth import sign_request
from neuroshard.node.p2p.codec import sha256_hex
from neuroshard.node.p2p.network import NetworkConfig, PeerNetwork, majority_pushed
from neuroshard.node.p2p.peers import PeerEntry
from neuroshard.node.p2p.rounds import AggregationRule, Contribution, RoundReport, ordered_mean
from neuroshard.node.trainer import EARLY_CLOSE_FRACTION, Trainer, TrainerConfig, TrainResult
from neuroshard.node.wallet import Wallet

MODEL = ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)
H = 4
DILOCO = DiLoCoConfig(inner_steps=H, inner_lr=3e-3, warmup_steps=2, total_steps=200)
WARMING_UP = DiLoCoConfig(inner_steps=H, inner_lr=3e-3, warmup_steps=60, total_steps=200)
"""A warm-up longer than the whole join test: a joiner must continue it where the others are."""


def _config(**over: object) -> NetworkConfig:
    values: dict[str, object] = dict(
        host="127.0.0.1",
        port=0,
        round_timeout_s=4.0,
        hash_check_timeout_s=3.0,
        join_timeout_s=5.0,
        digest_interval_s=0.1,
        gossip_interval_s=0.2,
        peer_ttl_s=10.0,
        request_timeout_s=5.0,
        connect_timeout_s=2.0,
    )
    return NetworkConfig(**{**values, **over})  # type: ignore[arg-type]


@dataclass
class Replica:
    index: int
    wallet: Wallet
    network: PeerNetwork
    trainer: Trainer
    stop: threading.Event
    lines: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None
    result: TrainResult | None = None
    error: BaseException | None = None

    @property
    def key(self) -> str:
        return self.wallet.public_key_hex

    def start(self) -> None:
        def run() -> None:
            try:
                self.result = self.trainer.run(self.stop)
            except BaseException as exc:  # reported by the test, not lost in the thread
                self.error = exc

        self.thread = threading.Thread(target=run, name=f"replica-{self.index}", daemon=True)
        self.thread.start()

    def reports(self) -> dict[int, RoundReport]:
        return {r.round: r for r in self.network.reports}


Hook = Callable[[Replica, DiLoCo], None]


class Swarm:
    def __init__(self, published, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
        self.published = published
        self.tmp_path = tmp_path
        self.replicas: list[Replica] = []

    def add(
        self,
        max_steps: int | None,
        hook: Hook | None = None,
        rule: AggregationRule = ordered_mean,
        diloco: DiLoCoConfig = DILOCO,
        close_early: bool = False,
        **config: object,
    ) -> Replica:
        index = len(self.replicas)
        wallet = Wallet.from_token(f"p2p-live-{index}")
        stop = threading.Event()
        lines: list[str] = []
        bootstrap = (self.replicas[0].network.address,) if self.replicas else ()
        network = PeerNetwork(
            _config(peers=bootstrap, **config),
            wallet,
            0,
            lines.append,
            aggregate=rule,
            tokens_per_step=64,
            stop=stop,
        )
        network.start()
        replica_ref: list[Replica] = []

        def finish(diloco: DiLoCo) -> None:
            if hook is not None:
                hook(replica_ref[0], diloco)
            else:
                network.finish_round(diloco)

        trainer = Trainer(
            wallet_id=wallet.wallet_id,
            dataset=self.published.dataset,
            model_config=MODEL,
            diloco_config=diloco,
            config=TrainerConfig(
                batch_size=2, seq_len=32, max_steps=max_steps, checkpoint_every=1000, log_every=1000
            ),
            checkpoint_dir=self.tmp_path / f"replica{index}",
            log=lines.append,
            finish_round=finish,
        )
        if close_early:
            trainer.close_rounds_when(network.round_closing)
        replica = Replica(index, wallet, network, trainer, stop, lines)
        replica_ref.append(replica)
        self.replicas.append(replica)
        return replica

    def join_all_and_wait_for_discovery(self) -> None:
        for replica in self.replicas:
            replica.network.join_state(replica.trainer.diloco)
        want = len(self.replicas) - 1
        _wait(lambda: all(len(r.network.live_peers()) == want for r in self.replicas), 10.0, "peer discovery")

    def close(self) -> None:
        for replica in self.replicas:  # shown by pytest when a test fails
            print(f"--- replica {replica.index} {replica.key[:12]}")
            print("\n".join(line for line in replica.lines if "step=" not in line))
        for replica in self.replicas:
            replica.stop.set()
        for replica in self.replicas:
            if replica.thread is not None:
                replica.thread.join(timeout=30.0)
            replica.network.stop()


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def _join_threads(replicas: list[Replica], timeout: float) -> None:
    for replica in replicas:
        assert replica.thread is not None
        replica.thread.join(timeout)
        assert not replica.thread.is_alive(), f"replica {replica.index} did not finish in {timeout:.0f} s"
        assert replica.error is None, f"replica {replica.index} raised {replica.error!r}"


@pytest.fixture
def swarm(published, tmp_path):  # type: ignore[no-untyped-def]
    s = Swarm(published, tmp_path)
    yield s
    s.close()


def test_three_replicas_agree_every_round(swarm) -> None:
    rounds = 4
    replicas = [swarm.add(max_steps=rounds * H) for _ in range(3)]
    swarm.join_all_and_wait_for_discovery()
    for r in replicas:
        r.start()
    _join_threads(replicas, 60.0)
    wallets = sorted(r.key for r in replicas)
    for round_ in range(rounds):
        reports = [r.reports()[round_] for r in replicas]
        assert {rep.theta_hash for rep in reports} == {reports[0].theta_hash}, f"round {round_} diverged"
        for rep in reports:
            assert list(rep.accepted) == wallets and not rep.late and rep.resynced_from is None
            assert (rep.agree, rep.voters) == (3, 3) and rep.rejected == ()
    # The round hashes are the engine's: every replica holds the same θ_round, and it moved.
    assert all(rep.next_round == rep.round + 1 for r in replicas for rep in r.network.reports)
    thetas = [r.trainer.diloco.theta_round.detach() for r in replicas]
    assert all(torch.equal(thetas[0], t) for t in thetas[1:])
    assert all(r.trainer.diloco.round == rounds for r in replicas)
    assert any("p2p round=3 aggregated 3" in line for line in replicas[0].lines)
    # Commit-then-reveal: every replica held all three commitments before it revealed its payload,
    # and every replica holds the same signed reveals (what copy resolution reads) for the last round.
    books = [r.network.node.books[rounds - 1] for r in replicas]
    for book in books:
        assert sorted(book.reveals) == wallets
        assert all(sorted(reveal.holds()) == wallets for reveal in book.reveals.values())
        assert book.reveals == books[0].reveals


def test_a_slow_replica_closes_its_round_early_once_the_majority_pushed(swarm) -> None:
    steps: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def record(replica: Replica, diloco: DiLoCo) -> None:
        steps[replica.index].append(diloco.steps_in_round)
        replica.network.finish_round(diloco)

    # The same max_steps: a round closed early counts as H, so the slow replica stops after round 1 too.
    replicas = [swarm.add(max_steps=2 * H, hook=record, close_early=True) for _ in range(3)]
    slow = replicas[2]
    inner_step = slow.trainer.diloco.inner_step

    def slow_step(inputs: torch.Tensor, labels: torch.Tensor) -> float:
        time.sleep(0.5)  # the two others push each round while this one is in its first steps
        return inner_step(inputs, labels)

    slow.trainer.diloco.inner_step = slow_step  # type: ignore[method-assign]
    swarm.join_all_and_wait_for_discovery()
    for r in replicas:
        r.start()
    _join_threads(replicas, 60.0)
    short = math.ceil(EARLY_CLOSE_FRACTION * H)
    assert steps == {0: [H, H], 1: [H, H], 2: [short, short]}
    wallets = sorted(r.key for r in replicas)
    for round_ in range(2):
        reports = [r.reports()[round_] for r in replicas]
        assert {rep.theta_hash for rep in reports} == {reports[0].theta_hash}, f"round {round_} diverged"
        for rep in reports:  # the short Δ is screened like the others and accepted
            assert list(rep.accepted) == wallets and rep.rejected == () and not rep.late
    thetas = [r.trainer.diloco.theta_round.detach() for r in replicas]
    assert all(torch.equal(thetas[0], t) for t in thetas[1:])
    assert slow.result is not None and (slow.result.steps, slow.result.rounds) == (2 * short, 2)


def test_a_replica_that_dies_mid_round_does_not_stop_the_others(swarm) -> None:
    rounds = 3

    def die_in_round_1(replica: Replica, diloco: DiLoCo) -> None:
        if diloco.round == 1:
            replica.network.stop()  # the process is gone: its port refuses connections
            raise SystemExit("killed")
        replica.network.finish_round(diloco)

    a, b = swarm.add(max_steps=rounds * H), swarm.add(max_steps=rounds * H)
    dying = swarm.add(max_steps=rounds * H, hook=die_in_round_1)
    swarm.join_all_and_wait_for_discovery()
    for r in (a, b, dying):
        r.start()
    _join_threads([a, b], 60.0)
    assert isinstance(dying.error, SystemExit)
    survivors = sorted([a.key, b.key])
    assert list(a.reports()[0].accepted) == sorted([a.key, b.key, dying.key])
    for round_ in (1, 2):
        ra, rb = a.reports()[round_], b.reports()[round_]
        assert ra.theta_hash == rb.theta_hash
        assert list(ra.accepted) == list(rb.accepted) == survivors


def test_a_replica_killed_mid_upload_does_not_stop_the_others(swarm) -> None:
    """The dying replica's payload upload stops half way: its TCP connection is reset after half
    the body, as when the process is SIGKILLed during the POST, and the replica is gone at once.
    The peers must refuse the torn body without a change of state and finish the round."""
    rounds = 3
    a, b = swarm.add(max_steps=rounds * H), swarm.add(max_steps=rounds * H)
    torn: list[str] = []

    async def torn_push(peer: PeerEntry, own: Contribution, reveal: wire.Reveal) -> None:
        exchange = dying.network._exchange
        await exchange.call(  # the reveal goes through whole: the peers now want the payload
            peer, "POST", wire.REVEAL, body=reveal.to_json(), max_bytes=0,
            timeout_s=exchange.timings.control_timeout_s,
        )  # fmt: skip
        body = own.payload
        head = {
            wire.CONTRIBUTION_HEADER: own.header.to_json().decode(),
            **sign_request(dying.wallet, "POST", wire.CONTRIBUTION, body, time.time()),
            "Host": peer.address,
            "Content-Type": "application/octet-stream",
            "Content-Length": str(len(body)),
        }
        host, port = peer.address.rsplit(":", 1)
        _, writer = await asyncio.open_connection(host, int(port))
        request = f"POST {wire.CONTRIBUTION} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
        writer.write(request.encode() + b"\r\n" + body[: len(body) // 2])
        await writer.drain()
        writer.transport.abort()  # killed: a reset, no more bytes
        torn.append(peer.wallet)
        if len(torn) == 2:  # the process is gone: its port refuses connections, it sends nothing more
            await dying.network._runner.cleanup()  # type: ignore[union-attr]
            await exchange.client.close()

    def die_uploading_in_round_1(replica: Replica, diloco: DiLoCo) -> None:
        dying_round = diloco.round == 1
        if dying_round:
            replica.network._exchange._push = torn_push  # type: ignore[method-assign]
        replica.network.finish_round(diloco)  # round 1: its exchange fails once it is "dead"
        if dying_round:
            replica.network.stop()
            raise SystemExit("killed mid-upload")

    dying = swarm.add(max_steps=rounds * H, hook=die_uploading_in_round_1)
    swarm.join_all_and_wait_for_discovery()
    for r in (a, b, dying):
        r.start()
    _join_threads([a, b], 60.0)
    assert isinstance(dying.error, SystemExit) and sorted(torn) == sorted([a.key, b.key])
    survivors = sorted([a.key, b.key])
    for round_ in range(rounds):
        ra, rb = a.reports()[round_], b.reports()[round_]
        assert ra.theta_hash == rb.theta_hash, f"round {round_} diverged"
        assert list(ra.accepted) == list(rb.accepted)
    # Round 1: the torn bodies were never taken; its Δ counts only if a peer pulled it whole from the
    # dying replica before it went (both then hold the same signed bytes). Round 2: without it.
    assert set(a.reports()[1].accepted) >= set(survivors)
    assert list(a.reports()[2].accepted) == survivors
    for replica in (a, b):
        held = replica.network.node.books[1].accepted.get(dying.key)
        assert held is None or held.header.payload_sha256 == sha256_hex(held.payload)


def test_a_slow_replica_is_late_adopts_the_new_state_and_rejoins(swarm) -> None:
    rounds = 3
    timeout = 2.0

    def stall_in_round_1(replica: Replica, diloco: DiLoCo) -> None:
        if diloco.round == 1:
            time.sleep(timeout + 1.5)  # alive (its server answers) but past the others' deadline
        replica.network.finish_round(diloco)

    a, b = swarm.add(rounds * H, round_timeout_s=timeout), swarm.add(rounds * H, round_timeout_s=timeout)
    slow = swarm.add(rounds * H, hook=stall_in_round_1, round_timeout_s=timeout)
    swarm.join_all_and_wait_for_discovery()
    for r in (a, b, slow):
        r.start()
    _join_threads([a, b, slow], 60.0)
    late = slow.reports()[1]
    assert late.late and late.accepted == () and late.resynced_from in (a.key, b.key)
    assert late.theta_hash == a.reports()[1].theta_hash == b.reports()[1].theta_hash
    assert list(a.reports()[1].accepted) == sorted([a.key, b.key])
    # Next round the slow replica contributes again and everyone agrees.
    final = [r.reports()[2] for r in (a, b, slow)]
    assert {rep.theta_hash for rep in final} == {final[0].theta_hash}
    assert all(len(rep.accepted) == 3 for rep in final)


def test_corrupted_weights_are_detected_by_hash_and_resynced(swarm) -> None:
    rounds = 3

    def corrupt_in_round_1(replica: Replica, diloco: DiLoCo) -> None:
        if diloco.round == 1:
            with torch.no_grad():
                diloco.theta_round[:10] += 1.0  # a bit flip's worth of damage in memory
        replica.network.finish_round(diloco)

    a, b = swarm.add(rounds * H), swarm.add(rounds * H)
    bad = swarm.add(rounds * H, hook=corrupt_in_round_1)
    swarm.join_all_and_wait_for_discovery()
    for r in (a, b, bad):
        r.start()
    _join_threads([a, b, bad], 60.0)
    healthy = a.reports()[1]
    assert [w for w, _ in healthy.rejected] == [bad.key]
    assert "base_hash" in healthy.rejected[0][1]
    fixed = bad.reports()[1]
    # Whether it sees the others' closed set first (late) or compares hashes after its own
    # step (minority) depends on timing; either way it ends the round on the majority's θ.
    assert fixed.resynced_from in (a.key, b.key)
    assert fixed.theta_hash == healthy.theta_hash == b.reports()[1].theta_hash
    final = [r.reports()[2] for r in (a, b, bad)]
    assert {rep.theta_hash for rep in final} == {final[0].theta_hash} and len(final[0].accepted) == 3


def test_a_replica_whose_outer_step_differs_is_in_the_minority_and_resyncs(swarm) -> None:
    rounds = 2

    def off_by_a_little(stack: torch.Tensor) -> torch.Tensor:
        return ordered_mean(stack) * 1.001  # faulty arithmetic: same inputs, different θ

    a, b = swarm.add(rounds * H), swarm.add(rounds * H)
    odd = swarm.add(rounds * H, rule=off_by_a_little)
    swarm.join_all_and_wait_for_discovery()
    for r in (a, b, odd):
        r.start()
    _join_threads([a, b, odd], 60.0)
    for round_ in range(rounds):
        reports = [r.reports()[round_] for r in (a, b, odd)]
        assert all(len(rep.accepted) == 3 for rep in reports)  # its contribution is fine
        assert {rep.theta_hash for rep in reports} == {reports[0].theta_hash}
        assert reports[2].resynced_from in (a.key, b.key) and not reports[2].late
        assert (reports[2].agree, reports[2].voters) == (2, 3)
    assert sum("is in the minority" in line for line in odd.lines) == rounds


def test_a_node_started_later_joins_by_state_sync(swarm) -> None:
    a, b = swarm.add(max_steps=10 * H, diloco=WARMING_UP), swarm.add(max_steps=10 * H, diloco=WARMING_UP)
    swarm.join_all_and_wait_for_discovery()
    a.start()
    b.start()
    _wait(lambda: len(a.network.reports) >= 3, 30.0, "three rounds before the joiner starts")
    joiner = swarm.add(max_steps=None, diloco=WARMING_UP)
    assert joiner.network.join_state(joiner.trainer.diloco)
    start_round = joiner.trainer.diloco.round
    assert start_round >= 3
    assert any("joined by state sync" in line for line in joiner.lines)
    joiner.start()
    _join_threads([a, b], 60.0)
    joiner.stop.set()
    _join_threads([joiner], 30.0)
    theirs = {rep.next_round: rep for rep in a.network.reports}
    ours = joiner.network.reports
    assert ours and ours[0].round == start_round, "the joiner finishes the round it joined in"
    # Every state the joiner ends a round with is the one the others hold for that round
    # (if it was slow it may skip ahead: late, adopting a later round's state).
    compared = [rep for rep in ours if rep.next_round in theirs]
    assert len(compared) >= 2
    for rep in compared:
        assert rep.theta_hash == theirs[rep.next_round].theta_hash, f"θ_{rep.next_round}"
    assert any(len(rep.accepted) == 3 for rep in compared), "the joiner contributes in later rounds"
    # In the warm-up: the joiner continues the schedule where the others are (round × H), so its
    # Δ is as long as theirs; restarting its own warm-up, it was refused as a near free rider.
    refused = [
        reason
        for rep in a.network.reports + b.network.reports
        for w, reason in rep.rejected
        if w == joiner.key
    ]
    assert refused == [], refused


@pytest.mark.parametrize(
    ("pushed", "replicas", "closing"),
    [(1, 2, False), (1, 3, False), (2, 3, True), (2, 4, False), (3, 4, True), (2, 5, False), (3, 5, True)],
)
def test_only_a_strict_majority_of_the_stage_closes_a_round_early(
    pushed: int, replicas: int, closing: bool
) -> None:
    # With 4 replicas, one attacker pushing at once plus one fast honest replica (2 of 4) is not
    # enough to cut the other two honest replicas' rounds short.
    assert majority_pushed(pushed, replicas) is closing
