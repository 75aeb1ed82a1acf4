"""2 stages × 2 replicas on real sockets (threads in one process, loopback), wired as the CLI wires them.

Stage 0: two `Trainer`s with a remote loss (they read data and drive). Stage 1: two
`start_stage_replica` replicas (head and loss). Each stage runs its own DiLoCo rounds.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from neuroshard.node.device import Placement
from neuroshard.node.diloco import DiLoCoConfig
from neuroshard.node.model import ModelConfig
from neuroshard.node.p2p.pipeline import PipelineConfig
from neuroshard.node.p2p.pipeline_wire import encode_activations
from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig
from neuroshard.node.p2p.stages import PipelineLink
from neuroshard.node.pipeline import remote_loss
from neuroshard.node.reporting import Reporting
from neuroshard.node.stage_replica import StageReplica, start_stage_replica
from neuroshard.node.stage_worker import WorkerConfig
from neuroshard.node.trainer import Trainer, TrainerConfig, TrainResult
from neuroshard.node.vocab import VocabSchedule, vocab_of
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.reports import MAX_DISPUTES

MODEL = ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)
H = 5
ROUNDS = 4
DILOCO = DiLoCoConfig(inner_steps=H, inner_lr=1e-2, warmup_steps=2, total_steps=200)
PIPE = PipelineConfig(
    num_stages=2, request_timeout_s=10.0, deadline_s=30.0, ban_s=5.0, network="5e" * 32, audit_rate=0.0,
    probation_audit_rate=0.0,
)  # fmt: skip
"""No audits: the stage-1 replicas here stop after a fixed count of steps, which audit copies would
use up before the drivers' last micro-batches (audits over loopback: tests/node/p2p/test_pipeline.py)."""


def _net(**over: object) -> PeerPlaneConfig:
    values: dict[str, object] = dict(
        host="127.0.0.1", port=0, round_timeout_s=15.0, hash_check_timeout_s=5.0, join_timeout_s=3.0,
        poll_interval_s=0.1, gossip_interval_s=0.2, peer_ttl_s=10.0, request_timeout_s=5.0, connect_timeout_s=2.0,
    )  # fmt: skip
    return PeerPlaneConfig(**{**values, **over})  # type: ignore[arg-type]


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


class Driver:
    """A stage-0 replica: Trainer + PeerPlane + PipelineLink, as `neuroshard-node --stage 0` builds them."""

    def __init__(  # type: ignore[no-untyped-def]
        self,
        index: int,
        published,
        tmp_path: Path,
        bootstrap: tuple[str, ...],
        pipe: PipelineConfig = PIPE,
        model: ModelConfig = MODEL,
        placement: Placement | None = None,
        vocab: VocabSchedule | None = None,
        **net: object,
    ) -> None:
        self.wallet = Wallet.from_token(f"pipeline-driver-{index}")
        self.stop = threading.Event()
        self.lines: list[str] = []
        self.network = PeerPlane(
            _net(peers=bootstrap, **net), self.wallet, 0, self.lines.append, stop=self.stop
        )
        self.network.start()
        self.link = PipelineLink(
            self.network,
            pipe,
            stop=self.stop,
            round_of=lambda: self.trainer.diloco.round,
            step_of=lambda: self.trainer.diloco.step,
            log=self.lines.append,
        )
        self.link.start()
        self.trainer = Trainer(
            wallet_id=self.wallet.wallet_id,
            dataset=published.dataset,
            model_config=model,
            diloco_config=DILOCO,
            config=TrainerConfig(
                batch_size=4, seq_len=32, max_steps=ROUNDS * H, checkpoint_every=1000, log_every=1000
            ),
            checkpoint_dir=tmp_path / f"driver{index}",
            log=self.lines.append,
            finish_round=self.network.finish_round,
            num_stages=pipe.num_stages,
            loss_fn=remote_loss(self.link.downstream, self.link.blame_driven),
            placement=placement,
            vocab_schedule=vocab,
        )
        if vocab is not None:
            vocab.on_grown = self.network.republish
        self.result: TrainResult | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        def run() -> None:
            try:
                self.result = self.trainer.run(self.stop)
            except BaseException as exc:  # reported by the test
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(30.0)
        self.link.close()
        self.network.stop()


class Stage1:
    """A stage > 0 replica (stage 1 unless told), as `neuroshard-node --stage i` builds it."""

    def __init__(
        self,
        index: int,
        bootstrap: tuple[str, ...],
        max_steps: int | None,
        *,
        stage: int = 1,
        pipe: PipelineConfig = PIPE,
        model: ModelConfig = MODEL,
        placement: Placement | None = None,
        vocab: VocabSchedule | None = None,
        reporting: Reporting | None = None,
        **net: object,
    ) -> None:
        self.wallet = Wallet.from_token(f"pipeline-stage{stage}-{index}")
        self.stop = threading.Event()
        self.lines: list[str] = []
        self.replica: StageReplica = start_stage_replica(
            wallet=self.wallet,
            stage=stage,
            model_config=model,
            diloco_config=DILOCO,
            network_config=_net(peers=bootstrap, **net),
            pipeline_config=pipe,
            worker_config=WorkerConfig(max_steps=max_steps, log_every=1000),
            stop=self.stop,
            log=self.lines.append,
            placement=placement,
            vocab_schedule=vocab,
            reporting=reporting,
        )
        self.result: TrainResult | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.result = self.replica.worker.run(self.stop)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30.0)
        self.replica.close()


def _dump_and_close(made: list[Driver | Stage1]) -> None:
    """Print every replica's log (pytest shows it for a failed test), then close them, newest first."""
    for m in made:
        print(f"--- {type(m).__name__} {m.wallet.wallet_id}")
        print("\n".join(m.lines))
    for m in reversed(made):
        m.close()


Build2x2 = Callable[..., tuple[list[Driver], list[Stage1]]]


@pytest.fixture
def build_2x2(published, tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[Driver | Stage1] = []

    def build(
        stage1_max_steps: int | None,
        placements: tuple[Placement | None, Placement | None] = (None, None),
        growth: tuple[int, int, int] | None = None,
        **stage1_net: object,
    ) -> tuple[list[Driver], list[Stage1]]:
        """`placements`: replica 0's and replica 1's (of each stage); None is CPU fp32. `growth`:
        (vocabulary, stage 1's round, stage 0's round), each replica told as its tracker would tell it."""

        told: list[tuple[VocabSchedule, int]] = []  # set once all are built, as a tracker would tell them

        def vocab(stage: int) -> VocabSchedule | None:
            if growth is None:
                return None
            schedule = VocabSchedule()
            told.append((schedule, growth[2 - stage]))
            return schedule

        first = Stage1(0, (), stage1_max_steps, placement=placements[0], vocab=vocab(1), **stage1_net)
        made.append(first)
        boot = (first.replica.network.address,)
        made.append(Stage1(1, boot, stage1_max_steps, placement=placements[1], vocab=vocab(1), **stage1_net))
        made.extend(
            Driver(i, published, tmp_path, boot, placement=placements[i], vocab=vocab(0)) for i in range(2)
        )
        for schedule, from_round in told:
            schedule.set(growth[0], from_round)  # type: ignore[index]
        drivers = [m for m in made if isinstance(m, Driver)]
        for d in drivers:
            d.network.join_state(d.trainer.diloco)  # announces the driver (stage 1 joined at start)
        everyone = [d.network for d in drivers] + [m.replica.network for m in made if isinstance(m, Stage1)]
        _wait(lambda: all(len(n.live_peers()) == 1 for n in everyone), 10.0, "stage peers to find each other")
        _wait(
            lambda: all(len(d.network.node.peers.live(time.time(), 1)) == 2 for d in drivers),
            10.0,
            "drivers to learn both stage-1 replicas",
        )
        return drivers, [m for m in made if isinstance(m, Stage1)]

    try:
        yield build
    finally:
        _dump_and_close(made)


def _finish(drivers: list[Driver], timeout: float) -> None:
    for d in drivers:
        assert d.thread is not None
        d.thread.join(timeout)
        assert not d.thread.is_alive(), f"a driver did not finish in {timeout:.0f} s"
        assert d.error is None, f"driver raised {d.error!r}"


def _run_all(drivers: list[Driver], stage1: list[Stage1]) -> None:
    """Start the drivers and wait for them and for the stage-1 replicas' last steps."""
    for d in drivers:
        d.start()
    _finish(drivers, 120.0)
    for s in stage1:
        s.thread.join(30.0)
        assert not s.thread.is_alive(), "a stage-1 replica did not finish its steps"


def _stage_agrees(networks: list[PeerPlane], rounds: range) -> None:
    for round_ in rounds:
        reports = [{r.round: r for r in n.reports}[round_] for n in networks]
        assert len({rep.theta_hash for rep in reports}) == 1, f"round {round_} diverged"


def _loss_fell(drivers: list[Driver], by: float) -> tuple[float, float]:
    losses = [d.result.losses for d in drivers if d.result is not None]
    first = sum(sum(ls[:H]) for ls in losses) / (len(losses) * H)
    last = sum(sum(ls[-H:]) for ls in losses) / (len(losses) * H)
    assert last < first - by, f"loss {first:.3f} -> {last:.3f}"
    return first, last


def test_two_stages_by_two_replicas_train_through_the_pipeline(build_2x2: Build2x2) -> None:
    drivers, stage1 = build_2x2(ROUNDS * H)
    started = time.monotonic()
    _run_all(drivers, stage1)
    elapsed = time.monotonic() - started

    # Every stage did ROUNDS rounds, and in each its two replicas agree on θ with both contributions.
    for stage_networks in ([d.network for d in drivers], [s.replica.network for s in stage1]):
        _stage_agrees(stage_networks, range(ROUNDS))
        assert all(len(r.accepted) == 2 and not r.late for n in stage_networks for r in n.reports)
    hashes = [d.trainer.diloco.weights_hash() for d in drivers]
    assert hashes[0] == hashes[1]
    assert stage1[0].replica.diloco.weights_hash() == stage1[1].replica.diloco.weights_hash()
    assert all(s.replica.diloco.round == ROUNDS for s in stage1)

    # Both stage-1 replicas trained (the wiring spread the work), and the loss fell.
    served = [s.replica.service.served for s in stage1]
    assert all(n > 0 for n in served) and sum(served) >= 2 * ROUNDS * H
    first, last = _loss_fell(drivers, 0.3)
    print(
        f"2x2 pipeline: loss {first:.3f} -> {last:.3f} over {ROUNDS} rounds of H={H} in {elapsed:.1f} s; served {served}"
    )
    # The activations crossed the wire in the run's codec: a driver sent at least what its
    # (4, 32, 32) micro-batches take encoded.
    one = len(encode_activations(torch.zeros(4, 32, 32), torch.zeros(4, 32, dtype=torch.int64), PIPE.codec))
    sent = drivers[0].link.client.traffic.bytes_sent
    assert sent >= ROUNDS * H * one
    assert torch.isfinite(drivers[0].trainer.diloco.theta_round).all()


def test_replicas_of_each_stage_in_fp32_and_bf16_autocast_agree_every_round(build_2x2: Build2x2) -> None:
    """Mixed hardware in a pipeline: in each stage one replica runs its layers in fp32, the other
    under bf16 autocast (CPU autocast: the device path a GPU takes, minus the device). The outer
    round is CPU fp32 either way, so each stage still ends every round bit-identical."""
    bf16 = Placement(device=torch.device("cpu"), precision="bf16")
    drivers, stage1 = build_2x2(ROUNDS * H, placements=(None, bf16))
    _run_all(drivers, stage1)
    assert [d.trainer.diloco.placement.precision for d in drivers] == ["fp32", "bf16"]
    assert [s.replica.diloco.placement.precision for s in stage1] == ["fp32", "bf16"]
    for stage_networks in ([d.network for d in drivers], [s.replica.network for s in stage1]):
        _stage_agrees(stage_networks, range(ROUNDS))
        assert all(len(r.accepted) == 2 for n in stage_networks for r in n.reports)
    assert drivers[0].trainer.diloco.weights_hash() == drivers[1].trainer.diloco.weights_hash()
    assert stage1[0].replica.diloco.weights_hash() == stage1[1].replica.diloco.weights_hash()
    _loss_fell(drivers, 0.3)


def test_a_vocabulary_growth_keeps_every_stage_s_replicas_bit_identical(build_2x2: Build2x2) -> None:
    """The verifier schedules the head (stage 1) to grow at its round 1 and the embedding (stage 0)
    at its round 2; each replica grows at that boundary, and every round of both stages agrees."""
    drivers, stage1 = build_2x2(ROUNDS * H, growth=(600, 1, 2))
    _run_all(drivers, stage1)
    for stage_networks in ([d.network for d in drivers], [s.replica.network for s in stage1]):
        _stage_agrees(stage_networks, range(ROUNDS))
        assert all(len(r.accepted) == 2 for n in stage_networks for r in n.reports)
    assert [vocab_of(d.trainer.diloco) for d in drivers] == [600, 600]
    assert [vocab_of(s.replica.diloco) for s in stage1] == [600, 600]
    assert stage1[0].replica.service.label_bound == 600
    assert drivers[0].trainer.diloco.weights_hash() == drivers[1].trainer.diloco.weights_hash()
    assert stage1[0].replica.diloco.weights_hash() == stage1[1].replica.diloco.weights_hash()
    assert all(
        any("grew 512 -> 600 at round 1 as scheduled: head" in line for line in s.lines) for s in stage1
    )
    assert all(
        any("grew 512 -> 600 at round 2 as scheduled: embedding" in line for line in d.lines) for d in drivers
    )
    # What each replica serves its stage (joiners, hash checks) is the grown state.
    assert all(s.replica.network.node.snapshot.numel == s.replica.diloco.theta_round.numel() for s in stage1)
    _loss_fell(drivers, 0.2)


def test_when_a_stage_1_replica_dies_the_drivers_go_on_through_the_other(build_2x2: Build2x2) -> None:
    # Stage 1 runs until stopped (the survivor takes on the dead one's share); short round timeout so
    # the survivor's round without its peer ends soon.
    drivers, (survivor, victim) = build_2x2(None, round_timeout_s=3.0)
    for d in drivers:
        d.start()
    _wait(lambda: victim.replica.service.served >= H + 2, 60.0, "the victim to be mid-round 1")
    victim.stop.set()  # its worker ends after the step in hand (mid-round 1: not in an outer round)
    victim.thread.join(10.0)
    assert not victim.thread.is_alive()
    victim.replica.network.stop()  # its port refuses from now on, as if the process died
    _finish(drivers, 120.0)
    survivor.stop.set()
    survivor.thread.join(30.0)

    _stage_agrees([d.network for d in drivers], range(ROUNDS))
    assert all(d.trainer.diloco.round == ROUNDS for d in drivers)
    # The drivers banned the dead replica and retried its micro-batches on the survivor.
    assert any(
        "banned" in line and victim.wallet.public_key_hex[:12] in line for d in drivers for line in d.lines
    )
    assert sum(d.link.client.retries for d in drivers) >= 1
    assert survivor.replica.service.served > victim.replica.service.served
    assert survivor.replica.service.served + victim.replica.service.served >= 2 * ROUNDS * H
    assert survivor.replica.diloco.round >= ROUNDS - 1
    _loss_fell(drivers, 0.2)


def test_a_stage_1_replica_answering_overflowing_gradients_is_banned_and_the_drivers_train_on(
    build_2x2: Build2x2,
) -> None:
    """One stage-1 replica trains as it should but answers every micro-batch with a gradient of
    1e30s (encodable in the default codec, and past what a driver's backward survives): before,
    the first such answer turned a driver's weights to NaN. The drivers blame it, ban it for
    longer at each blame, send the micro-batch to the other replica, and end every round
    bit-identical with finite weights and a falling loss."""
    # Stage 1 serves until stopped; a short round timeout: the hostile replica, banned, falls behind.
    drivers, (honest, hostile) = build_2x2(
        None, round_timeout_s=2.0, hash_check_timeout_s=1.0, commit_timeout_s=1.0
    )
    worker = hostile.replica.worker
    settle = worker._settle
    worker._settle = lambda job, grad, loss, round_: settle(job, torch.full_like(grad, 1e30), loss, round_)  # type: ignore[method-assign]
    for d in drivers:
        d.start()
    _finish(drivers, 120.0)
    for s in (honest, hostile):
        s.stop.set()
        s.thread.join(30.0)
    _stage_agrees([d.network for d in drivers], range(ROUNDS))
    assert all(d.trainer.diloco.round == ROUNDS for d in drivers)
    assert all(bool(torch.isfinite(d.trainer.diloco.theta_round).all()) for d in drivers)
    blamed = [d.link.client.blamed for d in drivers]
    assert sum(blamed) >= 1 and hostile.replica.service.served >= sum(blamed)
    told = [line for d in drivers for line in d.lines if "overflows this stage's backward" in line]
    assert len(told) == sum(blamed) and all(hostile.wallet.public_key_hex[:12] in line for line in told)
    assert honest.replica.service.served >= 2 * ROUNDS * H
    print(
        f"hostile stage-1 replica: blamed {blamed} times by the two drivers, served {hostile.replica.service.served}"
    )
    _loss_fell(drivers, 0.2)


def _three_stages(
    published, tmp_path: Path, middle_net: dict[str, object], driver_net: dict[str, object]
) -> tuple[Driver, Stage1, Stage1]:  # type: ignore[no-untyped-def]
    """One replica each of stages 0, 1 and 2 of 3 (stage 2 with a port; the others' peer planes
    take `middle_net` / `driver_net` on top), trained through ROUNDS rounds; the run's checks that
    do not depend on the wiring are made here."""
    model = dataclasses.replace(MODEL, n_layers=3)
    pipe = dataclasses.replace(PIPE, num_stages=3)
    made: list[Driver | Stage1] = []
    try:
        last = Stage1(0, (), ROUNDS * H, stage=2, pipe=pipe, model=model)
        made.append(last)
        boot = (last.replica.network.address,)
        reporting = Reporting.nobody(lambda line: None)
        middle = Stage1(
            0, boot, ROUNDS * H, stage=1, pipe=pipe, model=model, reporting=reporting, **middle_net
        )
        made.append(middle)
        # Its neighbours' memberships are the ones its tracker would keep current (none here: everyone).
        assert middle.replica.service.senders is reporting.neighbours[0]
        assert (
            middle.replica.link is not None
            and middle.replica.link.client.receivers is reporting.neighbours[2]
        )
        driver = Driver(0, published, tmp_path, boot, pipe=pipe, model=model, **driver_net)
        made.append(driver)
        driver.network.join_state(driver.trainer.diloco)
        _wait(
            lambda: len(driver.network.node.peers.live(time.time(), 1)) == 1,
            20.0,
            "the driver to learn stage 1",
        )
        _wait(
            lambda: len(middle.replica.network.node.peers.live(time.time(), 2)) == 1,
            20.0,
            "stage 1 to learn 2",
        )
        driver.start()
        _finish([driver], 120.0)
        for s in (middle, last):
            s.thread.join(30.0)
            assert not s.thread.is_alive()
    finally:
        _dump_and_close(made)
    assert [list(m.replica.diloco.model.layer_range) for m in (middle, last)] == [[1], [2]]
    assert middle.replica.service.served == last.replica.service.served == ROUNDS * H
    assert middle.replica.link is not None and middle.replica.link.client.traffic.requests == ROUNDS * H
    assert (
        all(s.replica.diloco.round == ROUNDS for s in (middle, last))
        and driver.trainer.diloco.round == ROUNDS
    )
    # The middle stage's logged loss is the last stage's, relayed back with the gradient.
    assert middle.replica.worker.stats.losses == last.replica.worker.stats.losses
    _loss_fell([driver], 0.3)
    return driver, middle, last


def test_three_stages_one_replica_each_train_through_a_middle_stage(published, tmp_path: Path) -> None:
    """Stage 1 of 3 receives, runs its layer, forwards to stage 2 and relays the gradient back."""
    _three_stages(published, tmp_path, {}, {})


@pytest.mark.usefixtures("aws_env")
def test_two_stages_all_behind_nat_train_through_the_bucket(published, tmp_path: Path, endpoint: str) -> None:
    """`--relay` without `--port` on every replica of both stages: no replica opens a port to the
    network. The drivers put their signed micro-batches in the (moto) bucket, each stage-1 replica
    takes them from there into its own server on a loopback port and puts the gradients back
    (node.p2p.mailbox). Both stages still agree every round with both contributions, both stage-1
    replicas get work, and the loss falls."""
    import boto3

    from neuroshard.node.p2p.bucket import RelayConfig
    from neuroshard.node.p2p.relay import is_relay

    bucket = f"pipe-{time.monotonic_ns()}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)

    def nat() -> dict[str, object]:
        relay = RelayConfig(
            url=f"s3://{bucket}/run1", endpoint_url=endpoint, poll_interval_s=0.05, max_poll_s=0.2
        )
        return {"relay": relay, "listen": False}

    made: list[Driver | Stage1] = []
    try:
        stage1 = [Stage1(i, (), None, **nat()) for i in range(2)]  # they run until told the drivers end
        made.extend(stage1)
        drivers = [Driver(i, published, tmp_path, (), **nat()) for i in range(2)]
        made.extend(drivers)
        for d in drivers:
            d.network.join_state(d.trainer.diloco)
        everyone = [d.network for d in drivers] + [s.replica.network for s in stage1]
        assert all(is_relay(n.address) for n in everyone)
        _wait(lambda: all(len(n.live_peers()) == 1 for n in everyone), 20.0, "stage peers to find each other")
        _wait(
            lambda: all(len(d.network.node.peers.live(time.time(), 1)) == 2 for d in drivers),
            20.0,
            "drivers to learn both stage-1 replicas from the bucket",
        )
        for d in drivers:
            d.start()
        _finish(drivers, 120.0)
        for d in drivers:  # as `neuroshard-node` does after --max-steps: a signed end, through the bucket too
            d.link.end(d.trainer.diloco.round, d.trainer.diloco.step)
        for s in stage1:
            s.thread.join(30.0)
            assert not s.thread.is_alive(), "a stage-1 replica did not end when its senders did"
    finally:
        _dump_and_close(made)
    for stage_networks in ([d.network for d in drivers], [s.replica.network for s in stage1]):
        _stage_agrees(stage_networks, range(ROUNDS))
        assert all(len(r.accepted) == 2 for n in stage_networks for r in n.reports)
    served = [s.replica.service.served for s in stage1]
    assert all(n > 0 for n in served) and sum(served) >= 2 * ROUNDS * H
    assert all(any("through the bucket (server on 127.0.0.1:" in line for line in s.lines) for s in stage1)
    assert all(any("told 2/2 stage 1 replica(s)" in line for line in d.lines) for d in drivers)
    # Every micro-batch went through the bucket: the drivers' pipeline traffic is mailbox requests.
    assert sum(d.link.client.traffic.requests for d in drivers) >= 2 * ROUNDS * H
    _loss_fell(drivers, 0.3)


@pytest.mark.usefixtures("aws_env")
def test_a_middle_stage_behind_nat_takes_from_a_direct_driver_and_sends_to_a_direct_stage(
    published, tmp_path: Path, endpoint: str
) -> None:
    """Mixed: the driver has a port (and the bucket), stage 1 of 3 is behind NAT, stage 2 has a port.
    The driver reaches stage 1 through the bucket; stage 1 reaches stage 2 over plain HTTP, an
    outbound connection, and relays its gradients back through the bucket."""
    import boto3

    from neuroshard.node.p2p.bucket import RelayConfig
    from neuroshard.node.p2p.relay import is_relay

    bucket = f"pipe3-{time.monotonic_ns()}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)

    def relay() -> RelayConfig:
        return RelayConfig(
            url=f"s3://{bucket}/run1", endpoint_url=endpoint, poll_interval_s=0.05, max_poll_s=0.2
        )

    driver, middle, _ = _three_stages(
        published, tmp_path, {"relay": relay(), "listen": False}, {"relay": relay()}
    )
    assert is_relay(middle.replica.network.address) and not is_relay(driver.network.address)


def test_drivers_auditing_three_stage_1_replicas_outvote_and_ban_one_that_negates_its_answers(
    published, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The hole audits narrow, on the wire: one of three stage-1 replicas trains as it should but
    answers every micro-batch with its gradient negated. Two drivers audit every answer (so every
    micro-batch also goes to a second replica, and to a third on a disagreement). The hostile
    replica is outvoted by the two honest ones and banned, doubling; no honest replica is ever
    outvoted; the drivers end every round bit-identical with a falling loss."""
    audited = dataclasses.replace(PIPE, audit_rate=1.0, probation_audit_rate=1.0)
    stage1_net: dict[str, object] = dict(round_timeout_s=2.0, hash_check_timeout_s=1.0, commit_timeout_s=1.0)
    made: list[Driver | Stage1] = []
    try:
        first = Stage1(0, (), None, **stage1_net)
        made.append(first)
        boot = (first.replica.network.address,)
        made.extend(Stage1(i, boot, None, **stage1_net) for i in (1, 2))
        stage1 = [m for m in made if isinstance(m, Stage1)]
        hostile = stage1[2]
        worker = hostile.replica.worker
        settle = worker._settle
        worker._settle = lambda job, grad, loss, round_: settle(job, -grad, loss, round_)  # type: ignore[method-assign]
        drivers = [Driver(i, published, tmp_path, boot, pipe=audited) for i in range(2)]
        made.extend(drivers)
        for d in drivers:
            d.network.join_state(d.trainer.diloco)
        _wait(
            lambda: all(len(d.network.node.peers.live(time.time(), 1)) == 3 for d in drivers),
            20.0,
            "drivers to learn the three stage-1 replicas",
        )
        for d in drivers:
            d.start()
        _finish(drivers, 150.0)
        for s in stage1:
            s.stop.set()
            s.thread.join(30.0)
    finally:
        _dump_and_close(made)
    _stage_agrees([d.network for d in drivers], range(ROUNDS))
    assert all(bool(torch.isfinite(d.trainer.diloco.theta_round).all()) for d in drivers)
    clients = [d.link.client for d in drivers]
    assert sum(c.audits for c in clients) >= ROUNDS * H
    assert sum(c.audit_blamed for c in clients) >= 1
    outvoted = [line for d in drivers for line in d.lines if "disagrees with two others' that agree" in line]
    assert len(outvoted) == sum(c.audit_blamed for c in clients)
    assert all(hostile.wallet.public_key_hex[:12] in line for line in outvoted)
    # Each disagreement is also kept for the round's receipt, as the replicas signed their answers
    # over the wire (these drivers report to no verifier, so the disputes are still held).
    for c, d in zip(clients, drivers, strict=True):
        disputes = [x for r in range(ROUNDS + 1) for x in c.disputes_of(r) or ()]
        assert len(disputes) <= (ROUNDS + 1) * MAX_DISPUTES
        assert any(hostile.wallet.public_key_hex in {r.wallet for r in x.replies} for x in disputes)
        for dispute in disputes:
            assert all(r.signature_valid() and r.to == d.wallet.public_key_hex for r in dispute.replies)
    summaries = [line for d in drivers for line in d.lines if line.startswith("pipeline: audited ")]
    assert len(summaries) == 2 and all(
        f"{c.audit_blamed} outvoted and banned" in line for c, line in zip(clients, summaries, strict=True)
    )
    print(
        f"audits: {[c.audits for c in clients]}, hostile outvoted {[c.audit_blamed for c in clients]}, "
        f"unsettled {[c.audits_unsettled for c in clients]}, served {[s.replica.service.served for s in stage1]}"
    )
    _loss_fell(drivers, 0.2)
