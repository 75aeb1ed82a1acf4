"""Replay spot-check cost relative to the work it checks, side by side in one run.

The work: one DiLoCo round of a lone replica, the real `Trainer.run` (H inner steps on its
assigned shards) with the real receipt hook keeping the round for replay (node.replay). The
check: what the verifier does for a sampled receipt (verifier.replaycheck) — fetch the
round's θ_round, Δ and inner state from the node's peer server over loopback (signed GET,
safetensors), check the three digests, read the claimed batches, replay the H inner steps
and compare the Δs. Both at the same torch thread count (the verifier runs on one).
Rounds alternate (train, check, train, check, …) so drift in machine speed hits both alike.

    .venv/bin/python bench/bench_replay.py [--inner-steps 100] [--rounds 3] [--threads 1]
    .venv/bin/python bench/bench_replay.py --precision bf16   # a bf16-autocast node, replayed in fp32

With --precision bf16 the node trains with bf16 autocast and the verdict uses the verifier's
cross-precision acceptance (verifier.replaycheck.tolerance_for).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from common import DEFAULT_TEXT, bench_dataset, parse_with_quick, quick_dataset

from neuroshard.node.device import Placement
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig
from neuroshard.node.p2p import wire
from neuroshard.node.p2p.auth import sign_request
from neuroshard.node.p2p.network import NetworkConfig, PeerNetwork
from neuroshard.node.p2p.replay import ReplayService, decode_replay
from neuroshard.node.p2p.rounds import RoundReport
from neuroshard.node.p2p.state import theta_sha256
from neuroshard.node.receipt import Receipting
from neuroshard.node.replay import ReplayArchive
from neuroshard.node.trainer import Trainer, TrainerConfig, lone_replica
from neuroshard.node.wallet import Wallet
from neuroshard.verifier.replaycheck import ReplayCheckConfig, tolerance_for
from neuroshard.verifier.spotcheck import claimed_batches, compare_deltas, replay_inner_steps
from neuroshard.verifier.wire import DataSpan

OPERATOR = Wallet.from_token("bench-replay-operator")


def fetch(address: str, round_: int, numel: int, n_tensors: int) -> tuple[Any, float]:
    path = wire.REPLAY.format(round=round_)
    start = time.perf_counter()
    request = urllib.request.Request(
        f"http://{address}{path}", headers=sign_request(OPERATOR, "GET", path, b"", time.time())
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        body = reply.read()
    return decode_replay(body, round_, numel, n_tensors), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--inner-steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="the node's (CPU)"
    )
    args = parse_with_quick(parser, inner_steps=4, rounds=1, model_size="micro", batch_size=2, seq_len=32)
    torch.set_num_threads(args.threads)
    h = args.inner_steps

    dataset = quick_dataset() if args.quick else bench_dataset(args.text)
    print(f"text: {'the quick text' if args.quick else args.text}")
    model_cfg = ModelConfig.named(args.model_size, vocab_size=dataset.tokenizer.vocab_size)
    diloco_cfg = DiLoCoConfig(inner_steps=h, warmup_steps=20, total_steps=20_000)
    trainer = Trainer(
        wallet_id="bench",
        dataset=dataset,
        model_config=model_cfg,
        diloco_config=diloco_cfg,
        config=TrainerConfig(
            batch_size=args.batch_size, seq_len=args.seq_len, checkpoint_every=10**9, log_every=10**9
        ),
        checkpoint_dir=Path(tempfile.mkdtemp()),
        log=lambda line: None,
        placement=Placement(device=torch.device("cpu"), precision=args.precision),
    )
    tolerance = tolerance_for("cpu", args.precision, ReplayCheckConfig())
    reports: list[RoundReport] = []
    receipts: list[dict[str, Any]] = []

    def finish(diloco: DiLoCo) -> None:
        reports.append(
            RoundReport(
                stage=0,
                round=diloco.round,
                accepted=(),
                rejected=(),
                equivocators=(),
                late=False,
                next_round=diloco.round + 1,
                theta_hash="0" * 64,
                agree=1,
                voters=1,
                resynced_from=None,
                seconds=0.0,
            )
        )
        lone_replica(diloco)

    archive = ReplayArchive(keep_rounds=2)
    receipting = Receipting(
        finish,
        reports,
        trainer.work,
        receipts.append,
        batch_size=args.batch_size,
        tokens_per_step=args.batch_size * args.seq_len,
        log=print,
        archive=archive,
    )
    receipting.round_started(trainer.diloco)
    trainer.set_round_finisher(receipting)
    net = PeerNetwork(
        NetworkConfig(port=0, join_timeout_s=0),
        Wallet.from_token("bench-replay-node"),
        stage=0,
        log=lambda line: None,
        extensions=[ReplayService(archive, allowed_wallet=OPERATOR.public_key_hex)],
    )
    net.start()
    params = list(trainer.model.parameters())
    numel, n_tensors = sum(p.numel() for p in params), len(params)
    print(
        f"model {args.model_size} ({numel:,} params), batch {args.batch_size}x{args.seq_len}, H={h}, "
        f"node precision {args.precision} (verdict at cosine >= {tolerance.min_cosine}, norm ±{tolerance.norm_tolerance}), "
        f"torch threads {args.threads}, load average {os.getloadavg()[0]:.2f} at start"
    )
    node_s, fetch_s, read_s, replay_s = [], [], [], []
    try:
        for r in range(args.rounds + 1):
            trainer.config.max_steps = (r + 1) * h
            result = trainer.run(threading.Event())
            if r == 0:
                continue  # round 0 warms up kernels and the allocator on both sides
            doc = receipts[-1]
            record, seconds = fetch(net.address, doc["round"], numel, n_tensors)
            start = time.perf_counter()
            digests_ok = (
                theta_sha256(record.theta_round) == doc["base_hash"]
                and theta_sha256(record.delta) == doc["delta_digest"]
                and record.inner.digest() == doc["inner_state_digest"]
            )
            fetch_s.append(seconds + time.perf_counter() - start)
            start = time.perf_counter()
            batches = claimed_batches(
                source=dataset.source,
                manifest=dataset.manifest,
                wallet_id="bench",
                spans=[DataSpan(**span) for span in doc["data"]],
                batch_size=args.batch_size,
                seq_len=args.seq_len,
            )
            read_s.append(time.perf_counter() - start)
            replayed = replay_inner_steps(
                model_cfg,
                diloco_cfg,
                record.theta_round,
                batches,
                round_=doc["round"],
                inner_state=record.inner,
            )
            verdict = compare_deltas(record.delta, replayed, tolerance)
            replay_s.append(time.perf_counter() - start)
            node_s.append(result.inner_seconds)
            print(
                f"  round {doc['round']}: node inner {node_s[-1]:.2f} s | verifier fetch+digests {fetch_s[-1]:.2f} s, "
                f"replay {replay_s[-1]:.2f} s of which reading batches {read_s[-1]:.2f} s ({'pass' if verdict.ok and digests_ok else 'FAIL'}: {verdict.reason}) "
                f"| load {os.getloadavg()[0]:.2f}"
            )
    finally:
        net.stop()
        dataset.source.close()
    n, f, p = statistics.median(node_s), statistics.median(fetch_s), statistics.median(replay_s)
    print(
        f"median: node {n:.2f} s per round, check {f + p:.2f} s (fetch+digests {f:.2f}, replay {p:.2f}); "
        f"check/work = {(f + p) / n:.3f}"
    )


if __name__ == "__main__":
    main()
