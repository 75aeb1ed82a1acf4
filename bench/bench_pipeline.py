"""Pipeline stages: what the activation codec saves on the wire and what it costs in loss.

Three measurements, each against bf16 (the wire before codecs) and each codec of
`neuroshard.node.actcodec` (fitted43 is the default since 2026-11-27, int8 before):

1. Bytes per token per stage boundary, each direction, from real encoded bodies
   (`pipeline_wire.encode_activations` / `encode_gradient` on a micro-batch of the run's shape):
   forward = the packed hidden state and its int32 label, backward = the packed gradient.
2. Held-out loss at equal tokens, in process: stage 0 and stage 1 of the model trained together
   (the real `DiLoCo` inner steps, `pipeline.remote_loss` and `stage_inner_step`), with the hidden
   state and its gradient passed through the codec's encode then decode at the boundary, against
   the same run passed through nothing (float32: "uncompressed"). Same θ₀, batches and schedule
   per seed; ≥ 2 seeds; held-out windows from shard 0, which no batch is drawn from.
3. The live wire: 2 stages × 2 replicas on loopback, threads of one process, each replica a real
   `PeerPlane` (own event loop, aiohttp server and client), wired as `neuroshard-node --stages 2`
   wires them, for each codec in --live-codecs. Traffic is counted at the HTTP layer (bodies,
   request/status lines, headers), bytes *sent* by each node: pipeline (a driver's hidden states,
   a stage-1 replica's gradients) and sync (everything else: the round's objects, statuses, peer
   lists). Synchronous data parallel over the same 2 data streams all-reduces the whole model's
   fp32 gradient every step, a ring all-reduce with n = 2 sending 2·(n−1)/n·4·d = 4·d bytes per node
   per step. Tokens/s is the drivers' trained tokens over the wall time of the run.
   With --live-relay each codec's live run is made twice, alternating: replicas with ports, then
   every replica behind NAT (`--relay`, no port: node.p2p.mailbox), the micro-batches and
   gradients carried by an S3 bucket (a moto server on loopback, so the bucket's latency is
   loopback's, not a real store's: the figure is the protocol's own cost, a lower bound).

Every run sets torch.set_num_threads(1): four replicas share the process (3), and the loss
comparison (2) must not depend on the machine's load.

    .venv/bin/python bench/bench_pipeline.py                # tiny model: all three, ~10 min on 1 core
    .venv/bin/python bench/bench_pipeline.py --live-codecs none --explore --json   # bytes and loss only
    .venv/bin/python bench/bench_pipeline.py --inner-steps 500 --rounds 1 --sim-steps 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import DEFAULT_TEXT, bench_dataset, parse_with_quick, quick_dataset
from torch import Tensor

from neuroshard.data.dataset import Dataset
from neuroshard.node import actcodec
from neuroshard.node.actcodec import CODECS, DEFAULT_CODEC, FORMATS, Codec, Format
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.p2p.auth import Traffic
from neuroshard.node.p2p.bucket import RelayConfig
from neuroshard.node.p2p.pipeline import PipelineConfig
from neuroshard.node.p2p.pipeline_wire import encode_activations, encode_gradient
from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig
from neuroshard.node.p2p.stages import PipelineLink
from neuroshard.node.pipeline import remote_loss, stage_inner_step
from neuroshard.node.stage_replica import StageReplica, start_stage_replica
from neuroshard.node.stage_worker import WorkerConfig
from neuroshard.node.trainer import Trainer, TrainerConfig
from neuroshard.node.wallet import Wallet
from neuroshard.verifier.evaluate import measure_loss

UNCOMPRESSED = "fp32"
"""The loss baseline: the hidden state and its gradient cross the boundary as they are."""
EXPLORE = {
    # Not wire codecs: how far bits can go down before the loss moves (measured, not offered).
    "h4/h4": Codec("h4/h4", FORMATS["h4"], FORMATS["h4"]),
    "h2/h4": Codec("h2/h4", Format("h2", 2, True), FORMATS["h4"]),
    # The mirror of the wire's hadamard43 (3 bits forward, 4 back): which direction takes 3 bits.
    "h3/h4": Codec("h3/h4", FORMATS["h3"], FORMATS["h4"]),
    # Codes fitted to each group (actcodec's m formats), in each direction, at 1-4 bits
    # (bench/RESULTS.md, issue 17: better forward at 2 bits, worse back at 3).
    "m2/h4": Codec("m2/h4", FORMATS["m2"], FORMATS["h4"]),
    "m4/h3": Codec("m4/h3", FORMATS["m4"], FORMATS["h3"]),
    "h4/m3": Codec("h4/m3", FORMATS["h4"], FORMATS["m3"]),
    "m4/m3": Codec("m4/m3", FORMATS["m4"], FORMATS["m3"]),
    "m3/h3": Codec("m3/h3", FORMATS["m3"], FORMATS["h3"]),
    "m3/m3": Codec("m3/m3", FORMATS["m3"], FORMATS["m3"]),
    # The neighbourhood of the 1/8 target: 0.147x and 0.116x of bf16's bytes.
    "m2/m2": Codec("m2/m2", FORMATS["m2"], FORMATS["m2"]),
    "m2/h2": Codec("m2/h2", FORMATS["m2"], Format("h2", 2, True)),
    "m2/m1": Codec("m2/m1", FORMATS["m2"], FORMATS["m1"]),
    # Dithered codes (actcodec's d formats): unbiased, with every level used.
    "h4/d3": Codec("h4/d3", FORMATS["h4"], FORMATS["d3"]),
    "d4/d3": Codec("d4/d3", FORMATS["d4"], FORMATS["d3"]),
    "m4/d3": Codec("m4/d3", FORMATS["m4"], FORMATS["d3"]),  # the wire's fitted43
    "h4/d2": Codec("h4/d2", FORMATS["h4"], FORMATS["d2"]),
    "m2/d2": Codec("m2/d2", FORMATS["m2"], FORMATS["d2"]),
    "h4/d1": Codec("h4/d1", FORMATS["h4"], FORMATS["d1"]),
    "m2/d1": Codec("m2/d1", FORMATS["m2"], FORMATS["d1"]),
    # Spending the bits forward: 5-bit activations with 2-bit dithered gradients (0.240x).
    "h5/d2": Codec("h5/d2", Format("h5", 5, True), FORMATS["d2"]),
}
EVAL_BATCHES = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seeds", type=int, default=2, help="seeds of the loss comparison (θ₀ and batches)")
    p.add_argument("--first-seed", type=int, default=0, help="the loss runs use seeds first, first + 1, ...")
    p.add_argument("--sim-steps", type=int, default=200, help="inner steps per loss run (0: skip it)")
    p.add_argument(
        "--explore", action="store_true", help=f"also measure {', '.join(EXPLORE)} (not wire codecs)"
    )
    p.add_argument(
        "--sim-codecs",
        default="all",
        help="comma list of the codecs the loss runs compare with fp32, 'all', or 'none'",
    )
    p.add_argument(
        "--runs-cache",
        type=Path,
        default=None,
        help="JSON file of finished loss runs, shared between invocations",
    )
    p.add_argument(
        "--bottleneck-ranks",
        type=lambda v: [int(r) for r in v.split(",") if r],
        default=[],
        help="comma list of ranks r: loss runs with a trained rank-r cut of the residual stream at the "
        "boundary (a model-side change, not offered: measured), its r values sent in --bottleneck-codec",
    )
    p.add_argument("--bottleneck-codec", default="bf16", choices=sorted(CODECS))
    p.add_argument("--live-codecs", default="bf16,int8,hadamard4", help="comma list, or 'none'")
    p.add_argument("--inner-steps", type=int, default=50, help="H of the live run")
    p.add_argument("--rounds", type=int, default=3, help="outer rounds of the live run")
    p.add_argument("--encoding", default="int8", choices=["int8", "fp16"], help="Δ encoding of the sync")
    p.add_argument(
        "--live-relay", action="store_true",
        help="also run each live codec with every replica behind NAT, through a moto S3 bucket",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object, last line")
    args = parse_with_quick(
        p,
        model="micro",
        inner_steps=4,
        rounds=1,
        batch_size=2,
        seq_len=32,
        sim_steps=6,
        live_codecs=DEFAULT_CODEC,
    )
    torch.set_num_threads(1)

    dataset = quick_dataset() if args.quick else bench_dataset(DEFAULT_TEXT)
    print(f"text: {'the quick text' if args.quick else DEFAULT_TEXT}")
    model = ModelConfig.named(args.model, vocab_size=dataset.tokenizer.vocab_size)
    codecs: dict[str, Codec] = {**CODECS, **(EXPLORE if args.explore else {})}
    summary: dict[str, Any] = {"model": args.model, "micro_batch": [args.batch_size, args.seq_len]}

    summary["bytes"] = bytes_table(model, args, codecs)
    if args.sim_steps > 0:
        summary["held_out"] = loss_table(model, args, codecs, dataset)
    live = [c for c in args.live_codecs.split(",") if c and c != "none"]
    if live:
        relay = _moto_bucket() if args.live_relay else None
        summary["live"] = {}
        for name in live:
            summary["live"][name] = live_run(model, args, dataset, name)
            if relay is not None:
                summary["live"][f"{name} (bucket)"] = live_run(model, args, dataset, name, relay)
        live_table(summary["live"])

    default = summary["bytes"][DEFAULT_CODEC]
    record = {
        "codec": DEFAULT_CODEC,
        "bytes_per_token_forward": default["forward"],
        "bytes_per_token_backward": default["backward"],
        "bf16_bytes_per_token": summary["bytes"]["bf16"]["forward"],
        "bf16_bytes_per_token_backward": summary["bytes"]["bf16"]["backward"],
        **summary,
    }
    if args.json:
        print(json.dumps(record, sort_keys=True))


# --- 1. bytes per token -----------------------------------------------------------------------


def bytes_table(model: ModelConfig, args: argparse.Namespace, codecs: dict[str, Codec]) -> dict[str, Any]:
    """Bytes per token per boundary from encoded bodies of one (B, T, C) micro-batch (safetensors
    header included, amortised over its B·T tokens); the explored formats by their arithmetic."""
    b, t, c = args.batch_size, args.seq_len, model.dim
    g = torch.Generator().manual_seed(0)
    hidden, grad = torch.randn(b, t, c, generator=g), torch.randn(b, t, c, generator=g) * 1e-4
    labels = torch.randint(0, model.vocab_size, (b, t), generator=g)
    rows: dict[str, Any] = {}
    for name, codec in codecs.items():
        if name in CODECS:
            fwd = len(encode_activations(hidden, labels, name)) / (b * t)
            back = len(encode_gradient(grad, name)) / (b * t)
        else:
            fwd, back = codec.forward.bytes_per_row(c) + 4.0, float(codec.backward.bytes_per_row(c))
        rows[name] = {
            "forward": round(fwd, 2),
            "backward": round(back, 2),
            "codec_ms": _codec_ms(codec, hidden, grad),
        }
    for r in args.bottleneck_ranks:  # r values per token cross the wire instead of C
        name = args.bottleneck_codec
        small_h, small_g = hidden[..., :r].contiguous(), grad[..., :r].contiguous()
        rows[f"r{r}+{name}"] = {
            "forward": round(len(encode_activations(small_h, labels, name)) / (b * t), 2),
            "backward": round(len(encode_gradient(small_g, name)) / (b * t), 2),
            "codec_ms": _codec_ms(CODECS[name], small_h, small_g),
        }
    bf16 = rows["bf16"]["forward"] + rows["bf16"]["backward"]
    print(
        f"\nbytes per token per boundary ({args.model}, C = {c}, micro-batch {b}x{t}, labels int32); codec ms:"
    )
    print("encode + decode of one micro-batch's hidden state and gradient, 1 thread, best of 5")
    print(
        f"{'codec':<11} {'bits fwd/back':>14} {'forward':>9} {'backward':>9} {'both':>8} {'/ bf16':>7} {'codec ms':>9}"
    )
    for name, row in rows.items():
        both = row["forward"] + row["backward"]
        row["ratio_to_bf16"] = round(both / bf16, 4)
        if name in codecs:
            f, k = codecs[name].forward, codecs[name].backward
            bits = f"{_bits(f, c):.2f}/{_bits(k, c):.2f}"
        else:  # a bottleneck: bits per value of the full width C it stands for
            bits = f"{8 * (row['forward'] - 4) / c:.2f}/{8 * row['backward'] / c:.2f}"
        print(
            f"{name:<11} {bits:>14} {row['forward']:>9.1f} {row['backward']:>9.1f} {both:>8.1f} {both / bf16:>7.3f} "
            f"{row['codec_ms']:>9.2f}"
        )
    return rows


def _codec_ms(codec: Codec, hidden: Tensor, grad: Tensor) -> float:
    """What the codec costs the two stages of a boundary per micro-batch: both directions encoded
    and decoded (the CPU work a live run adds; its tokens/s on a shared machine is too noisy to show it)."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        actcodec.round_trip(hidden, codec.forward)
        actcodec.round_trip(grad, codec.backward)
        best = min(best, time.perf_counter() - started)
    return round(1000 * best, 3)


def _bits(fmt: Format, dim: int) -> float:
    return 8 * fmt.bytes_per_row(dim) / dim


# --- 2. held-out loss at equal tokens ---------------------------------------------------------


@dataclass
class Tokens:
    train: Tensor
    held_out: Tensor


def _tokens(dataset: Dataset) -> Tokens:
    """Shard 0 held out (as the verifier holds it out), every other shard to train on."""
    shards = [dataset.source.fetch(info).long() for info in dataset.manifest.shards]
    return Tokens(train=torch.cat(shards[1:]), held_out=shards[0])


def _batch(tokens: Tensor, seed: int, step: int, b: int, t: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - t - 1, (b,), generator=g)
    rows = tokens[starts[:, None] + torch.arange(t + 1)]  # (B, T + 1)
    return rows[:, :-1], rows[:, 1:]


def _bottleneck(cfg: ModelConfig, rank: int) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """A rank-`rank` cut of the residual stream at the boundary: stage 0 ends with down (C -> r),
    stage 1 starts with up (r -> C). Both start from one seeded orthonormal basis Q (C, r), down =
    Qᵀ and up = Q, so the pair starts as a projection onto r directions; both train."""
    g = torch.Generator().manual_seed(cfg.init_seed + 7)
    q, _ = torch.linalg.qr(torch.randn(cfg.dim, rank, generator=g))
    down, up = torch.nn.Linear(cfg.dim, rank, bias=False), torch.nn.Linear(rank, cfg.dim, bias=False)
    with torch.no_grad():
        down.weight.copy_(q.T)
        up.weight.copy_(q)
    return down, up


def train_pipeline(
    model: ModelConfig,
    codec: Codec | None,
    tokens: Tokens,
    seed: int,
    steps: int,
    b: int,
    t: int,
    rank: int | None = None,
) -> float:
    """Stages 0 and 1 trained for `steps` inner steps with `codec` at the boundary (None: float32
    as is), through a rank-`rank` bottleneck when given; returns the held-out loss of the two
    stages assembled."""
    cfg = ModelConfig(**{**model.to_dict(), "init_seed": seed})
    diloco = DiLoCoConfig(inner_steps=steps, warmup_steps=min(20, steps), total_steps=steps)
    stage0, stage1 = build_stage(cfg, 0, 2), build_stage(cfg, 1, 2)
    if rank is not None:
        down, up = _bottleneck(cfg, rank)
        stage0, stage1 = torch.nn.Sequential(stage0, down), torch.nn.Sequential(up, stage1)  # type: ignore[assignment]
    last = DiLoCo(stage1, diloco)

    def downstream(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        if codec is not None:
            hidden = actcodec.round_trip(hidden, codec.forward)  # what decode_activations returns
        grad, loss = stage_inner_step(last, hidden, labels, None)
        return (grad if codec is None else actcodec.round_trip(grad, codec.backward)), loss

    first = DiLoCo(stage0, diloco, loss_fn=remote_loss(downstream))
    for step in range(steps):
        first.inner_step(*_batch(tokens.train, seed, step, b, t))
    return measure_loss([first.model, last.model], tokens.held_out, b, t, max_batches=EVAL_BATCHES).loss


def loss_table(
    model: ModelConfig, args: argparse.Namespace, codecs: dict[str, Codec], dataset: Dataset
) -> dict[str, Any]:
    tokens = _tokens(dataset)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    runs: dict[str, list[float]] = {}
    started = time.perf_counter()
    # fp16 is a cast like bf16 with 3 more mantissa bits: nothing to learn from it here.
    wanted = [n for n in codecs if n != "fp16"] if args.sim_codecs == "all" else args.sim_codecs.split(",")
    wanted = [n for n in wanted if n and n != "none"]
    cache: dict[str, float] = {}
    if args.runs_cache is not None and args.runs_cache.exists():
        cache = json.loads(args.runs_cache.read_text())
    plan: list[tuple[str, Codec | None, int | None]] = [(UNCOMPRESSED, None, None)]
    plan += [(name, codecs[name], None) for name in wanted]
    plan += [
        (f"r{r}+{args.bottleneck_codec}", CODECS[args.bottleneck_codec], r) for r in args.bottleneck_ranks
    ]
    for name, codec, rank in plan:
        runs[name] = []
        for seed in seeds:
            # Everything that decides a run's loss (the text is the bench's one text).
            key = f"{args.model}/{name}/seed{seed}/steps{args.sim_steps}/{args.batch_size}x{args.seq_len}"
            if key not in cache:
                cache[key] = train_pipeline(
                    model, codec, tokens, seed, args.sim_steps, args.batch_size, args.seq_len, rank
                )
                if args.runs_cache is not None:
                    args.runs_cache.write_text(json.dumps(cache, indent=1, sort_keys=True))
            runs[name].append(cache[key])
            print(
                f"  {name} seed {seed}: {runs[name][-1]:.4f} ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    base = runs[UNCOMPRESSED]
    print(
        f"\nheld-out loss after {args.sim_steps} inner steps of {args.batch_size}x{args.seq_len} tokens, "
        f"2 stages in process, seeds {list(seeds)} ({time.perf_counter() - started:.0f} s):"
    )
    print(f"{'codec':<11} {'loss per seed':>24} {'mean':>8} {'Δ nats':>8} {'worst Δ':>8} {'Δ %':>7}")
    rows: dict[str, Any] = {}
    for name, losses in runs.items():
        deltas = [x - y for x, y in zip(losses, base, strict=True)]
        mean, delta = statistics.mean(losses), statistics.mean(deltas)
        worst = max(deltas, key=abs)
        rows[name] = {
            "loss": [round(x, 5) for x in losses],
            "mean": round(mean, 5),
            "delta_nats": round(delta, 5),
            "worst_delta_nats": round(worst, 5),
            "delta_percent": round(100 * delta / statistics.mean(base), 3),
        }
        per_seed = " ".join(f"{x:.4f}" for x in losses)
        print(
            f"{name:<11} {per_seed:>24} {mean:>8.4f} {delta:>+8.4f} {worst:>+8.4f} "
            f"{rows[name]['delta_percent']:>+6.2f}%"
        )
    return rows


# --- 3. the live wire -------------------------------------------------------------------------


def _net(encoding: str, peers: tuple[str, ...], relay: RelayConfig | None = None) -> PeerPlaneConfig:
    return PeerPlaneConfig(
        port=0,
        peers=peers,
        encoding=encoding,
        round_timeout_s=120.0,
        gossip_interval_s=0.5,
        join_timeout_s=3.0,
        relay=relay,
        listen=relay is None,
    )


def _moto_bucket() -> RelayConfig:
    """A fresh bucket on a moto S3 server on loopback (dummy credentials: it is ours alone)."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one access-log line per request otherwise
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        os.environ[name] = value
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench-pipeline")
    return RelayConfig(
        url="s3://bench-pipeline/run", endpoint_url=endpoint, poll_interval_s=0.05, max_poll_s=0.5
    )


def _sent(t: Traffic) -> int:
    return t.bytes_sent


def live_run(
    model: ModelConfig,
    args: argparse.Namespace,
    dataset: Dataset,
    codec: str,
    relay: RelayConfig | None = None,
) -> dict[str, Any]:
    """2 stages × 2 replicas on loopback with `codec` on the pipeline wire; bytes and tokens/s. With
    `relay`, every replica is behind NAT and the bucket carries everything (a prefix per run)."""
    if relay is not None:
        relay = dataclasses.replace(relay, url=f"{relay.url}-{codec}-{time.monotonic_ns()}")
    h, steps = args.inner_steps, args.inner_steps * args.rounds
    diloco = DiLoCoConfig(inner_steps=h, warmup_steps=min(20, h), total_steps=max(steps, 1000))
    # No audits: the stage-1 replicas stop after a fixed count of steps, which audit copies would use
    # up before the drivers' last micro-batches, and this measures the codec's bytes and speed alone.
    pipe = PipelineConfig(
        num_stages=2, codec=codec, max_batch=args.batch_size, audit_rate=0.0, probation_audit_rate=0.0
    )
    stops: list[threading.Event] = []
    stage1: list[StageReplica] = []
    for i in range(2):
        stop = threading.Event()
        stops.append(stop)
        boot = (stage1[0].network.address,) if stage1 and relay is None else ()
        stage1.append(
            start_stage_replica(
                wallet=Wallet.from_token(f"bench-pipeline-s1-{i}"), stage=1, model_config=model,
                diloco_config=diloco, network_config=_net(args.encoding, boot, relay), pipeline_config=pipe,
                worker_config=WorkerConfig(max_steps=steps, log_every=10**6), stop=stop, log=lambda line: None,
            )
        )  # fmt: skip
    boot = (stage1[0].network.address,) if relay is None else ()
    drivers: list[tuple[Trainer, PeerPlane, PipelineLink]] = []
    with tempfile.TemporaryDirectory() as ckpt:
        for i in range(2):
            stop = threading.Event()
            stops.append(stop)
            drivers.append(_driver(i, args, model, diloco, pipe, dataset, boot, Path(ckpt), stop, relay))
        for trainer, network, _ in drivers:
            network.join_state(trainer.diloco)
        while any(len(n.node.peers.live(time.time(), 1)) < 2 for _, n, _ in drivers):
            time.sleep(0.1)
        threads = [threading.Thread(target=s.worker.run, args=(stops[i],)) for i, s in enumerate(stage1)]
        results: list[list[float]] = []
        started = time.perf_counter()

        def drive(trainer: Trainer, stop: threading.Event) -> None:
            results.append(trainer.run(stop).losses)

        threads += [
            threading.Thread(target=drive, args=(t, stops[2 + i])) for i, (t, _, _) in enumerate(drivers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started

        # Behind NAT the bucket's bytes are the client's (PeerPlane.traffic), the pipeline's among
        # them, and a stage-1 replica's server is its loopback one (the pipeline again, off the wire).
        rows = []
        for i, (_, network, link) in enumerate(drivers):
            client, server = network.traffic()
            pipeline = _sent(link.client.traffic)
            sync = _sent(client) + _sent(server) - (pipeline if relay is not None else 0)
            rows.append((f"stage 0 replica {i}", pipeline, sync))
        for i, s in enumerate(stage1):
            client, server = s.network.traffic()
            pipeline = s.service.traffic.bytes_sent
            served = _sent(server) if relay is None else 0  # behind NAT: the loopback server's
            rows.append((f"stage 1 replica {i}", pipeline, _sent(client) + served - pipeline))
        hashes = [{t.diloco.weights_hash() for t, _, _ in drivers}, {s.diloco.weights_hash() for s in stage1}]
        for (_, network, link), stop in zip(drivers, stops[2:], strict=True):
            stop.set()
            link.close()
            network.stop()
        for s, stop in zip(stage1, stops[:2], strict=True):
            stop.set()
            s.close()

    d = model.num_params()
    dp = 4 * d * h  # ring all-reduce, n = 2 data streams, per node per round
    tokens = 2 * steps * args.batch_size * args.seq_len
    first = statistics.mean(x for ls in results for x in ls[:h])
    last = statistics.mean(x for ls in results for x in ls[-h:])
    print(
        f"\nlive, codec {codec}: {args.model} model, d = {d:,}; 2 stages x 2 replicas; H={h}, {args.rounds} rounds, "
        f"micro-batch {args.batch_size}x{args.seq_len}, Δ {args.encoding}; loss {first:.3f} -> {last:.3f}; "
        f"wall {wall:.1f} s, {tokens / wall:,.0f} tokens/s; stages agree: {[len(x) == 1 for x in hashes]}"
    )
    print(
        f"{'node':<18} {'pipeline MB/round':>18} {'sync MB/round':>14} {'DP MB/round':>12} {'DP / ours':>10}"
    )
    for name, pipeline, sync in rows:
        per_round_p, per_round_s = pipeline / args.rounds, sync / args.rounds
        ratio = dp / (per_round_p + per_round_s)
        print(
            f"{name:<18} {per_round_p / 1e6:>18.3f} {per_round_s / 1e6:>14.3f} {dp / 1e6:>12.1f} {ratio:>10.1f}"
        )
    # Pipeline bytes grow with the steps, sync bytes with the rounds: scale each to H=500.
    pipe_step = statistics.mean(r[1] for r in rows) / steps
    sync_round = statistics.mean(r[2] for r in rows) / args.rounds
    ours_500 = 500 * pipe_step + sync_round
    print(
        f"at H=500: per node per round pipeline {500 * pipe_step / 1e6:.1f} MB + sync {sync_round / 1e6:.2f} MB; "
        f"DP {4 * d * 500 / 1e6:.0f} MB; DP/ours {4 * d * 500 / ours_500:.1f}x"
    )
    return {
        "tokens_per_s": round(tokens / wall, 1),
        "wall_s": round(wall, 2),
        "stages_agree": all(len(x) == 1 for x in hashes),
        "pipeline_bytes_per_token_wire": round(pipe_step / (args.batch_size * args.seq_len), 2),
        "pipeline_mb_per_node_round_h500": round(500 * pipe_step / 1e6, 3),
        "sync_mb_per_node_round": round(sync_round / 1e6, 4),
        "dp_over_ours_h500": round(4 * d * 500 / ours_500, 2),
    }


def live_table(live: dict[str, Any]) -> None:
    print("\nlive runs side by side (bytes per token: HTTP bytes sent per node per micro-batch token):")
    print(f"{'codec':<20} {'tokens/s':>9} {'wire B/token':>13} {'MB/node/round @H=500':>21} {'DP/ours':>8}")
    for name, row in live.items():
        print(
            f"{name:<20} {row['tokens_per_s']:>9,.0f} {row['pipeline_bytes_per_token_wire']:>13.1f} "
            f"{row['pipeline_mb_per_node_round_h500'] + row['sync_mb_per_node_round']:>21.2f} "
            f"{row['dp_over_ours_h500']:>8.1f}"
        )


def _driver(  # type: ignore[no-untyped-def]
    i: int,
    args: argparse.Namespace,
    model: ModelConfig,
    diloco: DiLoCoConfig,
    pipe: PipelineConfig,
    dataset,
    boot: tuple[str, ...],
    ckpt: Path,
    stop: threading.Event,
    relay: RelayConfig | None = None,
) -> tuple[Trainer, PeerPlane, PipelineLink]:
    """A stage-0 replica as `neuroshard-node --stages 2 --stage 0` builds it."""
    wallet = Wallet.from_token(f"bench-pipeline-s0-{i}")
    network = PeerPlane(
        _net(args.encoding, boot, relay),
        wallet,
        0,
        lambda line: None,
        stop=stop,
    )
    network.start()
    holder: list[Trainer] = []
    link = PipelineLink(
        network, pipe, stop=stop, round_of=lambda: holder[0].diloco.round,
        step_of=lambda: holder[0].diloco.step, log=print,
    )  # fmt: skip
    link.start()
    trainer = Trainer(
        wallet_id=wallet.wallet_id, dataset=dataset, model_config=model, diloco_config=diloco,
        config=TrainerConfig(batch_size=args.batch_size, seq_len=args.seq_len, max_steps=args.inner_steps * args.rounds,
                             checkpoint_every=10**6, log_every=10**6),
        checkpoint_dir=ckpt / str(i), log=lambda line: None,
        finish_round=network.finish_round, num_stages=2, loss_fn=remote_loss(link.downstream, link.blame_driven),
    )  # fmt: skip
    holder.append(trainer)
    return trainer, network, link


if __name__ == "__main__":
    main()
