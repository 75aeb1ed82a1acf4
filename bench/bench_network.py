"""Peer network: sync traffic per round against synchronous data parallel, and outer-round latency,
for several stage sizes (the partitioned round: a node's bytes should not grow with n).

Replicas are real `PeerPlane`s on loopback — each in its own process with its own event
loop, aiohttp server, client and sockets — around real DiLoCo engines of one stage.
Training is not what is measured: before each round every replica moves its weights by a
seeded random step (a stand-in for H inner steps), then all replicas call `finish_round`
at once and we time that call: commit, scatter, reduce the owned part, gather, check,
digests, outer step, publish, hash vote.

Traffic is counted at the HTTP layer (bodies, request/status lines and headers; TCP/IP
framing not counted), summed over what a node's client sent and what its server answered.
Synchronous data parallel for the same tokens all-reduces an fp32 gradient every inner
step; a ring all-reduce (reduce-scatter + all-gather) sends 2·(n−1)/n · 4·d bytes per node
per step, ≈ 8·d for large n. Per round of H steps that is H times as much.

The int8 error is measured on a real pseudo-gradient: the tiny model trained for one round
of H_real inner steps on the bench text.

    .venv/bin/python bench/bench_network.py --model tiny --replicas 4,8,16,24 --json
    .venv/bin/python bench/bench_network.py --quick        # CI: tiny model, n = 3, 2 rounds
    .venv/bin/python bench/bench_network.py --transport s3 --replicas 4,8 --json

`--transport s3`: every replica opens no port (`--relay`, behind NAT) and takes part through
a moto S3 server on loopback; a node's bytes are then the bodies of its PUTs and GETs (boto3's
request heads are not counted).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from common import DEFAULT_TEXT, bench_dataset

from neuroshard.node.codec import encode_delta, int8_relative_error
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.p2p.bucket import RelayConfig
from neuroshard.node.p2p.plane import PeerPlane, PeerPlaneConfig
from neuroshard.node.trainer import Trainer, TrainerConfig
from neuroshard.node.wallet import Wallet


def real_pseudo_gradient(steps: int) -> torch.Tensor:
    """Δ of the tiny model after one round of `steps` AdamW steps on the bench text."""
    # Its own shard size, hence its own cache directory: older caches may hold a manifest format
    # the current reader refuses.
    dataset = bench_dataset(DEFAULT_TEXT, shard_tokens=200_000)
    captured: list[torch.Tensor] = []

    def capture(diloco: DiLoCo) -> None:
        captured.append(diloco.pseudo_gradient())
        diloco.outer_step(captured[-1])

    with tempfile.TemporaryDirectory() as ckpt:
        trainer = Trainer(
            wallet_id="bench-network",
            dataset=dataset,
            model_config=ModelConfig.named("tiny", vocab_size=dataset.tokenizer.vocab_size),
            diloco_config=DiLoCoConfig(inner_steps=steps, warmup_steps=10, total_steps=10 * steps),
            config=TrainerConfig(
                batch_size=8, seq_len=128, max_steps=steps, checkpoint_every=10**6, log_every=10**6
            ),
            checkpoint_dir=Path(ckpt),
            log=lambda line: None,
            finish_round=capture,
        )
        trainer.run(threading.Event())
    return captured[0]


@torch.no_grad()
def fake_inner_steps(diloco: DiLoCo, seed: int, h: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in diloco.params:
        p.add_(torch.randn(p.shape, generator=generator) * 1e-3)
    diloco.steps_in_round = h


def replica_process(
    index: int, args: argparse.Namespace, bootstrap: str | None, conn: Connection, replicas: int
) -> None:
    """One replica in its own process, as on a real network: its own interpreter, heap and loop."""
    torch.set_num_threads(args.threads)
    relay = None
    if args.transport == "s3":
        relay = RelayConfig(
            url=args.bucket_url, endpoint_url=args.endpoint, poll_interval_s=0.05, max_poll_s=0.5
        )
    config = PeerPlaneConfig(
        port=0,
        peers=(bootstrap,) if bootstrap and relay is None else (),
        encoding=args.encoding,
        round_timeout_s=600.0,
        # The production gossip interval and fanout: peer-list swaps during a round are part of
        # what a node pays per round (with 0.5 s they were most of the bytes at n = 24).
        hash_check_timeout_s=120.0,
        relay=relay,
        listen=relay is None,
    )
    network = PeerPlane(config, Wallet.from_token(f"bench-network-{index}"), 0, lambda line: None)
    conn.send(network.start())
    model_cfg = ModelConfig.named(args.model, vocab_size=args.vocab)
    diloco = DiLoCo(build_stage(model_cfg, 0, 1), DiLoCoConfig(inner_steps=args.inner_steps, warmup_steps=1))
    network.join_state(diloco)
    while len(network.live_peers()) < replicas - 1:
        time.sleep(0.1)
    conn.send("ready")
    try:
        while (command := conn.recv()) != "stop":
            fake_inner_steps(diloco, seed=1000 * command + index, h=args.inner_steps)
            client, server = network.traffic()
            conn.send("prepared")
            conn.recv()  # "go": every replica enters finish_round at the same moment
            start = time.perf_counter()
            network.finish_round(diloco)
            seconds = time.perf_counter() - start
            client2, server2 = network.traffic()
            sent = client2.bytes_sent + server2.bytes_sent - client.bytes_sent - server.bytes_sent
            received = (
                client2.bytes_received
                + server2.bytes_received
                - client.bytes_received
                - server.bytes_received
            )
            messages = client2.requests - client.requests
            conn.send((seconds, sent, diloco.weights_hash(), network.reports[-1], received, messages))
    finally:
        network.stop()


def measure(n: int, args: argparse.Namespace) -> dict[str, float]:
    """Start n replica processes, run the rounds, return this stage size's figures."""
    h = args.inner_steps
    model_cfg = ModelConfig.named(args.model, vocab_size=args.vocab)
    d = model_cfg.num_params()
    payload = len(encode_delta(torch.zeros(d), args.encoding))
    ctx = multiprocessing.get_context("spawn")
    conns, procs = [], []
    bootstrap = None
    for i in range(n):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=replica_process, args=(i, args, bootstrap, child, n), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
        address = parent.recv()
        bootstrap = bootstrap or address
    for conn in conns:
        assert conn.recv() == "ready"
    latencies: list[float] = []
    sent: list[int] = []
    received: list[int] = []
    messages: list[int] = []
    try:
        for r in range(args.rounds + 1):  # round 0 warms up: first connections, first allocations
            for conn in conns:
                conn.send(r)
            for conn in conns:
                assert conn.recv() == "prepared"
            for conn in conns:
                conn.send("go")
            results = [conn.recv() for conn in conns]
            hashes = {result[2] for result in results}
            if len(hashes) != 1 or any(len(result[3].accepted) != n for result in results):
                raise RuntimeError(f"round {r} did not agree: {[result[3].line() for result in results]}")
            seconds = [result[0] for result in results]
            phases = results[0][3]
            print(
                f"n={n} round {r}{' (warm-up)' if r == 0 else ''}: finish_round {min(seconds):.2f}-{max(seconds):.2f} s "
                f"(replica 0: exchange {phases.exchange_s:.2f}, step {phases.step_s:.2f}, vote {phases.vote_s:.2f}); "
                f"per node: sent {statistics.mean(x[1] for x in results) / 1e6:.2f} MB, "
                f"received {statistics.mean(x[4] for x in results) / 1e6:.2f} MB, "
                f"{statistics.mean(x[5] for x in results):.0f} requests",
                flush=True,
            )
            if r > 0:
                latencies += seconds
                sent += [x[1] for x in results]
                received += [x[4] for x in results]
                messages += [x[5] for x in results]
    finally:
        for conn in conns:
            conn.send("stop")
        for proc in procs:
            proc.join(timeout=30)
    ours = statistics.median(sent)
    ring = 2 * (n - 1) / n * 4 * d * h
    return {
        "replicas": n,
        "params": d,
        "payload_bytes": payload,
        "bytes_sent_per_node": ours,
        "bytes_received_per_node": statistics.median(received),
        "messages_per_node": statistics.median(messages),
        "round_seconds_median": statistics.median(latencies),
        "round_seconds_max": max(latencies),
        "dp_ratio_h500": 2 * (n - 1) / n * 4 * d * 500 / ours,
        f"dp_ratio_h{h}": ring / ours,
    }


def start_bucket(args: argparse.Namespace) -> object:
    """A moto S3 server on loopback with bucket "bench"; dummy credentials in the environment
    (the spawned replicas inherit it). Sets args.endpoint."""
    import logging
    import os

    import boto3
    from moto.server import ThreadedMotoServer

    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true")):  # fmt: skip
        os.environ[name] = value
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    args.endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=args.endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
    return server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="4", help="stage sizes to measure, comma-separated (e.g. 4,8,16,24)")
    p.add_argument(
        "--rounds", type=int, default=3, help="timed rounds per stage size (after one warm-up round)"
    )
    p.add_argument("--model", default="tiny", help="named model size of the stage")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--encoding", default="int8", choices=["int8", "fp16"])
    p.add_argument("--inner-steps", type=int, default=500, help="H for the data-parallel comparison")
    p.add_argument(
        "--real-delta-steps", type=int, default=0, help="H of a real Δ to measure the int8 error on (0: skip)"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (the replicas share this machine's cores)"
    )
    p.add_argument(
        "--transport",
        choices=["http", "s3"],
        default="http",
        help="s3: every replica behind NAT, through a moto bucket",
    )
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object, last line")
    p.add_argument("--quick", action="store_true", help="CI: tiny model, 3 replicas, 1 timed round")
    args = p.parse_args()
    if args.quick:
        args.replicas, args.rounds, args.model = "3", 1, "tiny"
    torch.set_num_threads(args.threads)

    if args.real_delta_steps:
        delta = real_pseudo_gradient(args.real_delta_steps)
        print(
            f"int8 relative L2 error on a real Δ (tiny model, {delta.numel():,} values, H={args.real_delta_steps}): "
            f"{int8_relative_error(delta):.5f}"
        )
    sizes = [int(x) for x in args.replicas.split(",") if x.strip()]
    server = None
    if args.transport == "s3":
        server = start_bucket(args)
    try:
        rows = []
        for n in sizes:
            if server is not None:
                args.bucket_url = f"s3://bench/n{n}-{time.monotonic_ns()}"
            rows.append(measure(n, args))
    finally:
        if server is not None:
            server.stop()
    d, payload = rows[0]["params"], rows[0]["payload_bytes"]
    print()
    print(f"stage: {args.model} model, d = {d:,} parameters; Δ {args.encoding} payload {payload / 1e6:.2f} MB; "
          f"loopback ({args.transport}), one process per replica, {args.threads} torch thread(s) each")  # fmt: skip
    print(f"{'n':>4} {'sent/node MB':>13} {'recv/node MB':>13} {'requests/node':>14} {'round s (median)':>17} "
          f"{'vs n=' + str(sizes[0]):>8} {'DP ratio H=500':>15}")  # fmt: skip
    for row in rows:
        print(
            f"{row['replicas']:>4} {row['bytes_sent_per_node'] / 1e6:>13.2f} {row['bytes_received_per_node'] / 1e6:>13.2f} "
            f"{row['messages_per_node']:>14.0f} {row['round_seconds_median']:>17.2f} "
            f"{row['bytes_sent_per_node'] / rows[0]['bytes_sent_per_node']:>7.2f}x {row['dp_ratio_h500']:>14,.0f}x"
        )
    print(
        "DP ratio: a ring all-reduce of fp32 gradients, 2(n-1)/n * 4d bytes sent per node per step, x 500 steps,"
    )
    print(
        "over the bytes a node sends per round here (its parts to their owners, its aggregate to every replica, checks)."
    )
    if args.json:
        print(json.dumps({"model": args.model, "encoding": args.encoding, "transport": args.transport, "rows": rows,
                          **{k: rows[-1][k] for k in ("replicas", "bytes_sent_per_node", "bytes_received_per_node",
                                                      "round_seconds_median", "dp_ratio_h500")}}))  # fmt: skip


if __name__ == "__main__":
    main()
