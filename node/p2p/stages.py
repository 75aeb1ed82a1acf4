"""Wiring pipeline stages into a node: the `--stages/--stage` flags, the driver's link to the next
stage, and the whole life of a stage > 0 replica.

- Stage 0 (the driver) is a normal `Trainer` built with ``num_stages=S`` and
  ``loss_fn=remote_loss(link.downstream)``: each inner step runs its layers, sends the hidden
  state through `PipelineLink`, and back-propagates the gradient that comes back.
- A stage i > 0 replica (`run_stage_replica`) has no data: its peer server takes micro-batches
  (`PipelineService`), a `StageWorker` trains on them, and a non-last stage forwards its own
  output through its own `PipelineLink`.
- Every stage runs its own DiLoCo outer rounds among its replicas through `PeerNetwork`
  (already per stage), counted in inner steps per replica (H).
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from neuroshard.node.actcodec import DEFAULT_CODEC
from neuroshard.protocol.pipeline import ACTIVATION_DTYPES, CODEC_NAMES, micro_batch_id

from ..diloco import DiLoCo, DiLoCoConfig
from ..model import ModelConfig, build_stage
from ..segment_store import SegmentStore
from ..segments import SegmentRecorder
from ..stage_worker import StageCheckpoint, StageWorker, WorkerConfig
from ..trainer import TrainResult
from ..wallet import Wallet
from .network import NetworkConfig, PeerNetwork
from .pipeline import PipelineClient, PipelineConfig, PipelineService
from .replay import SegmentService
from .rounds import AggregationRule, ordered_mean
from .server import ServerExtension


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pipeline stages (SWARM wiring between stages, DiLoCo within each)")
    g.add_argument("--stages", type=int, default=1, help="S: stages the model is cut into (1: data parallel)")
    g.add_argument("--stage", type=int, default=0, help="the stage this node holds; 0 reads data and drives")
    g.add_argument(
        "--activation-codec",
        choices=CODEC_NAMES,
        default=None,
        help="activations/gradients on the pipeline wire (node.actcodec); with --join the network "
        f"definition's [stages] codec, else {DEFAULT_CODEC}",
    )
    # Before codecs the wire had a dtype: bf16 and fp16 are codecs of those names.
    g.add_argument(
        "--activation-dtype", dest="activation_codec", choices=ACTIVATION_DTYPES, help=argparse.SUPPRESS
    )


def pipeline_config_from_args(args: argparse.Namespace) -> PipelineConfig:
    if not 0 <= args.stage < args.stages:
        raise ValueError(f"--stage {args.stage} must lie in [0, --stages {args.stages})")
    return PipelineConfig(
        num_stages=args.stages,
        codec=args.activation_codec or DEFAULT_CODEC,
        max_batch=max(64, args.batch_size),
    )


class PipelineLink:
    """This node's way to the next stage, as blocking calls for the training thread."""

    def __init__(
        self,
        network: PeerNetwork,
        config: PipelineConfig,
        *,
        stop: threading.Event,
        round_of: Callable[[], int],
        log: Callable[[str], None],
        step_of: Callable[[], int] | None = None,
    ) -> None:
        self.network = network
        self.config = config
        self.round_of = round_of
        self.step_of = step_of
        self.client = PipelineClient(
            wallet=network.wallet,
            stage=network.stage,
            peers=network.node.peers,
            config=config,
            clock=network.node.clock,
            log=log,
            stop=stop,
        )

    def start(self) -> None:
        self.network.call(self.client.start(), timeout=10.0)

    def close(self) -> None:
        self.network.call(self.client.close(), timeout=10.0)

    def downstream(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        """The driver's `Downstream`: (hidden (B, T, C), labels (B, T)) -> (∂loss/∂hidden, loss), sent
        as micro-batch number `step_of()` (the inner step it is for) of round `round_of()`."""
        if self.step_of is None:
            raise ValueError("only the driver (stage 0, built with step_of) names micro-batches")
        round_ = self.round_of()
        micro_batch = micro_batch_id(self.network.wallet.public_key_hex, round_, self.step_of())
        return self.forward(hidden, labels, micro_batch)

    def forward(self, hidden: Tensor, labels: Tensor, micro_batch: str) -> tuple[Tensor, float]:
        """A `stage_worker.Forward`: send a micro-batch on under the id it already has."""
        coro = self.client.forward(hidden, labels, round_=self.round_of(), micro_batch=micro_batch)
        return self.network.call(coro, timeout=self.config.deadline_s + self.config.request_timeout_s + 10.0)


@dataclass
class StageReplica:
    """A running stage > 0 replica (built by `start_stage_replica`, run by `run`)."""

    diloco: DiLoCo
    worker: StageWorker
    network: PeerNetwork
    service: PipelineService
    link: PipelineLink | None

    def run(self, stop: threading.Event) -> TrainResult:
        try:
            return self.worker.run(stop)
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
    network_config: NetworkConfig,
    pipeline_config: PipelineConfig,
    worker_config: WorkerConfig,
    stop: threading.Event,
    log: Callable[[str], None],
    aggregate: AggregationRule = ordered_mean,
    checkpoint: StageCheckpoint | None = None,
    fresh: bool = False,
    segments: SegmentStore | None = None,
    operator_key: str | None = None,
) -> StageReplica:
    """Build a stage > 0 replica: model, DiLoCo (resumed from `checkpoint` unless `fresh`), worker,
    peer server with the pipeline route; join the stage's state; ready to `run`. With `segments`
    it records every inner step (node.segments) and serves segments to `operator_key`."""
    model = build_stage(model_config, stage, pipeline_config.num_stages)
    diloco = DiLoCo(model, diloco_config)
    if checkpoint is not None and not fresh and checkpoint.load(diloco):
        log(f"resumed from {checkpoint.path} at step={diloco.step} round={diloco.round}")
    recorder = None if segments is None else SegmentRecorder(segments.config, stage=stage, sink=segments)
    worker = StageWorker(diloco, worker_config, log=log, checkpoint=checkpoint, segments=recorder)
    service = PipelineService(
        wallet=wallet, stage=stage, model_config=model_config, config=pipeline_config, worker=worker
    )
    extensions: list[ServerExtension] = [service]
    if segments is not None:
        extensions.append(SegmentService(segments, allowed_wallet=operator_key))
    network = PeerNetwork(
        network_config, wallet, stage, log, aggregate=aggregate, stop=stop, extensions=extensions
    )
    network.start()
    link: PipelineLink | None = None
    try:
        if stage < pipeline_config.num_stages - 1:
            link = PipelineLink(network, pipeline_config, stop=stop, round_of=lambda: diloco.round, log=log)
            link.start()
            link.client.segments = recorder
            worker.downstream = link.forward
        worker.set_round_finisher(network.finish_round)
        network.join_state(diloco)
    except BaseException:
        if link is not None:
            link.close()
        network.stop()
        raise
    params = sum(p.numel() for p in model.parameters())
    log(
        f"stage {stage}/{pipeline_config.num_stages}: layers {list(model.layer_range)}, {params:,} parameters, "
        f"{'last stage (head, loss)' if link is None else 'forwards to stage ' + str(stage + 1)}; "
        f"H={diloco_config.inner_steps}; serving micro-batches at {network.address}"
    )
    return StageReplica(diloco=diloco, worker=worker, network=network, service=service, link=link)
