"""Wiring a node to its verifier: `--join URL`, or the embedded default, or neither.

- `--join http://host:port`: fetch the run's definition (signed by the operator, checked
  by node.tracker.fetch_network) and train by it: its model, stage count, DiLoCo
  settings, batch shape, data set and held-out shard override the corresponding flags
  (`--stage` still picks which stage this node holds).
- no `--join`: start the verifier in this process on 127.0.0.1:--verifier-port (SQLite
  under --home) with a definition made from this node's own flags, and report to it, so
  `curl localhost:8000/api/training/verify` and the dashboard work on one machine.
- `--no-verifier`: train with neither (the node reports to nobody).

A node that reports also serves its peer plane (a free loopback port unless --port says
otherwise): the verifier fetches the majority weights from there to measure them, and a
joined node's replay spot-check material (GET /p2p/replay/{round}, node.p2p.replay) for its
last --replay-rounds rounds, committed to in each receipt (the embedded verifier does not
replay its own node).
None of this can stop training: a verifier that cannot start or cannot be reached is
logged, and the node trains on.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Protocol

from neuroshard.data import Dataset

from .diloco import DiLoCo, DiLoCoConfig
from .membership import roster_of
from .model import ModelConfig
from .network_definition import NetworkDefinition
from .p2p.network import PeerNetwork
from .p2p.replay import ReplayService, SegmentService
from .p2p.server import ServerExtension
from .p2p.stages import StageReplica
from .receipt import Receipting
from .replay import ReplayArchive
from .segment_store import SegmentStore
from .segments import SegmentConfig, SegmentRecorder
from .tracker import Tracker, TrackerConfig, VerifierUnreachable, fetch_network
from .trainer import RoundFinisher, Trainer
from .wallet import Wallet

Log = Callable[[str], None]
JOIN_TIMEOUT_S = 30.0
"""How long a node started with --join keeps asking for the network definition before it gives up
(it cannot train without it, unless a verified copy was saved by an earlier run)."""
EMBEDDED_EVERY_ROUNDS = 1
"""The embedded verifier measures every round: 16 held-out batches of the tiny model take ~0.5 s,
small next to a round of 100 inner steps."""


def add_verifier_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("verifier (tracker, work receipts, measured loss, dashboard)")
    g.add_argument(
        "--join",
        metavar="URL",
        help="verifier to join, e.g. http://203.0.113.7:8000: its signed network definition sets the model, "
        "DiLoCo, batch shape and data (default: start one in this process on 127.0.0.1)",
    )
    g.add_argument(
        "--operator-key",
        help="hex public key that must sign the --join verifier's network definition "
        "(default: trust the first key seen, remembered under HOME/verifiers/)",
    )
    g.add_argument(
        "--verifier-port", type=int, default=8000, help="port of the embedded verifier (API and dashboard)"
    )
    g.add_argument("--no-verifier", action="store_true", help="no verifier at all: report to nobody")
    g.add_argument(
        "--replay-rounds",
        type=int,
        default=3,
        help="with --join: recent rounds whose θ_round, Δ and inner optimizer state are kept for the "
        "verifier's replay spot checks (memory: 4 × the model's size per round)",
    )


def join_network(args: argparse.Namespace, log: Log) -> NetworkDefinition | None:
    """With --join: the verified definition, with the flags it overrides set from it. Raises NetworkError."""
    if not args.join:
        return None
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        try:
            definition, key = fetch_network(
                args.join, operator_key=args.operator_key, known_keys=args.home / "verifiers", log=log
            )
            break
        except VerifierUnreachable as exc:  # a verifier still starting, or busy: ask again
            if time.monotonic() > deadline:
                raise
            log(f"{exc}; retrying")
            time.sleep(2.0)
    if not 0 <= args.stage < definition.num_stages:
        raise ValueError(
            f"--stage {args.stage}: {args.join} cuts the model into {definition.num_stages} stages "
            f"(0..{definition.num_stages - 1})"
        )
    args.stages = definition.num_stages
    codec = getattr(args, "activation_codec", None)
    if codec is not None and codec != definition.pipeline_codec:
        raise ValueError(
            f"--activation-codec {codec}: {args.join} runs its pipeline in {definition.pipeline_codec} "
            "(its [stages] codec); every replica must use the run's"
        )
    args.activation_codec = definition.pipeline_codec
    args.operator_key = key  # only this key may ask for replay material (node.p2p.replay)
    args.data, args.publisher_key = definition.manifest_url, definition.publisher_key
    args.batch_size, args.seq_len = definition.batch_size, definition.seq_len
    log(
        f"joined network {definition.name!r} at {args.join} (operator {key[:16]}…): "
        f"stage {args.stage} of {definition.num_stages} (pipeline codec {definition.pipeline_codec}), "
        f"H={definition.diloco.inner_steps}, batch {definition.batch_size}x{definition.seq_len}, "
        f"aggregation {definition.aggregation_rule} f={definition.aggregation_f}, "
        f"held-out shard {definition.held_out_shard}"
    )
    return definition


def held_out_shards(
    args: argparse.Namespace, joined: NetworkDefinition | None, dataset: Dataset
) -> tuple[int, ...]:
    """The shards this node must not train on: the verifier's held-out shard, when there is a verifier."""
    if joined is not None:
        return (joined.held_out_shard,)
    if args.no_verifier or dataset.manifest.total_shards < 2:
        return ()  # nothing is measured, or one shard only: hold nothing back
    return (0,)


def embedded_definition(
    args: argparse.Namespace, dataset: Dataset, model: ModelConfig, diloco: DiLoCoConfig
) -> NetworkDefinition:
    return NetworkDefinition(
        name="embedded",
        model=model,
        num_stages=1,
        diloco=diloco,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        aggregation_rule="default",
        aggregation_f=0,
        manifest_url=dataset.location,
        publisher_key=dataset.manifest.publisher,
        evaluate_every_rounds=EMBEDDED_EVERY_ROUNDS,
        held_out_shard=0,
    )


def _version() -> str:
    try:
        return metadata.version("neuroshard")
    except metadata.PackageNotFoundError:
        return "0.0.0"


class _Server(Protocol):
    def stop(self) -> None: ...


def segment_store(home: Path, segment_steps: int, keep_rounds: int, log: Log) -> SegmentStore:
    """The node's segment store under HOME/segments: k = the run's `segment_k` (its definition's
    [training] segment_steps, else H/10), the last `keep_rounds` rounds (--replay-rounds)."""
    config = SegmentConfig(segment_steps=segment_steps, keep_rounds=keep_rounds)
    return SegmentStore(Path(home) / "segments", config, log=log)


@dataclass
class Reporting:
    """The verifier side of one node run: maybe an embedded verifier, and the tracker thread."""

    url: str | None
    operator_key: str | None
    log: Log
    num_stages: int = 1
    network_name: str | None = None
    """The run's name: member lists (issue #19) are read and checked only when it is known."""
    embedded: _Server | None = None
    tracker: Tracker | None = None
    archive: ReplayArchive | None = None
    """Recent rounds kept for replay spot checks; None when there is no verifier to ask."""
    segments: SegmentStore | None = None
    """Recent rounds' segment checkpoints and received messages (node.segments), for the segment
    checks of a joined verifier at any stage; None without one."""

    @classmethod
    def open(
        cls,
        args: argparse.Namespace,
        joined: NetworkDefinition | None,
        held_out: tuple[int, ...],
        embedded: Callable[[], NetworkDefinition],
        log: Log,
    ) -> Reporting:
        """Pick the verifier (joined, embedded or none); start the embedded one. Leaves args.port
        at a free port (0) when the node would otherwise open none: the verifier must reach it."""
        if joined is not None:
            reporting = cls(
                url=args.join,
                operator_key=args.operator_key,
                log=log,
                num_stages=joined.num_stages,
                network_name=joined.name,
            )
        elif args.no_verifier:
            return cls(url=None, operator_key=None, log=log)
        elif not held_out:
            log("embedded verifier off: the data set has a single shard, none to hold out for measuring")
            return cls(url=None, operator_key=None, log=log)
        else:
            from neuroshard.verifier.embedded import start_embedded_verifier  # composition root, lazily

            definition = embedded()
            try:
                server = start_embedded_verifier(
                    home=args.home, network=definition, port=args.verifier_port, log=log, fresh=args.fresh
                )
            except (OSError, ValueError) as exc:
                log(f"embedded verifier not started: {exc}; training without one")
                return cls(url=None, operator_key=None, log=log)
            log(f"verifier (embedded): {server.url}/ dashboard, {server.url}/api/training/verify")
            reporting = cls(
                url=server.url,
                operator_key=server.operator_key_hex,
                log=log,
                embedded=server,
                network_name=definition.name,
            )
        if args.port is None and not getattr(args, "relay", None):
            args.port = 0  # a --relay node opens no port: the verifier cannot call it (README)
        if joined is not None:
            reporting.segments = segment_store(args.home, joined.segment_k, args.replay_rounds, log)
        if joined is not None and joined.num_stages == 1:
            # The embedded verifier does not replay its own node's rounds, and a pipeline stage's
            # inner steps depend on the other stages' replicas: neither keeps replay material.
            reporting.archive = ReplayArchive(args.replay_rounds)
        return reporting

    def extensions(self) -> list[ServerExtension]:
        """Peer routes the verifier calls: the replay material, to its operator key only."""
        routes: list[ServerExtension] = []
        if self.archive is not None:
            routes.append(ReplayService(self.archive, allowed_wallet=self.operator_key))
        if self.segments is not None:
            routes.append(SegmentService(self.segments, allowed_wallet=self.operator_key))
        return routes

    def attach(
        self,
        network: PeerNetwork | None,
        trainer: Trainer,
        wallet: Wallet,
        wrap: Callable[[RoundFinisher], RoundFinisher] | None = None,
    ) -> None:
        """Register with the verifier, discover peers, and send a receipt after every round.
        `wrap` goes around the receipting hook (testing only: node.p2p.byzantine's work lies)."""
        if self.url is None or network is None:
            return
        tracker = self._track(network, trainer.diloco, wallet)
        if self.segments is not None:
            trainer.segments = SegmentRecorder(self.segments.config, stage=0, sink=self.segments)
        receipting = Receipting(
            network.finish_round,
            network.reports,
            trainer.work,
            tracker.submit,
            batch_size=trainer.config.batch_size,
            tokens_per_step=trainer.config.batch_size * trainer.config.seq_len,
            log=self.log,
            archive=self.archive,
            segments=trainer.segments,
            signer=wallet,
        )
        receipting.round_started(trainer.diloco)
        trainer.set_round_finisher(wrap(receipting) if wrap is not None else receipting)

    def attach_stage(self, replica: StageReplica, wallet: Wallet) -> None:
        """The same for a stage > 0 replica: its receipts claim no data, and count the micro-batches
        it trained on (the verifier checks its hash agreement, not its data)."""
        if self.url is None:
            return
        tracker = self._track(replica.network, replica.diloco, wallet)
        receipting = Receipting(
            replica.network.finish_round,
            replica.network.reports,
            replica.worker.work,
            tracker.submit,
            batch_size=None,
            tokens_per_step=0,
            log=self.log,
            segments=replica.worker.segments,
            signer=wallet,
        )
        receipting.round_started(replica.diloco)
        replica.worker.set_round_finisher(receipting)

    def _track(self, network: PeerNetwork, diloco: DiLoCo, wallet: Wallet) -> Tracker:
        assert self.url is not None
        tracker = Tracker(
            TrackerConfig(
                url=self.url,
                address=network.address,
                stage=network.stage,
                next_stage=network.stage < self.num_stages - 1,
                software_version=_version(),
                operator_key=self.operator_key,
                network=self.network_name,
            ),
            wallet,
            self.log,
            progress=lambda: (diloco.round, diloco.steps_in_round),
            on_peers=network.add_bootstrap,
            on_members=lambda members: network.set_roster(roster_of(members), members.effective_round),
        )
        tracker.start()
        self.tracker = tracker
        return tracker

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.stop()
            self.log(
                f"tracker: {self.tracker.delivered} receipt(s) acknowledged, {self.tracker.pending()} undelivered, "
                f"{self.tracker.dropped} dropped"
            )
        if self.embedded is not None:
            self.embedded.stop()
