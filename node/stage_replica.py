"""A stage > 0 replica of a pipeline: no data of its own; its peer server takes micro-batches
(`PipelineService`), a `StageWorker` trains on them, a non-last stage forwards its own output through
its own `PipelineLink`, and it runs its stage's DiLoCo outer rounds through `PeerPlane`."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .device import Placement
from .diloco import DiLoCo, DiLoCoConfig
from .inner_loop import RoundFinisher, TrainResult
from .model import ModelConfig, build_stage
from .p2p.pipeline import PipelineConfig, PipelineService
from .p2p.plane import PeerPlane, PeerPlaneConfig
from .p2p.rounds import AggregationRule, ordered_mean
from .p2p.server import ServerExtension
from .p2p.stages import PipelineLink
from .reporting import Reporting
from .stage_worker import JobQueue, StageCheckpoint, StageWorker, WorkerConfig
from .vocab import VocabSchedule, regrow, vocab_of
from .wallet import Wallet
from .work import RoundWork


@dataclass
class StageReplica:
    """A running stage > 0 replica (built by `start_stage_replica`, run by `run`)."""

    worker: StageWorker
    network: PeerPlane
    service: PipelineService
    link: PipelineLink | None
    log: Callable[[str], None]

    @property
    def diloco(self) -> DiLoCo:
        """The replica's engine (the worker's: a vocabulary growth replaces it)."""
        return self.worker.diloco

    def run(self, stop: threading.Event) -> TrainResult:
        """Train until `max_steps`, `stop`, or the end of every replica that feeds this one. Done
        (not stopped): tell the next stage (if any) that this one sends no more, and serve the
        last round to the stage's replicas still in it before closing. Stopped by a signal: leave
        without a word (the replicas it fed go on with whoever else sends them work)."""
        try:
            result = self.worker.run(stop)
            if self.worker.ended_because is not None:
                self.log(f"ending: {self.worker.ended_because}")
            if not result.stopped_by_signal:
                if self.link is not None:
                    self.link.end(self.diloco.round, self.diloco.step)
                self.network.linger(max_s=self.network.config.hash_check_timeout_s)
            return result
        finally:
            self.close()

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.network.stop()


def start_stage_replica(
    *,
    wallet: Wallet,
    stage: int,
    model_config: ModelConfig,
    diloco_config: DiLoCoConfig,
    network_config: PeerPlaneConfig,
    pipeline_config: PipelineConfig,
    worker_config: WorkerConfig,
    stop: threading.Event,
    log: Callable[[str], None],
    aggregate: AggregationRule = ordered_mean,
    checkpoint: StageCheckpoint | None = None,
    fresh: bool = False,
    reporting: Reporting | None = None,
    placement: Placement | None = None,
    vocab_schedule: VocabSchedule | None = None,
) -> StageReplica:
    """Build a stage > 0 replica: model, DiLoCo (resumed from `checkpoint` unless `fresh`), worker,
    peer server with the pipeline route; join the stage's state; ready to `run`. With an active
    `reporting` it sends a receipt after every round, records every inner step (node.segments)
    and serves segments to the verifier's operator key. `placement`: the device and precision of the
    inner steps (default CPU fp32); the outer round's state stays on the CPU in fp32 and its step
    gives the same bits on any device (node.diloco).

    Vocabulary growth (node.vocab), where a verifier schedules it (`vocab_schedule`, fed by the
    reporting's tracker, read once before this is called): the last stage grows its head at the
    round the verifier's member list names, and one (re)started after its stage grew starts at the
    grown size. A stage in between holds no vocabulary rows and never grows."""
    reporting = reporting or Reporting.nobody(log)
    num_stages = pipeline_config.num_stages
    model = build_stage(model_config, stage, num_stages)
    diloco = DiLoCo(model, diloco_config, placement=placement)
    if checkpoint is not None and not fresh:
        resumed = checkpoint.load(diloco)
        if resumed is not None:
            diloco = resumed
            log(f"resumed from {checkpoint.path} at step={diloco.step} round={diloco.round}")
    last = stage == num_stages - 1
    schedule = vocab_schedule if last else None
    scheduled = 0 if schedule is None else schedule.planned[0]  # new or resumed: the stage's likely size
    if scheduled > vocab_of(diloco):
        # Started after the verifier scheduled the stage's growth: train at that size, as its peers do.
        log(
            f"vocabulary {vocab_of(diloco)} -> {scheduled}: the verifier scheduled this stage's growth; head extended"
        )
        diloco = regrow(diloco, scheduled)
    recorder = reporting.recorder(stage)
    # Built in the order they need each other: the queue the pipeline route fills, the network
    # that serves the route, the link onward and the round's finisher, then the worker.
    jobs = JobQueue(worker_config.max_pending)
    work = RoundWork()
    service = PipelineService(
        wallet=wallet,
        stage=stage,
        model_config=dataclasses.replace(model_config, vocab_size=vocab_of(diloco)),
        config=pipeline_config,
        worker=jobs,
        senders=reporting.neighbours_of(stage - 1),
        log=log,
    )
    extensions: list[ServerExtension] = [service, *reporting.extensions()]
    network = PeerPlane(
        network_config, wallet, stage, log, aggregate=aggregate, stop=stop, extensions=extensions
    )
    network.start()
    if schedule is not None:

        def grown(engine: DiLoCo) -> None:
            service.set_vocab(vocab_of(engine))
            network.republish(engine)

        schedule.on_grown = grown
    link: PipelineLink | None = None
    worker: StageWorker | None = None

    def engine() -> DiLoCo:
        return diloco if worker is None else worker.diloco  # a growth replaces the worker's

    try:
        if not last:
            link = PipelineLink(
                network,
                pipeline_config,
                stop=stop,
                round_of=lambda: engine().round,
                log=log,
                segments=recorder,
                receivers=reporting.neighbours_of(stage + 1),
            )
            link.start()
        finish_round: RoundFinisher = network.finish_round
        receipting = None
        if reporting.active:
            receipting = reporting.receipting(
                network, work, wallet, batch_size=None, tokens_per_step=0, segments=recorder
            )
            if link is not None:
                receipting.disputes = link.client.disputes_of
            finish_round = receipting
            reporting.track(network, wallet, progress=lambda: (engine().round, engine().steps_in_round))
        worker = StageWorker(
            diloco,
            worker_config,
            log=log,
            jobs=jobs,
            downstream=None if link is None else link.forward,
            blame=None if link is None else link.blame,
            finish_round=finish_round,
            checkpoint=checkpoint,
            segments=recorder,
            work=work,
            upstream_over=service.upstream.over,
            vocab_schedule=schedule,
        )
        network.join_state(diloco)
        if receipting is not None:  # after a join adopted a peer's θ: the round starts from it
            receipting.round_started(diloco)
    except BaseException:
        if link is not None:
            link.close()
        network.stop()
        raise
    params = sum(p.numel() for p in diloco.model.parameters())
    log(
        f"stage {stage}/{pipeline_config.num_stages}: layers {list(model.layer_range)}, {params:,} parameters, "
        f"{'last stage (head, loss)' if last else 'forwards to stage ' + str(stage + 1)}; "
        f"H={diloco_config.inner_steps}; inner loop on {diloco.placement.describe()}; "
        f"serving micro-batches at {network.address}"
    )
    return StageReplica(worker=worker, network=network, service=service, link=link, log=log)
