"""Wiring a node to its verifier: `--join URL`, or the embedded default, or neither.

- `--join http://host:port`: fetch the run's definition (signed by the operator, checked
  by node.verifier_client.fetch_network) and train by it: its model, stage count, DiLoCo
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

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Protocol

from neuroshard.data import Dataset
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.reports import Receipt
from neuroshard.protocol.roster import MemberList, RosterError

from .diloco import DiLoCoConfig
from .membership import Neighbours, roster_of
from .model import ModelConfig, stage_layers
from .network_definition import NetworkDefinition
from .p2p.pipeline_wire import bytes_per_token
from .p2p.plane import PeerPlane
from .p2p.replay import ReplayService, SegmentService
from .p2p.server import ServerExtension
from .receipt import Receipting
from .replay import ReplayArchive
from .segment_store import SegmentStore
from .segments import SegmentConfig, SegmentRecorder, round_bytes
from .verifier_client import (
    VerifierClient,
    VerifierClientConfig,
    VerifierUnreachable,
    fetch_member_list,
    fetch_network,
)
from .vocab import VocabSchedule
from .wallet import Wallet
from .work import RoundWork

Log = Callable[[str], None]
JOIN_TIMEOUT_S = 30.0
"""How long a node started with --join keeps asking for the network definition before it gives up
(it cannot train without it, unless a verified copy was saved by an earlier run)."""
EMBEDDED_EVERY_ROUNDS = 1
"""The embedded verifier measures every round: 16 held-out batches of the tiny model take ~0.5 s,
small next to a round of 100 inner steps."""


def join_network(
    url: str, *, operator_key: str | None, home: Path, log: Log
) -> tuple[NetworkDefinition, str]:
    """The run's definition from the verifier at `url`, checked against `operator_key` (or the key
    remembered under HOME/verifiers/), and the key that signed it. A verifier that is still starting
    is asked again for JOIN_TIMEOUT_S. Raises NetworkError."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        try:
            return fetch_network(url, operator_key=operator_key, known_keys=home / "verifiers", log=log)
        except VerifierUnreachable as exc:  # a verifier still starting, or busy: ask again
            if time.monotonic() > deadline:
                raise
            log(f"{exc}; retrying")
            time.sleep(2.0)


def held_out_shards(joined: NetworkDefinition | None, measured: bool, dataset: Dataset) -> tuple[int, ...]:
    """The shards this node must not train on: the verifier's held-out shard, when there is a verifier
    (`measured`: an embedded one will be started)."""
    if joined is not None:
        return (joined.held_out_shard,)
    if not measured or dataset.manifest.total_shards < 2:
        return ()  # nothing is measured, or one shard only: hold nothing back
    return (0,)


def embedded_definition(
    dataset: Dataset, model: ModelConfig, diloco: DiLoCoConfig, *, batch_size: int, seq_len: int
) -> NetworkDefinition:
    """The definition an embedded verifier runs: this node's own model, DiLoCo and batch shape."""
    return NetworkDefinition(
        name="embedded",
        model=model,
        num_stages=1,
        diloco=diloco,
        batch_size=batch_size,
        seq_len=seq_len,
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


def segment_round_bytes(definition: NetworkDefinition, stage: int, params: int | None = None) -> int:
    """What one round of this stage's segment material takes on disk (`segments.round_bytes`): the
    stage's checkpoints, and each step's payloads in the run's codec, received and sent (both are
    kept: activations in and gradients out for a stage > 0, activations out and gradients in for
    a stage that is not the last). `params`: the stage's parameters when not the definition's (a
    grown vocabulary)."""
    model, stages = definition.model, definition.num_stages
    if params is None:
        params = model.num_params(
            layers=stage_layers(model.n_layers, stage, stages), embedding=stage == 0, head=stage == stages - 1
        )
    payload = 0
    if stages > 1:
        forward, backward = bytes_per_token(definition.pipeline_codec, model.dim)
        boundaries = (stage > 0) + (stage < stages - 1)
        payload = boundaries * (forward + backward) * definition.batch_size * definition.seq_len
    return round_bytes(params, definition.diloco.inner_steps, definition.segment_k, payload)


DISK_MARGIN = 1.25
"""The segment budget's room above the estimate: safetensors headers, logs, openings."""


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _held(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def segment_store(
    home: Path,
    definition: NetworkDefinition,
    stage: int,
    keep_rounds: int,
    log: Log,
    free: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free,
    share: float = 1.0,
) -> SegmentStore:
    """The node's segment store under HOME/segments/<the run's definition digest, 16 hex>: one per
    run, since round numbers repeat across runs (a round committed in one must not stop the next
    from recording it); k = the run's `segment_k` (its definition's [training] segment_steps: H/40
    in a network.toml that names none), the last `keep_rounds` rounds (--replay-rounds).

    Its disk budget follows from the run's definition (`segment_round_bytes`: 12 bytes a parameter
    a checkpoint, ⌈H/k⌉ + 1 checkpoints, the payloads): `keep_rounds` closed rounds with
    `DISK_MARGIN`, and the round being written on top. ValueError (the node does not start) when
    the disk under HOME cannot hold one closed round and the one being written: every challenge
    would go unanswered and cost the wallet reputation. With room for fewer rounds than
    `keep_rounds`, the budget is what there is, and the log says how many rounds that keeps. Sized
    at the definition's vocabulary, and again whenever a round starts with another parameter count
    (the vocabulary grew: up to `vocab.GROWTH_FACTOR` times the embedding and head rows;
    `SegmentStore.fit`), from the free space then: a grown round that the disk cannot hold twice is
    kept alone, and the log says that older rounds' challenges go unanswered.

    `share` (--disk-share): the part of the disk's free space this node counts as its own, for nodes
    that share one disk (neuroshard-swarm gives each of its N nodes 1/N); each would otherwise count
    all of it, and together they could fill it."""
    if not 0 < share <= 1:
        raise ValueError(f"--disk-share must lie in (0, 1], got {share}")
    directory = Path(home) / "segments" / definition.digest()[:16]
    directory.mkdir(parents=True, exist_ok=True)
    per_round, room, budget = _segment_budget(definition, stage, keep_rounds, directory, free, share)
    if budget < per_round:
        raise ValueError(
            f"this run's segment material needs {_gb(per_round)} of disk a round at stage {stage} "
            f"({definition.diloco.inner_steps} inner steps, a checkpoint every {definition.segment_k}), "
            f"and a node holds two (the round it answers challenges on and the one it writes); "
            f"{directory} has {_gb(room)}{'' if share == 1 else f' ({share:.3g} of its free space)'}. "
            "Free space there or give --home on a larger disk"
        )
    kept = budget // per_round
    note = (
        ""
        if kept >= keep_rounds
        else f" (room for {kept} of --replay-rounds {keep_rounds}: older rounds' challenges go unanswered)"
    )
    log(f"segments: {_gb(per_round)} a round, budget {_gb(budget)} under {directory}{note}")
    config = SegmentConfig(segment_steps=definition.segment_k, keep_rounds=keep_rounds, max_bytes=budget)

    def budget_for(params: int) -> int:
        """The budget for rounds of `params` parameters (a grown vocabulary), from the room now."""
        per_round, room, budget = _segment_budget(
            definition, stage, keep_rounds, directory, free, share, params
        )
        if budget < per_round:
            log(
                f"segments: a round of {params:,} parameters takes {_gb(per_round)}, and {directory} has "
                f"{_gb(room)}: one round is kept, so challenges of the rounds before it go unanswered. "
                "Free space there"
            )
            return per_round
        kept = budget // per_round
        note = "" if kept >= keep_rounds else f" (room for {kept} of --replay-rounds {keep_rounds})"
        log(
            f"segments: rounds of {params:,} parameters take {_gb(per_round)} each, budget {_gb(budget)}{note}"
        )
        return budget

    store = SegmentStore(directory, config, log=log, budget_for=budget_for)
    store.trim()  # an earlier run's rounds beyond the budget go before this run writes its first
    return store


def _segment_budget(
    definition: NetworkDefinition,
    stage: int,
    keep_rounds: int,
    directory: Path,
    free: Callable[[Path], int],
    share: float,
    params: int | None = None,
) -> tuple[int, int, int]:
    """(bytes a round, the room this store may use, its budget) for `segment_store`."""
    per_round = int(segment_round_bytes(definition, stage, params) * DISK_MARGIN)
    room = int(free(directory) * share) + _held(directory)  # what this store holds is its own to reuse
    # Closed rounds are dropped when a round closes, so the round being written comes on top of the
    # budget: the budget is what is left of 90% of the room after one round in progress.
    return per_round, room, min(keep_rounds * per_round, int(room * 0.9) - per_round)


class Stoppable(Protocol):
    def stop(self) -> None: ...


@dataclass
class Reporting:
    """The verifier side of one node run: the verifier it reports to (joined, embedded or none),
    the tracker thread, and the material kept for the verifier's checks. Built by the node's
    composition root (neuroshard.cli.node), which starts an embedded verifier when there is one."""

    url: str | None
    operator_key: str | None
    log: Log
    num_stages: int = 1
    network_name: str | None = None
    """The run's name: member lists (issue #19) are read and checked only when it is known."""
    embedded: Stoppable | None = None
    """The in-process verifier of the embedded default, stopped with this object."""
    archive: ReplayArchive | None = None
    """Recent rounds kept for replay spot checks; None when there is no verifier to ask."""
    segments: SegmentStore | None = None
    """Recent rounds' segment checkpoints and received messages (node.segments), for the segment
    checks of a joined verifier at any stage; None without one."""
    network_digest: str | None = None
    """The joined run's definition digest, which its segment commitments carry."""
    vocab: VocabSchedule | None = None
    """The stage's vocabulary growth round, from the verifier's member lists (node.vocab); None
    where no verifier schedules growth (a lone node grows when it takes a grown manifest)."""
    tracker: VerifierClient | None = field(default=None, init=False)
    neighbours: dict[int, Neighbours] = field(default_factory=dict, init=False)
    """The pipeline neighbours' memberships (`neighbours_of`), by stage, which the tracker keeps current."""

    @classmethod
    def nobody(cls, log: Log) -> Reporting:
        """A node that reports to no verifier."""
        return cls(url=None, operator_key=None, log=log)

    @property
    def active(self) -> bool:
        return self.url is not None

    def extensions(self) -> list[ServerExtension]:
        """Peer routes the verifier calls: the replay material, to its operator key only."""
        routes: list[ServerExtension] = []
        if self.archive is not None:
            routes.append(ReplayService(self.archive, allowed_wallet=self.operator_key))
        if self.segments is not None:
            routes.append(SegmentService(self.segments, allowed_wallet=self.operator_key))
        return routes

    def recorder(self, stage: int) -> SegmentRecorder | None:
        """The segment recorder of a replica of `stage`, when its segments are kept."""
        if self.segments is None:
            return None
        return SegmentRecorder(
            self.segments.config, stage=stage, sink=self.segments, log=self.log, network=self.network_digest
        )

    def neighbours_of(self, stage: int) -> Neighbours:
        """The membership of `stage`, a pipeline neighbour of this replica's (the stage before it,
        whose micro-batches it takes, or the one after, where it sends its own): read from the
        verifier once now, before any micro-batch is taken or sent, then kept current by the
        tracker once `track` starts it (so ask before). Until a list is read, and for good without
        a verifier or under an ``open`` policy, it takes everyone."""
        neighbours = self.neighbours.get(stage)
        if neighbours is None:
            if self.tracker is not None:
                raise RuntimeError(
                    f"stage {stage}'s neighbours asked for after the tracker started: never read"
                )
            neighbours = self.neighbours[stage] = Neighbours(stage)
            self._read_neighbours(stage)
        return neighbours

    def _read_neighbours(self, stage: int) -> None:
        if self.url is None or self.operator_key is None or self.network_name is None:
            return
        try:
            members = fetch_member_list(self.url, stage, self.operator_key, self.network_name, timeout_s=5.0)
        except (Refused, RosterError, VerifierUnreachable) as exc:
            self.log(
                f"verifier: stage {stage}'s member list not read at start ({exc}); pipeline micro-batches go "
                "to and from anyone of that stage until the tracker reads it"
            )
            return
        self._take_neighbours(members)

    def receipting(
        self,
        network: PeerPlane,
        work: RoundWork,
        wallet: Wallet,
        *,
        batch_size: int | None,
        tokens_per_step: int,
        segments: SegmentRecorder | None,
    ) -> Receipting:
        """The round finisher that completes each round on the peer network and sends its receipt.
        A stage > 0 replica (`batch_size` None) claims no data and counts its micro-batches."""
        return Receipting(
            network.finish_round,
            network.reports,
            work,
            self.submit,
            batch_size=batch_size,
            tokens_per_step=tokens_per_step,
            log=self.log,
            archive=self.archive if batch_size is not None else None,
            segments=segments,
            signer=wallet,
        )

    def submit(self, receipt: Receipt) -> None:
        """Deliver a round's receipt through the tracker (`track` starts it before the first round)."""
        if self.tracker is None:
            self.log("receipt dropped: the tracker is not running")
            return
        self.tracker.submit(receipt)

    def track(
        self, network: PeerPlane, wallet: Wallet, progress: Callable[[], tuple[int, int]]
    ) -> VerifierClient:
        """Register with the verifier and keep the registration alive; the tracker also brings the
        stage's peers and member lists to `network`. Its `submit` delivers receipts."""
        assert self.url is not None
        tracker = VerifierClient(
            VerifierClientConfig(
                url=self.url,
                address=network.address,
                stage=network.stage,
                next_stage=network.stage < self.num_stages - 1,
                software_version=_version(),
                operator_key=self.operator_key,
                network=self.network_name,
                neighbour_stages=tuple(sorted(self.neighbours)),
                # A node's own verifier serves that node alone: no burst to spread, so no wait.
                receipt_splay=0.0 if self.embedded is not None else VerifierClientConfig.receipt_splay,
            ),
            wallet,
            self.log,
            progress=progress,
            on_peers=network.add_bootstrap,
            on_members=lambda members: self._take_members(network, members),
            on_neighbours=self._take_neighbours,
        )
        tracker.start()
        self.tracker = tracker
        return tracker

    def read_vocab(self, stage: int) -> None:
        """Before the replica is built: read the stage's member list once, so a replica that (re)starts
        after its stage grew starts at the grown vocabulary (the tracker reads it again every few
        seconds from then on). A verifier that cannot be read is logged, and growth waits for the tracker."""
        if self.vocab is None or self.url is None or self.operator_key is None or self.network_name is None:
            return
        try:
            members = fetch_member_list(self.url, stage, self.operator_key, self.network_name)
        except (Refused, RosterError, VerifierUnreachable) as exc:
            self.log(
                f"verifier: stage {stage}'s member list not read at start ({exc}); the tracker reads it later"
            )
            return
        self._take_vocab(members)

    def _take_members(self, network: PeerPlane, members: MemberList) -> None:
        network.set_roster(roster_of(members), members.effective_round)
        self._take_vocab(members)

    def _take_neighbours(self, members: MemberList) -> None:
        roster = roster_of(members)
        neighbours = self.neighbours[members.stage]
        before = neighbours.roster
        neighbours.set(roster)
        if roster is None:
            if before is not None:
                self.log(
                    f"membership: stage {members.stage} is open; pipeline micro-batches go to and from anyone"
                )
        elif before is None or (before.admitted, before.probation) != (roster.admitted, roster.probation):
            self.log(
                f"membership: pipeline neighbours of stage {members.stage}: {len(roster.admitted)} admitted, "
                f"{len(roster.probation)} on probation ({roster.policy}, {roster.source}); no others"
            )

    def _take_vocab(self, members: MemberList) -> None:
        if self.vocab is None or members.vocab_size is None or members.vocab_from_round is None:
            return
        if members.vocab_size > self.vocab.planned[0]:
            self.log(
                f"tracker: the verifier schedules vocabulary {members.vocab_size} for stage {members.stage} "
                f"from round {members.vocab_from_round}"
            )
        self.vocab.set(members.vocab_size, members.vocab_from_round)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.stop()
            self.log(
                f"tracker: {self.tracker.delivered} receipt(s) acknowledged, {self.tracker.pending()} undelivered, "
                f"{self.tracker.dropped} dropped"
            )
        if self.embedded is not None:
            self.embedded.stop()
