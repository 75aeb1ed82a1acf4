"""`neuroshard-node`: contribute compute to a NeuroShard run.

With no `--data` this is the embedded default: build (once) a data set from the Python
standard library under `--home`, then train a tiny model on this wallet's shards with
DiLoCo, alone, printing progress and saving checkpoints. Ctrl-C stops cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from functools import partial
from pathlib import Path
from types import FrameType
from typing import NoReturn

import torch

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

from . import aggregation, device, work_lies
from .checkpoint import CheckpointIdentity, CheckpointMismatch, checkpoint_path
from .diloco import DiLoCoConfig
from .embedded import ensure_default_dataset
from .model import MODEL_SIZES, ModelConfig
from .network_definition import NetworkDefinition
from .p2p import byzantine
from .p2p.network import NetworkConfig, PeerNetwork, add_network_arguments, network_config_from_args
from .p2p.pipeline import PipelineConfig, PipelineUnavailable
from .p2p.rounds import AggregationRule
from .p2p.server import ServerExtension
from .p2p.stages import PipelineLink, add_pipeline_arguments, pipeline_config_from_args, start_stage_replica
from .pipeline import remote_loss, stage_fingerprint
from .reporting import (
    Reporting,
    add_verifier_arguments,
    embedded_definition,
    held_out_shards,
    join_network,
    segment_store,
)
from .rotation import RotationConfig
from .stage_worker import StageCheckpoint, WorkerConfig
from .trainer import DatasetUpdates, Trainer, TrainerConfig
from .wallet import TOKEN_ENV, TokenError, Wallet, resolve_token

PROG = "neuroshard-node"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of the full usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ident = p.add_argument_group("identity (the token is a secret: it never leaves this machine)")
    ident.add_argument("--token", help=f"wallet token; visible to `ps` — prefer --token-file or ${TOKEN_ENV}")
    ident.add_argument("--token-file", type=Path, help="file holding the token (must be mode 0600)")

    data = p.add_argument_group("data")
    data.add_argument(
        "--home",
        type=Path,
        default=Path.home() / ".neuroshard",
        help="state directory: default data set, publisher key, checkpoints",
    )
    data.add_argument(
        "--data-url",
        "--data",
        dest="data",
        metavar="URL_OR_DIR",
        help="published data set: an http(s):// base URL (CDN, public bucket) or a local directory "
        "(default: build one under --home)",
    )
    data.add_argument(
        "--publisher-key", help="hex Ed25519 public key that must have signed the data set's manifest"
    )
    data.add_argument(
        "--cache-dir", type=Path, help="shard cache for --data-url over HTTP (default: HOME/cache)"
    )
    data.add_argument(
        "--cache-gb", type=float, default=20.0, help="cache size cap; least recently used shards are evicted"
    )

    model = p.add_argument_group("model and training")
    model.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny", help="named model size")
    model.add_argument("--batch-size", type=int, default=8, help="sequences per inner step")
    model.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    model.add_argument(
        "--max-steps",
        type=int,
        help="stop once the network reaches this inner step, round x H + steps in the round (default: run until Ctrl-C)",
    )
    model.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    model.add_argument(
        "--device",
        default="auto",
        metavar="{auto,cpu,cuda,cuda:N,mps}",
        help="where the inner loop runs (auto: CUDA, else MPS, else CPU); the outer round stays on the CPU",
    )
    model.add_argument(
        "--precision",
        choices=device.PRECISIONS,
        default="auto",
        help="inner-loop precision over fp32 master weights (auto: bf16 autocast on CUDA with bf16, else fp32)",
    )
    model.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each layer's activations in the backward pass: less memory, ~1/3 more compute",
    )

    diloco = p.add_argument_group("DiLoCo (Douillard et al. 2023)")
    d = DiLoCoConfig()
    diloco.add_argument(
        "--inner-steps", type=int, default=100, help="H: inner steps per outer round (production: 500)"
    )
    diloco.add_argument(
        "--round-close",
        choices=("majority", "full"),
        default="majority",
        help="majority: a replica stops a round early (after >= 3/4 of H) once most of its stage has "
        "committed to it (not ported to the partitioned round yet: H steps for now); full: always H steps",
    )
    diloco.add_argument("--inner-lr", type=float, default=d.inner_lr, help="AdamW peak learning rate")
    diloco.add_argument("--warmup-steps", type=int, default=30, help="linear warm-up steps of the inner lr")
    diloco.add_argument(
        "--total-steps",
        type=int,
        default=20_000,
        help="inner step where the cosine lr decay ends; keep it fixed across restarts (the schedule follows it)",
    )
    diloco.add_argument(
        "--outer-lr", type=float, default=d.outer_lr, help="outer SGD learning rate (tuned: bench/RESULTS.md)"
    )
    diloco.add_argument(
        "--outer-momentum",
        type=float,
        default=d.outer_momentum,
        help="outer Nesterov momentum (0: plain SGD)",
    )

    rot = p.add_argument_group("shard rotation (on exhaustion, or when the loss plateaus on a shard)")
    r = RotationConfig()
    rot.add_argument(
        "--plateau-min-steps",
        type=int,
        default=r.min_steps,
        help="inner steps on a shard before a plateau can end it",
    )
    rot.add_argument(
        "--plateau-window", type=int, default=r.window, help="steps per window of the plateau test"
    )
    rot.add_argument(
        "--no-plateau-rotation", action="store_true", help="leave a shard only when it is exhausted"
    )

    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", type=Path, help="default: HOME/checkpoints")
    ckpt.add_argument("--checkpoint-every", type=int, default=50, help="inner steps between checkpoints")
    ckpt.add_argument(
        "--checkpoint-interval",
        type=float,
        metavar="SECONDS",
        help="minimum seconds between checkpoints (default: 0 on the CPU; 300 on a GPU, where "
        "--checkpoint-every steps take seconds and each checkpoint costs about one)",
    )
    ckpt.add_argument(
        "--fresh", action="store_true", help="ignore (and later overwrite) an existing checkpoint"
    )
    p.add_argument("--log-every", type=int, default=10, help="inner steps per progress line")
    add_network_arguments(p)
    add_pipeline_arguments(p)
    byzantine.add_attack_arguments(p)
    work_lies.add_work_lie_arguments(p)
    add_verifier_arguments(p)
    # No --peers and no --port: the node trains alone (and opens a free loopback port only to
    # serve its verifier: node.reporting).
    p.set_defaults(port=None)
    return p


_LOG_LOCK = threading.RLock()
"""print writes the text and the newline separately: without a lock, lines from the training,
peer, tracker and embedded verifier threads can merge (and the swarm parses these lines).
Re-entrant: the SIGTERM handler logs on the main thread, possibly in the middle of its print."""


def diloco_config_from_args(args: argparse.Namespace) -> DiLoCoConfig:
    """The DiLoCoConfig the flags ask for; the outer step's defaults are DiLoCoConfig's own
    (tuned by bench/bench_convergence.py), Nesterov whenever the momentum is > 0."""
    return DiLoCoConfig(
        inner_steps=args.inner_steps,
        inner_lr=args.inner_lr,
        warmup_steps=min(args.warmup_steps, args.total_steps),
        total_steps=args.total_steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        outer_nesterov=args.outer_momentum > 0,
    )


def checkpoint_interval(args: argparse.Namespace, placement: device.Placement) -> float:
    """--checkpoint-interval, or its default: every turn on the CPU, at most every 5 minutes on
    an accelerator (a 125M model's 50 steps take ~2.5 s on an H200 and each checkpoint ~1.5 s)."""
    if args.checkpoint_interval is not None:
        return float(args.checkpoint_interval)
    return 0.0 if placement.device.type == "cpu" else 300.0


def placement_from_args(args: argparse.Namespace) -> device.Placement:
    """The inner loop's device and precision. Pipeline stages (--stages > 1) train on the CPU in
    fp32 for now: activations cross stages as CPU tensors (node.pipeline), not moved yet."""
    if args.stages > 1:
        if args.device not in ("auto", "cpu") or args.precision not in ("auto", "fp32"):
            raise ValueError(
                f"--device {args.device} --precision {args.precision}: pipeline stages (--stages "
                f"{args.stages}) train on the CPU in fp32 for now; use --device cpu or --stages 1"
            )
        return device.Placement.cpu()
    return device.resolve(args.device, args.precision)


def _log(line: str) -> None:
    with _LOG_LOCK:
        print(line, flush=True)


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return 2


def _open_data(args: argparse.Namespace) -> tuple[Dataset, DatasetUpdates | None]:
    if args.data is None:
        return ensure_default_dataset(args.home, _log), None
    if not args.publisher_key:
        raise PublisherKeyError(
            "--data-url needs --publisher-key (the hex public key that signed its manifest)"
        )
    key = parse_public_key(args.publisher_key)
    if not args.data.startswith(("http://", "https://")):
        return open_dataset(Path(args.data), key), None
    config = FetchConfig(cache_bytes=int(args.cache_gb * (1 << 30)))
    dataset = open_remote_dataset(
        args.data, key, args.cache_dir or args.home / "cache", config=config, log=_log
    )
    return dataset, remote_updates(dataset, _log)


def _aggregation_rule(joined: NetworkDefinition | None) -> AggregationRule:
    """A joined node aggregates as the network definition says; its peers (and the verifier's
    hash agreement) expect bit-identical rounds, which a different rule would break."""
    if joined is None:
        return partial(aggregation.aggregate, "default")
    return aggregation.network_rule(joined.aggregation_rule, joined.aggregation_f)


def _model_label(config: ModelConfig) -> str:
    """The preset name of the model this node trains (from the network definition when joined),
    or its shape when it matches no preset."""
    for name, preset in MODEL_SIZES.items():
        if all(getattr(config, key) == value for key, value in preset.items()):
            return name
    return f"custom (dim {config.dim}, {config.n_layers} layers, {config.n_heads} heads)"


def _start_network(
    args: argparse.Namespace,
    wallet: Wallet,
    stop: threading.Event,
    rule: AggregationRule,
    extensions: list[ServerExtension],
) -> PeerNetwork | None:
    """The peer server and round exchange, when the node was given peers or a port (or is a pipeline
    stage); None trains alone."""
    attacker = byzantine.attacker_from_args(args)
    round_class = byzantine.owner_round_from_args(args)
    if args.port is None and not args.peers and not args.relay and args.stages == 1:
        if attacker is not None or args.owner_attack is not None:
            raise ValueError("--attack needs the peer network (--peers or --port): there is nobody to attack")
        return None
    if args.relay and args.stages > 1:
        raise ValueError("--relay takes a data-parallel stage (--stages 1): pipeline stages need open ports")
    if args.port is None and not args.relay:
        args.port = NetworkConfig().port
    network = PeerNetwork(
        network_config_from_args(args),
        wallet,
        stage=0,
        log=_log,
        tokens_per_step=args.batch_size * args.seq_len,
        stop=stop,
        aggregate=rule,
        attacker=attacker,
        extensions=extensions,
        round_class=round_class,
    )
    if attacker is not None:
        _log(byzantine.warning(attacker))
    if args.owner_attack is not None:
        _log(
            f"WARNING: ATTACK MODE owner {args.owner_attack}: this node cheats in the parts it owns, "
            "for testing the round's fraud proofs"
        )
    network.start()
    return network


def _downstream(
    link: PipelineLink | None, hidden: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, float]:
    if link is None:
        raise PipelineUnavailable("the pipeline link to stage 1 is not up")
    return link.downstream(hidden, labels)


def _run_stage_replica(
    args: argparse.Namespace,
    wallet: Wallet,
    model_config: ModelConfig,
    diloco_config: DiLoCoConfig,
    pipeline: PipelineConfig,
    stop: threading.Event,
    tokenizer_sha256: str,
    joined: NetworkDefinition | None,
) -> int:
    """A stage > 0 replica: no data of its own, it trains on the micro-batches stage i-1 sends,
    and reports to the verifier it joined (if any)."""
    if args.port is None:
        args.port = NetworkConfig().port
    directory = args.checkpoint_dir or args.home / "checkpoints"
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint = StageCheckpoint(
        path=checkpoint_path(directory, wallet.wallet_id, args.stage),
        identity=CheckpointIdentity(
            wallet_id=wallet.wallet_id,
            stage=args.stage,
            model_fingerprint=stage_fingerprint(model_config, args.stages),
            tokenizer_sha256=tokenizer_sha256,
        ),
    )
    segments = (
        None if joined is None else segment_store(args.home, joined.segment_k, args.replay_rounds, _log)
    )
    replica = start_stage_replica(
        wallet=wallet,
        stage=args.stage,
        model_config=model_config,
        diloco_config=diloco_config,
        network_config=network_config_from_args(args),
        pipeline_config=pipeline,
        worker_config=WorkerConfig(max_steps=args.max_steps, log_every=args.log_every),
        stop=stop,
        log=_log,
        aggregate=_aggregation_rule(joined),
        checkpoint=checkpoint,
        fresh=args.fresh,
        segments=segments,
        operator_key=None if joined is None else args.operator_key,
    )
    # No embedded verifier for a stage replica (_no_embedded_verifier_for_stages): the joined one or none.
    url = None if joined is None else args.join
    reporting = Reporting(url=url, operator_key=None, log=_log, num_stages=args.stages)
    reporting.attach_stage(replica, wallet)
    try:
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
        _log(f"received {signal.Signals(signum).name}: finishing the current step and saving a checkpoint")
        stop.set()
        # A second Ctrl-C falls through to the default behaviour and ends the process at once.
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _no_embedded_verifier_for_stages(args: argparse.Namespace) -> None:
    """A pipeline is several processes, one per stage replica, and none of them is the run: an
    embedded verifier in each would define its own network from its own flags, and each would
    see one stage only. A pipeline is tracked by one `neuroshard-verifier` that every stage
    replica joins (`--join`; `neuroshard-swarm --stages S` starts one)."""
    if not args.no_verifier:
        _log(
            "pipeline stages: no embedded verifier (it would see one stage of the run); "
            "start neuroshard-verifier and --join it to have the run tracked and measured"
        )
        args.no_verifier = True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    network: PeerNetwork | None = None
    link: PipelineLink | None = None
    reporting: Reporting | None = None
    try:
        joined: NetworkDefinition | None = join_network(args, _log)  # sets --stages when it joins
        pipeline = pipeline_config_from_args(args)
        if args.stages > 1 and joined is None:
            _no_embedded_verifier_for_stages(args)
        placement = placement_from_args(args)
        dataset, updates = _open_data(args)
        model_config = ModelConfig.named(args.model_size, vocab_size=dataset.tokenizer.vocab_size)
        diloco_config = diloco_config_from_args(args)
        if joined is not None:
            model_config, diloco_config = joined.model, joined.diloco
        if args.stage > 0:
            dataset.source.close()
            sha = dataset.manifest.tokenizer.sha256
            return _run_stage_replica(args, wallet, model_config, diloco_config, pipeline, stop, sha, joined)
        held_out = held_out_shards(args, joined, dataset)
        trainer_config = TrainerConfig(
            batch_size=args.batch_size,
            seq_len=args.seq_len,
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
        trainer = Trainer(
            wallet_id=wallet.wallet_id,
            dataset=dataset,
            model_config=model_config,
            diloco_config=diloco_config,
            config=trainer_config,
            checkpoint_dir=args.checkpoint_dir or args.home / "checkpoints",
            log=_log,
            dataset_updates=updates,
            fresh=args.fresh,
            num_stages=args.stages,
            loss_fn=remote_loss(lambda hidden, labels: _downstream(link, hidden, labels))
            if args.stages > 1
            else None,
            placement=placement,
        )
        reporting = Reporting.open(
            args,
            joined,
            held_out,
            lambda: embedded_definition(args, dataset, model_config, diloco_config),
            _log,
        )
        if args.work_lie is not None:
            _log(work_lies.warning(args.work_lie))
            if args.work_lie == "data":
                work_lies.read_unassigned_windows(trainer)
        network = _start_network(args, wallet, stop, _aggregation_rule(joined), reporting.extensions())
        if network is not None:
            trainer.set_round_finisher(network.finish_round)
            # Not in a pipeline: its stage 0 must run the steps its next stages expect.
            if args.stages == 1 and args.round_close == "majority":
                trainer.close_rounds_when(network.round_closing)
            wrap = work_lies.claim_scaled_delta if args.work_lie == "delta" else None
            reporting.attach(network, trainer, wallet, wrap)
            if args.stages > 1:
                link = PipelineLink(
                    network, pipeline, stop=stop, round_of=lambda: trainer.diloco.round,
                    step_of=lambda: trainer.diloco.step, log=_log,
                )  # fmt: skip
                link.start()
                link.client.segments = trainer.segments
            network.join_state(trainer.diloco)
    except (ManifestError, ShardError, PublisherKeyError, CheckpointMismatch, ValueError, OSError) as exc:
        if link is not None:
            link.close()
        if network is not None:
            network.stop()
        if reporting is not None:
            reporting.close()
        return _fail(str(exc))

    manifest = dataset.manifest
    _log(
        f"model {_model_label(model_config)}: {sum(p.numel() for p in trainer.model.parameters()):,} parameters, "
        f"vocab {model_config.vocab_size}; data {dataset.location} ({manifest.total_shards} shards); "
        f"H={diloco_config.inner_steps}; inner loop on {placement.describe()}"
    )
    try:
        result = trainer.run(stop)
    except (ShardError, OSError) as exc:  # OSError: a checkpoint that cannot be written (disk full, …)
        return _fail(str(exc))
    finally:
        trainer.dataset.source.close()
        if link is not None:
            link.close()
        if network is not None:
            network.stop()
        if reporting is not None:
            reporting.close()
    how = "stopped by signal" if result.stopped_by_signal else "done"
    _log(f"{how} at step={result.steps} round={result.rounds}; checkpoint {trainer.checkpoint_file}")
    _log(
        f"compute utilisation={result.utilisation:.3f} "
        f"({result.inner_seconds:.1f} s of {result.wall_seconds:.1f} s wall in inner steps)"
    )
    _log(f"time breakdown: {result.breakdown()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
