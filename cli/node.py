"""`neuroshard-node`: contribute compute to a NeuroShard run. The composition root of a node process.

With no `--data` this is the embedded default: build (once) a data set from the Python
standard library under `--home`, then train a tiny model on this wallet's shards with
DiLoCo, alone, printing progress and saving checkpoints. Ctrl-C stops cleanly.

With cli.node_flags (the flags and the typed configs they become) this is the only part of
the node that knows argparse: it starts an embedded verifier when there is one, and wires the
parts once, through their constructors. `neuroshard-adversary` reuses it with its own `Roles`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch

from neuroshard.cli.embedded import start_embedded_verifier
from neuroshard.cli.node_flags import (
    PROG,
    RunSettings,
    build_parser,
    checkpoint_interval,
    diloco_config_from_args,
    network_config_from_args,
    pipeline_config,
    placement_from_args,
    run_settings,
)
from neuroshard.cli.process import run_command
from neuroshard.data import (
    Dataset,
    ManifestError,
    PublisherKeyError,
    ShardError,
    open_dataset,
    parse_public_key,
)
from neuroshard.data.dataset import open_remote_dataset, remote_updates
from neuroshard.data.fetch import FetchConfig
from neuroshard.node import aggregation
from neuroshard.node.checkpoint import CheckpointIdentity, CheckpointMismatch, checkpoint_path
from neuroshard.node.device import Placement
from neuroshard.node.diloco import DiLoCoConfig
from neuroshard.node.embedded import ensure_default_dataset
from neuroshard.node.inner_loop import lone_replica
from neuroshard.node.model import MODEL_SIZES, ModelConfig
from neuroshard.node.network_definition import NetworkDefinition
from neuroshard.node.outer.round import OuterRound, RoundFactory
from neuroshard.node.p2p.pipeline import PipelineUnavailable
from neuroshard.node.p2p.plane import PeerPlane
from neuroshard.node.p2p.rounds import AggregationRule
from neuroshard.node.p2p.stages import PipelineLink
from neuroshard.node.pipeline import remote_loss, stage_fingerprint
from neuroshard.node.replay import ReplayArchive
from neuroshard.node.reporting import (
    Reporting,
    embedded_definition,
    held_out_shards,
    segment_store,
)
from neuroshard.node.rotation import RotationConfig
from neuroshard.node.stage_replica import start_stage_replica
from neuroshard.node.stage_worker import StageCheckpoint, WorkerConfig
from neuroshard.node.trainer import DatasetUpdates, Trainer, TrainerConfig
from neuroshard.node.vocab import VocabSchedule
from neuroshard.node.wallet import TokenError, Wallet, resolve_token
from neuroshard.node.work import RoundWork

_LOG_LOCK = threading.RLock()
"""print writes the text and the newline separately: without a lock, lines from the training,
peer, tracker and embedded verifier threads can merge (and the swarm parses these lines).
Re-entrant: the SIGTERM handler logs on the main thread, possibly in the middle of its print."""


def _log(line: str) -> None:
    with _LOG_LOCK:
        print(line, flush=True)


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return 2


def _open_data(args: argparse.Namespace, run: RunSettings) -> tuple[Dataset, DatasetUpdates | None]:
    if run.data is None:
        return ensure_default_dataset(args.home, _log), None
    if not run.publisher_key:
        raise PublisherKeyError(
            "--data-url needs --publisher-key (the hex public key that signed its manifest)"
        )
    key = parse_public_key(run.publisher_key)
    if not run.data.startswith(("http://", "https://")):
        return open_dataset(Path(run.data), key), None
    config = FetchConfig(cache_bytes=int(args.cache_gb * (1 << 30)))
    dataset = open_remote_dataset(
        run.data, key, args.cache_dir or args.home / "cache", config=config, log=_log
    )
    return dataset, remote_updates(dataset, _log)


def _aggregation_rule(joined: NetworkDefinition | None) -> AggregationRule:
    """A joined node aggregates as the network definition says; its peers (and the verifier's
    hash agreement) expect bit-identical rounds, which a different rule would break. A node
    outside a network aggregates as a network.toml that names nothing would."""
    if joined is None:  # the swarm's replicas run this code: the network.toml default is theirs
        return aggregation.network_rule("default", 0, aggregation.DEFAULT_CLIPPING)
    return aggregation.network_rule(joined.aggregation_rule, joined.aggregation_f, joined.clip)


def _model_label(config: ModelConfig) -> str:
    """The preset name of the model this node trains (from the network definition when joined),
    or its shape when it matches no preset."""
    for name, preset in MODEL_SIZES.items():
        if all(getattr(config, key) == value for key, value in preset.items()):
            return name
    return f"custom (dim {config.dim}, {config.n_layers} layers, {config.n_heads} heads)"


@dataclass(frozen=True)
class Roles:
    """The implementations this composition root plugs in. An honest node takes the defaults;
    `neuroshard-adversary` passes its own (neuroshard.adversary), through the same constructors."""

    rounds: Callable[[Callable[[], torch.Tensor]], RoundFactory] = lambda theta_round: OuterRound
    """Given a way to read this replica's θ_round, the round implementation its peer network runs."""
    trainer: type[Trainer] = Trainer
    banner: str | None = None
    """A line printed at start (an adversary's loud warning)."""
    needs_peers: bool = False
    """Whether these parts only make sense on the peer plane (an attacker of the round)."""


def _reporting(
    args: argparse.Namespace,
    run: RunSettings,
    held_out: tuple[int, ...],
    definition: Callable[[], NetworkDefinition],
) -> Reporting:
    """The verifier this node reports to: the joined one, an embedded one started here, or none.
    None of this can stop training: an embedded verifier that cannot start is logged."""
    joined = run.joined
    if joined is not None:
        return Reporting(
            url=args.join,
            operator_key=run.operator_key,
            log=_log,
            num_stages=joined.num_stages,
            network_name=joined.name,
            segments=segment_store(
                args.home, joined, args.stage, args.replay_rounds, _log, share=args.disk_share
            ),
            network_digest=joined.digest(),
            # The embedded verifier does not replay its own node's rounds, and a pipeline stage's
            # inner steps depend on the other stages' replicas: neither keeps replay material.
            archive=ReplayArchive(args.replay_rounds) if joined.num_stages == 1 else None,
            vocab=VocabSchedule(),
        )
    if not run.embedded_verifier:
        return Reporting.nobody(_log)
    if not held_out:
        _log("embedded verifier off: the data set has a single shard, none to hold out for measuring")
        return Reporting.nobody(_log)
    network = definition()
    try:
        server = start_embedded_verifier(
            home=args.home, network=network, port=args.verifier_port, log=_log, fresh=args.fresh
        )
    except (OSError, ValueError) as exc:
        _log(f"embedded verifier not started: {exc}; training without one")
        return Reporting.nobody(_log)
    _log(f"verifier (embedded): {server.url}/ dashboard, {server.url}/api/training/verify")
    return Reporting(
        url=server.url,
        operator_key=server.operator_key_hex,
        log=_log,
        embedded=server,
        network_name=network.name,
    )


def _downstream(
    link: PipelineLink | None, hidden: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, float]:
    if link is None:
        raise PipelineUnavailable("the pipeline link to stage 1 is not up")
    return link.downstream(hidden, labels)


def _run_stage_replica(
    args: argparse.Namespace,
    run: RunSettings,
    wallet: Wallet,
    model_config: ModelConfig,
    diloco_config: DiLoCoConfig,
    stop: threading.Event,
    dataset: Dataset,
    placement: Placement,
) -> int:
    """A stage > 0 replica: no data of its own, it trains on the micro-batches stage i-1 sends,
    and reports to the verifier it joined (if any; a pipeline has no embedded verifier)."""
    directory = args.checkpoint_dir or args.home / "checkpoints"
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint = StageCheckpoint(
        path=checkpoint_path(directory, wallet.wallet_id, args.stage),
        identity=CheckpointIdentity(
            wallet_id=wallet.wallet_id,
            stage=args.stage,
            model_fingerprint=stage_fingerprint(model_config, run.num_stages),
            tokenizer_sha256=dataset.manifest.tokenizer.sha256,
        ),
        older_tokenizers=tuple(t.sha256 for t in dataset.manifest.tokenizers[:-1]),
    )
    reporting = _reporting(args, run, (), lambda: NotImplemented)
    reporting.read_vocab(args.stage)
    network_config = network_config_from_args(args, reporting=False, pipeline=True, joined=run.joined)
    assert network_config is not None
    try:
        replica = start_stage_replica(
            wallet=wallet,
            stage=args.stage,
            model_config=model_config,
            diloco_config=diloco_config,
            network_config=network_config,
            pipeline_config=pipeline_config(args, run),
            worker_config=WorkerConfig(max_steps=args.max_steps, log_every=args.log_every),
            stop=stop,
            log=_log,
            aggregate=_aggregation_rule(run.joined),
            checkpoint=checkpoint,
            fresh=args.fresh,
            reporting=reporting,
            placement=placement,
            vocab_schedule=reporting.vocab,
        )
        result = replica.run(stop)
    finally:
        reporting.close()
    how = "stopped by signal" if result.stopped_by_signal else "done"
    _log(
        f"{how} at step={result.steps} round={result.rounds} (stage {args.stage}); checkpoint {checkpoint.path}"
    )
    return 0


def _install_stop_handlers(stop: threading.Event) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        # First the event: a signal that lands inside a blocked write to stdout makes the print
        # below raise (a reentrant call), and the stop must not depend on it.
        stop.set()
        _log(f"received {signal.Signals(signum).name}: finishing the current step and saving a checkpoint")
        # A second Ctrl-C falls through to the default behaviour and ends the process at once.
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main(
    argv: list[str] | None = None,
    *,
    parser: argparse.ArgumentParser | None = None,
    roles: Roles | None = None,
) -> int:
    """Parse the flags and run the node; `neuroshard-adversary` passes its own parser and roles."""
    args = (parser or build_parser()).parse_args(argv)
    try:
        wallet = Wallet.from_token(resolve_token(args.token, args.token_file, dict(os.environ)))
    except TokenError as exc:
        return _fail(str(exc))
    if args.threads <= 0:
        return _fail(f"--threads must be positive, got {args.threads}")
    torch.set_num_threads(args.threads)
    _log(f"wallet {wallet.wallet_id}; {args.threads} threads")
    stop = threading.Event()
    _install_stop_handlers(stop)
    return run(args, wallet, stop, roles or Roles())


def run(args: argparse.Namespace, wallet: Wallet, stop: threading.Event, roles: Roles) -> int:
    """Wire one node process from its flags and train until done or stopped."""
    network: PeerPlane | None = None
    link: PipelineLink | None = None
    reporting: Reporting | None = None
    if roles.banner:
        _log(roles.banner)
    try:
        run_ = run_settings(args, _log)
        if args.stage > 0 and roles != Roles():
            raise ValueError(
                f"--stage {args.stage}: the adversary's parts are mounted at stage 0 only; "
                "a stage > 0 replica would run honestly"
            )
        placement = placement_from_args(args, run_.num_stages)
        # Before anything is started (the embedded verifier, the peer plane): a directory the
        # node cannot write its checkpoints to is the user's to fix, in one line.
        checkpoint_dir = args.checkpoint_dir or args.home / "checkpoints"
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        dataset, updates = _open_data(args, run_)
        model_config = ModelConfig.named(args.model_size, vocab_size=dataset.tokenizer.vocab_size)
        diloco_config = diloco_config_from_args(args)
        if run_.joined is not None:
            model_config, diloco_config = run_.joined.model, run_.joined.diloco
        if args.stage > 0:
            dataset.source.close()
            return _run_stage_replica(
                args, run_, wallet, model_config, diloco_config, stop, dataset, placement
            )
        held_out = held_out_shards(run_.joined, run_.embedded_verifier, dataset)
        reporting = _reporting(
            args,
            run_,
            held_out,
            lambda: embedded_definition(
                dataset, model_config, diloco_config, batch_size=run_.batch_size, seq_len=run_.seq_len
            ),
        )
        reporting.read_vocab(0)
        network_config = network_config_from_args(
            args, reporting=reporting.active, pipeline=run_.num_stages > 1, joined=run_.joined
        )
        if network_config is None and roles.needs_peers:
            raise ValueError(
                "an attacker needs the peer network (--peers or --port): there is nobody to attack"
            )
        trainer_config = TrainerConfig(
            batch_size=run_.batch_size,
            seq_len=run_.seq_len,
            max_steps=args.max_steps,
            checkpoint_every=args.checkpoint_every,
            checkpoint_interval_s=checkpoint_interval(args, placement),
            log_every=args.log_every,
            rotation=RotationConfig(
                min_steps=args.plateau_min_steps,
                window=args.plateau_window,
                enabled=not args.no_plateau_rotation,
            ),
            held_out_shards=held_out,
            activation_checkpointing=args.activation_checkpointing,
        )
        # The parts are built in the order they need each other: the peer network first (the
        # trainer hands it every round), then the round's receipting, then the trainer. The one
        # late-bound reference is `trainer` inside the lambdas below: they run once training has
        # started, when it exists.
        trainer: Trainer | None = None
        work = RoundWork()
        recorder = reporting.recorder(stage=0)
        finish_round = lone_replica
        receipting = None
        if network_config is not None:
            network = PeerPlane(
                network_config,
                wallet,
                stage=0,
                log=_log,
                tokens_per_step=run_.batch_size * run_.seq_len,
                stop=stop,
                aggregate=_aggregation_rule(run_.joined),
                extensions=reporting.extensions(),
                round_factory=roles.rounds(lambda: _engine(trainer).theta_round),
            )
            network.start()
            finish_round = network.finish_round
            if reporting.vocab is not None:
                reporting.vocab.on_grown = network.republish
            if reporting.active:
                receipting = reporting.receipting(
                    network,
                    work,
                    wallet,
                    batch_size=run_.batch_size,
                    tokens_per_step=run_.batch_size * run_.seq_len,
                    segments=recorder,
                )
                finish_round = receipting
            if run_.num_stages > 1:
                link = PipelineLink(
                    network,
                    pipeline_config(args, run_),
                    stop=stop,
                    round_of=lambda: _engine(trainer).round,
                    step_of=lambda: _engine(trainer).step,
                    log=_log,
                    segments=recorder,
                    receivers=reporting.neighbours_of(1),
                )
                link.start()
                if receipting is not None:
                    receipting.disputes = link.client.disputes_of
        trainer = roles.trainer(
            wallet_id=wallet.wallet_id,
            dataset=dataset,
            model_config=model_config,
            diloco_config=diloco_config,
            config=trainer_config,
            checkpoint_dir=checkpoint_dir,
            log=_log,
            finish_round=finish_round,
            # Not in a pipeline: its stage 0 must run the steps its next stages expect.
            round_closing=network.round_closing
            if network is not None and run_.num_stages == 1 and args.round_close == "majority"
            else None,
            work=work,
            segments=recorder,
            dataset_updates=updates,
            fresh=args.fresh,
            num_stages=run_.num_stages,
            loss_fn=remote_loss(
                lambda hidden, labels: _downstream(link, hidden, labels),
                lambda why: link is not None and link.blame_driven(why),
            )
            if run_.num_stages > 1
            else None,
            placement=placement,
            vocab_schedule=reporting.vocab,
        )
        if network is not None:
            engine = trainer.diloco
            if reporting.active:
                reporting.track(
                    network,
                    wallet,
                    progress=lambda: (_engine(trainer).round, _engine(trainer).steps_in_round),
                )
            network.join_state(engine)
            if receipting is not None:  # after a join adopted a peer's θ: the round starts from it
                receipting.round_started(engine)
    except (ManifestError, ShardError, PublisherKeyError, CheckpointMismatch, ValueError, OSError) as exc:
        _close(link, network, reporting)
        return _fail(str(exc))
    except BaseException:  # anything else (out of memory, a bug): stop what was started, then raise
        _close(link, network, reporting)
        raise

    manifest = dataset.manifest
    _log(
        f"model {_model_label(model_config)}: {sum(p.numel() for p in trainer.model.parameters()):,} parameters, "
        f"vocab {model_config.vocab_size}; data {dataset.location} ({manifest.total_shards} shards); "
        f"H={diloco_config.inner_steps}; inner loop on {placement.describe()}"
    )
    try:
        result = trainer.run(stop)
        if not result.stopped_by_signal:  # done: the later stages end with their drivers (stopped: no word)
            if link is not None:
                link.end(trainer.diloco.round, trainer.diloco.step)
            if network is not None:
                network.linger(max_s=network.config.hash_check_timeout_s)  # replicas a little behind finish
    except (ShardError, OSError) as exc:  # OSError: a checkpoint that cannot be written (disk full, …)
        return _fail(str(exc))
    finally:
        trainer.dataset.source.close()
        _close(link, network, reporting)
    how = "stopped by signal" if result.stopped_by_signal else "done"
    _log(f"{how} at step={result.steps} round={result.rounds}; checkpoint {trainer.checkpoint_file}")
    _log(
        f"compute utilisation={result.utilisation:.3f} "
        f"({result.inner_seconds:.1f} s of {result.wall_seconds:.1f} s wall in inner steps)"
    )
    _log(f"time breakdown: {result.breakdown()}")
    return 0


def _engine(trainer: Trainer | None):
    if trainer is None:
        raise RuntimeError("the trainer is not built yet")
    return trainer.diloco


def _close(link: PipelineLink | None, network: PeerPlane | None, reporting: Reporting | None) -> None:
    if link is not None:
        link.close()
    if network is not None:
        network.stop()
    if reporting is not None:
        reporting.close()


def command() -> None:
    """The console script: `main`, then the process ends as neuroshard.cli.process says (never returns)."""
    run_command(main)


if __name__ == "__main__":
    command()
