"""`neuroshard-node`: contribute compute to a NeuroShard run. The composition root of a node process.

With no `--data` this is the embedded default: build (once) a data set from the Python
standard library under `--home`, then train a tiny model on this wallet's shards with
DiLoCo, alone, printing progress and saving checkpoints. Ctrl-C stops cleanly.

This module is the only one of the node that knows argparse: it turns flags, environment and a
joined verifier's definition into typed configs (`RunSettings` and the configs of each part),
starts an embedded verifier when there is one, and wires the parts once, through their
constructors. `neuroshard-adversary` reuses it with its own `Roles`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import NoReturn

import torch

from neuroshard.cli.embedded import start_embedded_verifier
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
from neuroshard.node import aggregation, device
from neuroshard.node.checkpoint import CheckpointIdentity, CheckpointMismatch, checkpoint_path
from neuroshard.node.diloco import DiLoCoConfig
from neuroshard.node.embedded import ensure_default_dataset
from neuroshard.node.model import MODEL_SIZES, ModelConfig
from neuroshard.node.network_definition import NetworkDefinition
from neuroshard.node.outer.round import OuterRound, RoundFactory
from neuroshard.node.p2p.bucket import RelayConfig
from neuroshard.node.p2p.network import NetworkConfig, PeerNetwork
from neuroshard.node.p2p.pipeline import PipelineConfig, PipelineUnavailable
from neuroshard.node.p2p.pipeline_wire import ACTIVATION_DTYPES, CODEC_NAMES, DEFAULT_CODEC
from neuroshard.node.p2p.rounds import AggregationRule
from neuroshard.node.p2p.stages import PipelineLink
from neuroshard.node.p2p.wire import ENCODINGS
from neuroshard.node.pipeline import remote_loss, stage_fingerprint
from neuroshard.node.replay import ReplayArchive
from neuroshard.node.reporting import (
    Reporting,
    embedded_definition,
    held_out_shards,
    join_network,
    segment_store,
)
from neuroshard.node.rotation import RotationConfig
from neuroshard.node.stage_replica import start_stage_replica
from neuroshard.node.stage_worker import StageCheckpoint, WorkerConfig
from neuroshard.node.trainer import DatasetUpdates, Trainer, TrainerConfig, lone_replica
from neuroshard.node.wallet import TOKEN_ENV, TokenError, Wallet, resolve_token
from neuroshard.node.work import RoundWork

PROG = "neuroshard-node"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of the full usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog: str = PROG, description: str | None = __doc__) -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    _add_network_arguments(p)
    _add_pipeline_arguments(p)
    _add_verifier_arguments(p)
    # No --peers and no --port: the node trains alone (and opens a free loopback port only to
    # serve its verifier: node.reporting).
    p.set_defaults(port=None)
    return p


def _add_network_arguments(parser: argparse.ArgumentParser) -> None:
    d = NetworkConfig()
    g = parser.add_argument_group("peer network (signed aiohttp protocol between the stage's replicas)")
    g.add_argument("--host", default=d.host, help="address the peer server binds (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=int, default=d.port, help="peer server TCP port (0: any free port)")
    g.add_argument("--announce", help="host:port peers should dial, if not --host:--port (NAT)")
    g.add_argument("--peers", default="", help="comma-separated bootstrap host:port list")
    g.add_argument(
        "--relay",
        metavar="s3://BUCKET/PREFIX",
        help="the stage's S3-compatible bucket; without --port this node opens no port and takes part "
        "through the bucket alone (outbound connections only). Credentials: boto3's usual chain",
    )
    g.add_argument("--relay-endpoint", help="S3-compatible endpoint URL (MinIO, R2, ...); default AWS")
    g.add_argument("--relay-region", help="the bucket's region; default boto3's")
    g.add_argument(
        "--encoding", choices=ENCODINGS, default=d.encoding, help="pseudo-gradient encoding on the wire"
    )
    g.add_argument(
        "--round-timeout",
        type=float,
        default=d.round_timeout_s,
        help="seconds to wait for the other replicas' contributions",
    )
    g.add_argument(
        "--min-peers",
        type=int,
        default=d.min_peers,
        help="stage peers to wait for (15 s at most) before training",
    )


def _add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
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


def _add_verifier_arguments(parser: argparse.ArgumentParser) -> None:
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


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What the run decides: the joined verifier's signed definition where there is one, this node's
    own flags otherwise. Built once (`run_settings`); the flags themselves are never rewritten."""

    joined: NetworkDefinition | None
    num_stages: int
    codec: str
    data: str | None
    publisher_key: str | None
    batch_size: int
    seq_len: int
    operator_key: str | None
    """The key that signed the joined definition: only it may ask for replay material."""
    embedded_verifier: bool
    """Whether this node starts a verifier in its own process (the embedded default)."""


def run_settings(args: argparse.Namespace) -> RunSettings:
    """Join the verifier named by --join (its definition overrides model, stages, batch shape and
    data) or take the flags as they are. Raises ValueError on a flag the run contradicts."""
    if not args.join:
        if not 0 <= args.stage < args.stages:
            raise ValueError(f"--stage {args.stage} must lie in [0, --stages {args.stages})")
        if args.stages > 1 and not args.no_verifier:
            # A pipeline is several processes, one per stage replica, and none of them is the run: an
            # embedded verifier in each would define its own network and see one stage only.
            _log(
                "pipeline stages: no embedded verifier (it would see one stage of the run); "
                "start neuroshard-verifier and --join it to have the run tracked and measured"
            )
        return RunSettings(
            joined=None,
            num_stages=args.stages,
            codec=args.activation_codec or DEFAULT_CODEC,
            data=args.data,
            publisher_key=args.publisher_key,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            operator_key=None,
            embedded_verifier=not args.no_verifier and args.stages == 1,
        )
    definition, key = join_network(args.join, operator_key=args.operator_key, home=args.home, log=_log)
    if not 0 <= args.stage < definition.num_stages:
        raise ValueError(
            f"--stage {args.stage}: {args.join} cuts the model into {definition.num_stages} stages "
            f"(0..{definition.num_stages - 1})"
        )
    if args.activation_codec is not None and args.activation_codec != definition.pipeline_codec:
        raise ValueError(
            f"--activation-codec {args.activation_codec}: {args.join} runs its pipeline in "
            f"{definition.pipeline_codec} (its [stages] codec); every replica must use the run's"
        )
    _log(
        f"joined network {definition.name!r} at {args.join} (operator {key[:16]}…): "
        f"stage {args.stage} of {definition.num_stages} (pipeline codec {definition.pipeline_codec}), "
        f"H={definition.diloco.inner_steps}, batch {definition.batch_size}x{definition.seq_len}, "
        f"aggregation {definition.aggregation_rule} f={definition.aggregation_f}, "
        f"held-out shard {definition.held_out_shard}"
    )
    return RunSettings(
        joined=definition,
        num_stages=definition.num_stages,
        codec=definition.pipeline_codec,
        data=definition.manifest_url,
        publisher_key=definition.publisher_key,
        batch_size=definition.batch_size,
        seq_len=definition.seq_len,
        operator_key=key,
        embedded_verifier=False,
    )


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


def network_config_from_args(
    args: argparse.Namespace, *, reporting: bool, pipeline: bool
) -> NetworkConfig | None:
    """The peer plane the flags ask for; None trains alone. A node that reports to a verifier
    (`reporting`) serves its peer plane on a free port unless --port says otherwise (the verifier
    fetches the majority weights from it); a pipeline stage always serves one."""
    if args.port is None and not args.peers and not args.relay and not reporting and not pipeline:
        return None
    relay = None
    if args.relay:
        relay = RelayConfig(url=args.relay, endpoint_url=args.relay_endpoint, region=args.relay_region)
    if args.port is not None:
        port = args.port
    elif reporting and relay is None:
        port = 0  # any free port: the verifier learns it at registration
    else:
        port = NetworkConfig().port
    return NetworkConfig(
        host=args.host,
        port=port,
        announce=args.announce,
        peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()),
        relay=relay,
        # A --relay node without --port opens no port: it takes part through the bucket alone.
        listen=relay is None or args.port is not None,
        encoding=args.encoding,
        round_timeout_s=args.round_timeout,
        min_peers=args.min_peers,
    )


def pipeline_config(args: argparse.Namespace, run: RunSettings) -> PipelineConfig:
    return PipelineConfig(num_stages=run.num_stages, codec=run.codec, max_batch=max(64, run.batch_size))


def checkpoint_interval(args: argparse.Namespace, placement: device.Placement) -> float:
    """--checkpoint-interval, or its default: every turn on the CPU, at most every 5 minutes on
    an accelerator (a 125M model's 50 steps take ~2.5 s on an H200 and each checkpoint ~1.5 s)."""
    if args.checkpoint_interval is not None:
        return float(args.checkpoint_interval)
    return 0.0 if placement.device.type == "cpu" else 300.0


def placement_from_args(args: argparse.Namespace, num_stages: int) -> device.Placement:
    """The inner loop's device and precision. Pipeline stages (S > 1) train on the CPU in fp32 for
    now: activations cross stages as CPU tensors (node.pipeline), not moved yet."""
    if num_stages > 1:
        if args.device not in ("auto", "cpu") or args.precision not in ("auto", "fp32"):
            raise ValueError(
                f"--device {args.device} --precision {args.precision}: pipeline stages (--stages "
                f"{num_stages}) train on the CPU in fp32 for now; use --device cpu or --stages 1"
            )
        return device.Placement.cpu()
    return device.resolve(args.device, args.precision)


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


@dataclass(frozen=True)
class Roles:
    """The implementations this composition root plugs in. An honest node takes the defaults;
    `neuroshard-adversary` passes its own (neuroshard.adversary), through the same constructors."""

    rounds: Callable[[Callable[[], torch.Tensor]], RoundFactory] = lambda theta_round: OuterRound
    """Given a way to read this replica's θ_round, the round implementation its peer network runs."""
    trainer: type[Trainer] = Trainer
    banner: str | None = None
    """A line printed at start (an adversary's loud warning)."""


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
            segments=segment_store(args.home, joined.segment_k, args.replay_rounds, _log),
            # The embedded verifier does not replay its own node's rounds, and a pipeline stage's
            # inner steps depend on the other stages' replicas: neither keeps replay material.
            archive=ReplayArchive(args.replay_rounds) if joined.num_stages == 1 else None,
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
    tokenizer_sha256: str,
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
            tokenizer_sha256=tokenizer_sha256,
        ),
    )
    reporting = _reporting(args, run, (), lambda: NotImplemented)
    network_config = network_config_from_args(args, reporting=False, pipeline=True)
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
        _log(f"received {signal.Signals(signum).name}: finishing the current step and saving a checkpoint")
        stop.set()
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
    network: PeerNetwork | None = None
    link: PipelineLink | None = None
    reporting: Reporting | None = None
    if roles.banner:
        _log(roles.banner)
    try:
        run_ = run_settings(args)
        placement = placement_from_args(args, run_.num_stages)
        dataset, updates = _open_data(args, run_)
        model_config = ModelConfig.named(args.model_size, vocab_size=dataset.tokenizer.vocab_size)
        diloco_config = diloco_config_from_args(args)
        if run_.joined is not None:
            model_config, diloco_config = run_.joined.model, run_.joined.diloco
        if args.stage > 0:
            dataset.source.close()
            sha = dataset.manifest.tokenizer.sha256
            return _run_stage_replica(args, run_, wallet, model_config, diloco_config, stop, sha)
        held_out = held_out_shards(run_.joined, run_.embedded_verifier, dataset)
        reporting = _reporting(
            args,
            run_,
            held_out,
            lambda: embedded_definition(
                dataset, model_config, diloco_config, batch_size=run_.batch_size, seq_len=run_.seq_len
            ),
        )
        network_config = network_config_from_args(
            args, reporting=reporting.active, pipeline=run_.num_stages > 1
        )
        if network_config is None and roles.banner:
            raise ValueError(
                "an attacker needs the peer network (--peers or --port): there is nobody to attack"
            )
        if network_config is not None and network_config.relay is not None and run_.num_stages > 1:
            raise ValueError(
                "--relay takes a data-parallel stage (--stages 1): pipeline stages need open ports"
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
            network = PeerNetwork(
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
                )
                link.start()
        trainer = roles.trainer(
            wallet_id=wallet.wallet_id,
            dataset=dataset,
            model_config=model_config,
            diloco_config=diloco_config,
            config=trainer_config,
            checkpoint_dir=args.checkpoint_dir or args.home / "checkpoints",
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
            loss_fn=remote_loss(lambda hidden, labels: _downstream(link, hidden, labels))
            if run_.num_stages > 1
            else None,
            placement=placement,
        )
        if network is not None:
            engine = trainer.diloco
            if receipting is not None:
                receipting.round_started(engine)
            if reporting.active:
                reporting.track(network, wallet, progress=lambda: (engine.round, engine.steps_in_round))
            network.join_state(engine)
    except (ManifestError, ShardError, PublisherKeyError, CheckpointMismatch, ValueError, OSError) as exc:
        _close(link, network, reporting)
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


def _close(link: PipelineLink | None, network: PeerNetwork | None, reporting: Reporting | None) -> None:
    if link is not None:
        link.close()
    if network is not None:
        network.stop()
    if reporting is not None:
        reporting.close()


if __name__ == "__main__":
    sys.exit(main())
