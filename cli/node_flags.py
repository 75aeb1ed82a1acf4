"""The flags of `neuroshard-node` (and of `neuroshard-adversary`, which adds its own), and the typed
settings and configs they become: `RunSettings` (what the run decides: a joined verifier's signed
definition, else these flags), the peer plane's, the pipeline's, DiLoCo's and the device's.
Nothing here wires or starts anything; cli.node does."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neuroshard.cli.parser import Parser
from neuroshard.node import device
from neuroshard.node.actcodec import DEFAULT_CODEC
from neuroshard.node.diloco import DiLoCoConfig
from neuroshard.node.model import MODEL_SIZES
from neuroshard.node.network_definition import NetworkDefinition
from neuroshard.node.p2p.bucket import RelayConfig
from neuroshard.node.p2p.pipeline import PipelineConfig
from neuroshard.node.p2p.plane import PeerPlaneConfig
from neuroshard.node.reporting import join_network
from neuroshard.node.rotation import RotationConfig
from neuroshard.node.wallet import TOKEN_ENV
from neuroshard.protocol.pipeline import ACTIVATION_DTYPES, CODEC_NAMES
from neuroshard.protocol.round import ENCODINGS

PROG = "neuroshard-node"
DESCRIPTION = """Contribute compute to a NeuroShard run.

With no `--data` this is the embedded default: build (once) a data set from the Python
standard library under `--home`, then train a tiny model on this wallet's shards with
DiLoCo, alone, printing progress and saving checkpoints. Ctrl-C stops cleanly."""


def build_parser(prog: str = PROG, description: str | None = DESCRIPTION) -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
        help=(
            "where the inner loop runs (auto: CUDA, else MPS, else CPU); θ_round, aggregation and hashes "
            "stay on the CPU in fp32, and the outer step gives the same bits on every device"
        ),
    )
    model.add_argument(
        "--precision",
        choices=device.PRECISIONS,
        default="auto",
        help="inner-loop precision over fp32 master weights (auto: bf16 autocast on CUDA with bf16, else fp32; "
        "pipeline stages take fp32 or bf16)",
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
        "--outer-lr",
        type=float,
        default=None,
        help="outer SGD learning rate (default: tuned for --inner-steps, node.diloco.tuned_outer_lr: "
        "0.7 below 20 steps, 1.0 from 20; bench/RESULTS.md)",
    )
    diloco.add_argument(
        "--outer-momentum",
        type=float,
        default=d.outer_momentum,
        help="outer Nesterov momentum (0: plain SGD)",
    )
    diloco.add_argument(
        "--outer-warmup-rounds",
        type=int,
        default=d.outer_warmup_rounds,
        help="outer rounds over which the outer lr ramps up (default 0; a network.toml that names none "
        "gives 3: with --join the network's value applies)",
    )
    diloco.add_argument(
        "--anchor-floor",
        type=float,
        default=None,
        metavar="COSINE",
        help="anchor every round after the first to the outer momentum buffer: refuse a Δ whose whole "
        "cosine to it is below this, and screen parts with wider limits (default: no anchor; a "
        "network.toml that names none gives 0.1: with --join the network's value applies). Every "
        "replica of the stage must name the same",
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
        help="minimum seconds between checkpoints, and from the start to the first (default: 0 on "
        "the CPU; 300 on a GPU, where --checkpoint-every steps take seconds and each checkpoint "
        "costs about one); the checkpoint on stop is always written",
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
    d = PeerPlaneConfig()
    g = parser.add_argument_group("peer network (signed aiohttp protocol between the stage's replicas)")
    g.add_argument("--host", default=d.host, help="address the peer server binds (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=int, default=d.port, help="peer server TCP port (0: any free port)")
    g.add_argument("--announce", help="host:port peers should dial, if not --host:--port (NAT)")
    g.add_argument("--peers", default="", help="comma-separated bootstrap host:port list")
    g.add_argument(
        "--relay",
        metavar="s3://BUCKET/PREFIX",
        help="the run's S3-compatible bucket; without --port this node opens no port and takes part "
        "through the bucket alone (outbound connections only), a pipeline stage's micro-batches "
        "included. Credentials: boto3's usual chain",
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
        help="with --join: recent rounds kept for the verifier's spot checks: segment material on disk, and "
        "for a round whose receipt names no segment root (a round redone after a restart) its θ_round, Δ and "
        "inner optimizer state in memory (4 × the model's size)",
    )
    g.add_argument(
        "--disk-share",
        type=float,
        default=1.0,
        help="the part of the free disk under --home this node counts for its segment material, for "
        "nodes that share one disk (neuroshard-swarm gives each of its N nodes 1/N); default all of it",
    )


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


def run_settings(args: argparse.Namespace, log: Callable[[str], None]) -> RunSettings:
    """Join the verifier named by --join (its definition overrides model, stages, batch shape and
    data) or take the flags as they are. Raises ValueError on a flag the run contradicts."""
    if not args.join:
        if not 0 <= args.stage < args.stages:
            raise ValueError(f"--stage {args.stage} must lie in [0, --stages {args.stages})")
        if args.stages > 1 and not args.no_verifier:
            # A pipeline is several processes, one per stage replica, and none of them is the run: an
            # embedded verifier in each would define its own network and see one stage only.
            log(
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
    definition, key = join_network(args.join, operator_key=args.operator_key, home=args.home, log=log)
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
    log(
        f"joined network {definition.name!r} at {args.join} (operator {key[:16]}…): "
        f"stage {args.stage} of {definition.num_stages} (pipeline codec {definition.pipeline_codec}), "
        f"H={definition.diloco.inner_steps}, batch {definition.batch_size}x{definition.seq_len}, "
        f"aggregation {definition.aggregation_rule} f={definition.aggregation_f} "
        f"(clipping τ×{definition.clip.scale:g}, {definition.clip.iterations} iteration(s))"
        + ("" if definition.anchor_floor is None else f" anchored (floor {definition.anchor_floor})")
        + ", "
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
        outer_warmup_rounds=args.outer_warmup_rounds,
    )


def network_config_from_args(
    args: argparse.Namespace, *, reporting: bool, pipeline: bool, joined: NetworkDefinition | None = None
) -> PeerPlaneConfig | None:
    """The peer plane the flags ask for; None trains alone. A node that reports to a verifier
    (`reporting`) serves its peer plane on a free port unless --port says otherwise (the verifier
    fetches the majority weights from it); a pipeline stage always serves one. A `joined`
    network's anchor floor anchors its rounds (``PeerPlaneConfig.anchor_floor``), else
    --anchor-floor's."""
    if args.anchor_floor is not None and not -1.0 <= args.anchor_floor <= 1.0:
        raise ValueError(f"--anchor-floor {args.anchor_floor}: a cosine, in [-1, 1]")
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
        port = PeerPlaneConfig().port
    return PeerPlaneConfig(
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
        anchor_floor=args.anchor_floor if joined is None else joined.anchor_floor,
    )


def pipeline_config(args: argparse.Namespace, run: RunSettings) -> PipelineConfig:
    network = None if run.joined is None else run.joined.digest()
    return PipelineConfig(
        num_stages=run.num_stages, codec=run.codec, max_batch=max(64, run.batch_size), network=network
    )


def checkpoint_interval(args: argparse.Namespace, placement: device.Placement) -> float:
    """--checkpoint-interval, or its default: every turn on the CPU, at most every 5 minutes on
    an accelerator (a 125M model's 50 steps take ~2.5 s on an H200 and each checkpoint ~1.5 s)."""
    if args.checkpoint_interval is not None:
        return float(args.checkpoint_interval)
    return 0.0 if placement.device.type == "cpu" else 300.0


def placement_from_args(args: argparse.Namespace, num_stages: int) -> device.Placement:
    """The inner loop's device and precision. Every pipeline stage takes the device it is given
    (activations and gradients cross stages as CPU float32, node.pipeline), in fp32 or bf16: fp16
    needs a loss scale, and a stage's activation gradients cross the wire unscaled."""
    if num_stages > 1 and args.precision == "fp16":
        raise ValueError(
            f"--precision fp16: pipeline stages (--stages {num_stages}) train in fp32 or bf16 "
            "(fp16 needs a loss scale the pipeline's gradients do not carry)"
        )
    return device.resolve(args.device, args.precision)  # "auto" picks bf16 or fp32, never fp16
