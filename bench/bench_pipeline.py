"""Pipeline stages: bytes per node per round, pipeline (activations, gradients) and sync (Δ
exchange) counted separately, against what synchronous data parallel sends for the same tokens.

2 stages × 2 replicas on loopback, threads of one process, each replica a real `PeerNetwork`
(own event loop, aiohttp server and client), wired as `neuroshard-node --stages 2` wires them:
stage-0 `Trainer`s with a remote loss read the bench text and drive; stage-1 replicas
(`start_stage_replica`) hold the head. Real training, H inner steps per round.

Traffic is counted at the HTTP layer (bodies, request/status lines, headers), bytes *sent*
by each node (its client's requests plus its server's replies), as in bench_network.py:

- pipeline, driver: the hidden states it sent (client); stage 1: the gradients it answered.
- sync: everything else the node sent (the round's objects served and fetched, statuses, peer lists).

Synchronous data parallel over the same 2 data streams all-reduces the whole model's fp32
gradient every step; a ring all-reduce with n = 2 sends 2·(n−1)/n·4·d = 4·d bytes per node
per step.

    .venv/bin/python bench/bench_pipeline.py                     # tiny model, H=50, 3 rounds
    .venv/bin/python bench/bench_pipeline.py --inner-steps 500 --rounds 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from common import DEFAULT_TEXT, bench_dataset, parse_with_quick, quick_dataset

from neuroshard.node.diloco import DiLoCoConfig
from neuroshard.node.model import ModelConfig
from neuroshard.node.p2p.auth import Traffic
from neuroshard.node.p2p.network import NetworkConfig, PeerNetwork
from neuroshard.node.p2p.pipeline import PipelineConfig
from neuroshard.node.p2p.stages import PipelineLink, StageReplica, start_stage_replica
from neuroshard.node.pipeline import remote_loss
from neuroshard.node.stage_worker import WorkerConfig
from neuroshard.node.trainer import Trainer, TrainerConfig
from neuroshard.node.wallet import Wallet


def _net(encoding: str, peers: tuple[str, ...]) -> NetworkConfig:
    return NetworkConfig(
        port=0,
        peers=peers,
        encoding=encoding,
        round_timeout_s=120.0,
        gossip_interval_s=0.5,
        join_timeout_s=3.0,
    )


def _sent(t: Traffic) -> int:
    return t.bytes_sent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--encoding", default="int8", choices=["int8", "fp16"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = parse_with_quick(p, model="micro", inner_steps=4, rounds=1, batch_size=2, seq_len=32)
    torch.set_num_threads(1)  # four replicas share this process; one intra-op thread each

    dataset = quick_dataset() if args.quick else bench_dataset(DEFAULT_TEXT)
    print(f"text: {'the quick text' if args.quick else DEFAULT_TEXT}")
    model = ModelConfig.named(args.model, vocab_size=dataset.tokenizer.vocab_size)
    h, steps = args.inner_steps, args.inner_steps * args.rounds
    diloco = DiLoCoConfig(inner_steps=h, warmup_steps=min(20, h), total_steps=max(steps, 1000))
    pipe = PipelineConfig(num_stages=2, dtype=args.dtype, max_batch=args.batch_size)
    stops: list[threading.Event] = []
    stage1: list[StageReplica] = []
    for i in range(2):
        stop = threading.Event()
        stops.append(stop)
        boot = (stage1[0].network.address,) if stage1 else ()
        stage1.append(
            start_stage_replica(
                wallet=Wallet.from_token(f"bench-pipeline-s1-{i}"), stage=1, model_config=model,
                diloco_config=diloco, network_config=_net(args.encoding, boot), pipeline_config=pipe,
                worker_config=WorkerConfig(max_steps=steps, log_every=10**6), stop=stop, log=lambda line: None,
            )
        )  # fmt: skip
    boot = (stage1[0].network.address,)
    drivers: list[tuple[Trainer, PeerNetwork, PipelineLink]] = []
    with tempfile.TemporaryDirectory() as ckpt:
        for i in range(2):
            stop = threading.Event()
            stops.append(stop)
            drivers.append(_driver(i, args, model, diloco, pipe, dataset, boot, Path(ckpt), stop))
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

        rows = []
        for i, (_, network, link) in enumerate(drivers):
            client, server = network.traffic()
            rows.append((f"stage 0 replica {i}", _sent(link.client.traffic), _sent(client) + _sent(server)))
        for i, s in enumerate(stage1):
            client, server = s.network.traffic()
            pipeline = s.service.traffic.bytes_sent
            rows.append((f"stage 1 replica {i}", pipeline, _sent(client) + _sent(server) - pipeline))
        hashes = [{t.diloco.weights_hash() for t, _, _ in drivers}, {s.diloco.weights_hash() for s in stage1}]
        for (_, network, link), stop in zip(drivers, stops[2:], strict=True):
            stop.set()
            link.close()
            network.stop()
        for s, stop in zip(stage1, stops[:2], strict=True):
            stop.set()
            s.close()

    d = model.num_params()
    d_stages = [
        sum(p.numel() for p in drivers[0][0].model.parameters()),
        stage1[0].diloco.theta_round.numel(),
    ]
    dp = 4 * d * h  # ring all-reduce, n = 2 data streams, per node per round
    first = statistics.mean(x for ls in results for x in ls[:h])
    last = statistics.mean(x for ls in results for x in ls[-h:])
    print(
        f"{args.model} model, d = {d:,} (stage 0: {d_stages[0]:,}, stage 1: {d_stages[1]:,}); 2 stages x 2 replicas; "
        f"H={h}, {args.rounds} rounds, micro-batch {args.batch_size}x{args.seq_len}, activations {args.dtype}, "
        f"Δ {args.encoding}"
    )
    print(
        f"loss {first:.3f} (round 0) -> {last:.3f} (round {args.rounds - 1}); wall {wall:.1f} s; "
        f"stages agree: {[len(x) == 1 for x in hashes]}"
    )
    print(
        f"{'node':<18} {'pipeline MB/round':>18} {'sync MB/round':>14} {'DP MB/round':>12} {'DP / ours':>10}"
    )
    for name, pipeline, sync in rows:
        per_round_p, per_round_s = pipeline / args.rounds, sync / args.rounds
        ratio = dp / (per_round_p + per_round_s)
        print(
            f"{name:<18} {per_round_p / 1e6:>18.2f} {per_round_s / 1e6:>14.3f} {dp / 1e6:>12.1f} {ratio:>10.1f}"
        )
    # Pipeline bytes grow with the steps, sync bytes with the rounds: scale each to H=500.
    pipe_step = statistics.mean(r[1] for r in rows) / steps
    sync_round = statistics.mean(r[2] for r in rows) / args.rounds
    for big_h in (h, 500):
        ours = big_h * pipe_step + sync_round
        print(
            f"at H={big_h}: per node per round pipeline {big_h * pipe_step / 1e6:.1f} MB + sync {sync_round / 1e6:.2f} MB; "
            f"DP {4 * d * big_h / 1e6:.0f} MB; DP/ours {4 * d * big_h / ours:.1f}x, DP/our sync "
            f"{4 * d * big_h / sync_round:.0f}x"
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
) -> tuple[Trainer, PeerNetwork, PipelineLink]:
    """A stage-0 replica as `neuroshard-node --stages 2 --stage 0` builds it."""
    wallet = Wallet.from_token(f"bench-pipeline-s0-{i}")
    network = PeerNetwork(
        _net(args.encoding, boot),
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
        finish_round=network.finish_round, num_stages=2, loss_fn=remote_loss(link.downstream),
    )  # fmt: skip
    holder.append(trainer)
    return trainer, network, link


if __name__ == "__main__":
    main()
