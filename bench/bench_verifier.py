"""Verifier benchmarks, each printed as a ratio measured side by side in one run.

1. GET /api/training/verify under a loopback load generator (asyncio + httpx, C concurrent
   connections) against a uvicorn verifier on PostgreSQL seeded with a realistic history,
   vs the same load on a bare FastAPI app returning a constant JSON under the same uvicorn
   settings: requests/s and p50/p99 latency of both, and the ratio.
2. Spot-check cost relative to the work it checks: a replica's H inner steps vs the
   verifier's replay of them (claimed batches read from the shards + the same H steps).

    .venv/bin/python bench/bench_verifier.py [--db postgresql://127.0.0.1:5432/test]
        [--seconds 10] [--concurrency 16] [--threads 2]

The database named by --db gets a scratch schema, dropped afterwards. Server and load
generator share the machine's cores, so absolute numbers understate a dedicated host.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import torch
from common import BENCH_KEY, DEFAULT_TEXT

from neuroshard.data import BatchStream, Dataset, assign_shards, open_dataset
from neuroshard.data.publish import TOKENIZER_NAME, publish_shards
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.wallet import Wallet
from neuroshard.tokenizer import BPETokenizer
from neuroshard.verifier import ledger
from neuroshard.verifier.auth import SignedBy, new_nonce
from neuroshard.verifier.db import Database
from neuroshard.verifier.reputation import ReputationConfig
from neuroshard.verifier.spotcheck import claimed_batches, compare_deltas, replay_inner_steps
from neuroshard.verifier.testing import TEST_DATABASE_ENV, scratch_database
from neuroshard.verifier.wire import DataSpan, ReceiptRequest, RegisterRequest

NETWORK_TOML = """
name = "bench"
[model]
size = "tiny"
vocab_size = 4096
[diloco]
inner_steps = 100
[data]
manifest_url = "http://127.0.0.1:1/"
publisher_key = "%s"
""" % ("ab" * 32)

BASELINE_APP = textwrap.dedent(
    """
    from fastapi import FastAPI
    app = FastAPI()

    @app.get("/api/training/verify")
    def verify() -> dict[str, object]:
        return {"training_verified": False, "reason": "baseline", "global_loss": None}
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def seed(url: str, wallets: int, rounds: int, evaluations: int) -> None:
    """A run's history: every wallet reports every round (one in ten disagrees), regular evaluations."""
    db = Database(url)
    db.upgrade()
    cfg = ledger.LedgerConfig(reputation=ReputationConfig(), num_stages=1, nonce_window_s=60)
    now = time.time()
    nodes = [Wallet.from_token(f"bench-{i}") for i in range(wallets)]

    def signed(w: Wallet) -> SignedBy:
        return SignedBy(public_key_hex=w.public_key_hex, timestamp=now, nonce=new_nonce())

    with db.write() as s:
        for w in nodes:
            req = RegisterRequest(address="http://127.0.0.1:9000", stage=0, software_version="0.1.0")
            ledger.register(s, signed(w), req, now=now, cfg=cfg)
    for r in range(rounds):
        with db.write() as s:
            for i, w in enumerate(nodes):
                result = f"{r:064x}" if (i + r) % 10 else f"f{r:063x}"
                req = ReceiptRequest(
                    stage=0,
                    round=r,
                    inner_steps=100,
                    start_step=100 * r,
                    tokens=100 * 8 * 128,
                    data=[DataSpan(shard_id=(i + r) % 40, offset_start=0, offset_end=800)],
                    losses=[6.0 - r * 0.01] * 100,
                    base_hash="0" * 64,
                    result_hash=result,
                    delta_digest="d" * 64,
                )
                ledger.submit_receipt(s, signed(w), req, body_sha256=f"{r}-{i}", now=now, cfg=cfg)
            ledger.settle_rounds(s, 0, now=now, cfg=cfg)
            if r % max(1, rounds // evaluations) == 0:
                ledger.record_evaluation(s, r, 6.0 - r * 0.01, 65_536, stderr=0.01, now=now)
    db.dispose()


def serve(argv: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/training/verify", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit(f"server did not start; see {log}")


async def load(url: str, seconds: float, concurrency: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < end:
                start = time.perf_counter()
                response = await client.get(url)
                latencies.append(time.perf_counter() - start)
                response.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, latencies


def p(latencies: list[float], q: float) -> float:
    return statistics.quantiles(latencies, n=100)[int(q) - 1] * 1000


def bench_http(db_url: str, seconds: float, concurrency: int, tmp: Path) -> None:
    with scratch_database("postgresql", tmp, {TEST_DATABASE_ENV: db_url}) as url:
        start = time.perf_counter()
        seed(url, wallets=20, rounds=200, evaluations=40)
        print(
            f"seeded 20 wallets x 200 rounds (4,000 receipts, 40 evaluations) in {time.perf_counter() - start:.1f}s"
        )
        (tmp / "network.toml").write_text(NETWORK_TOML)
        port = free_port()
        verifier = serve(
            [sys.executable, "-m", "neuroshard.verifier.cli", "--network", str(tmp / "network.toml"), "--db", url,
             "--port", str(port), "--home", str(tmp), "--init-operator-key", "--log-level", "warning"],
            port,
            tmp / "verifier.log",
        )  # fmt: skip
        (tmp / "baseline_app.py").write_text(BASELINE_APP)
        base_port = free_port()
        baseline = serve(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(tmp), "baseline_app:app", "--port", str(base_port),
             "--log-level", "warning"],
            base_port,
            tmp / "baseline.log",
        )  # fmt: skip
        try:
            rows = []
            for name, port_ in (
                ("verifier /api/training/verify (PostgreSQL)", port),
                ("bare FastAPI, constant JSON", base_port),
            ):
                asyncio.run(
                    load(f"http://127.0.0.1:{port_}/api/training/verify", 1.0, concurrency)
                )  # warm-up
                elapsed, lat = asyncio.run(
                    load(f"http://127.0.0.1:{port_}/api/training/verify", seconds, concurrency)
                )
                rows.append((name, len(lat) / elapsed, p(lat, 50), p(lat, 99)))
        finally:
            for process in (verifier, baseline):
                process.terminate()
                process.wait(timeout=10)
    print(
        f"\nload: {concurrency} concurrent connections, {seconds:.0f}s per server, loopback, one uvicorn worker each"
    )
    print("| server | req/s | p50 ms | p99 ms |\n|---|---|---|---|")
    for name, rps, p50, p99 in rows:
        print(f"| {name} | {rps:,.0f} | {p50:.1f} | {p99:.1f} |")
    print(f"ratio verifier/bare req/s = {rows[0][1] / rows[1][1]:.2f}")


def spot_check_dataset(directory: Path) -> Dataset:
    """A small data set of its own (vocab 1024, 100k-token shards) from the shared English text."""
    text = DEFAULT_TEXT.read_text(encoding="utf-8")[:1_000_000]
    BPETokenizer.train([text[:300_000]], 1024).save(directory / TOKENIZER_NAME)
    publish_shards(text.split("\n\n"), out=directory, key=BENCH_KEY, shard_tokens=100_000)
    return open_dataset(directory, bytes(BENCH_KEY.verify_key))


def bench_spot_check(threads: int, inner_steps: int, tmp: Path) -> None:
    torch.set_num_threads(threads)
    dataset = spot_check_dataset(tmp)
    config = ModelConfig.named("tiny", vocab_size=dataset.tokenizer.vocab_size)
    diloco_cfg = DiLoCoConfig(inner_steps=inner_steps, warmup_steps=10, total_steps=10_000)
    wallet = Wallet.from_token("bench-spot").wallet_id
    batch, seq = 8, 128
    work, replay = [], []
    for _ in range(3):
        diloco = DiLoCo(build_stage(config, 0, 1), diloco_cfg)
        order = assign_shards(wallet, dataset.manifest)
        stream = BatchStream(
            source=dataset.source,
            manifest=dataset.manifest,
            order=order,
            seed=wallet,
            batch_size=batch,
            seq_len=seq,
        )
        stream.next_batch()  # shard loaded outside the timed region, for both sides
        stream.position = copy.copy(stream.position)
        start_offset = stream.position.offset
        theta, state = diloco.theta_round.detach().clone(), copy.deepcopy(diloco.inner_optimizer.state_dict())
        t0 = time.perf_counter()
        for _ in range(inner_steps):
            diloco.inner_step(*stream.next_batch())
        delta = diloco.pseudo_gradient()
        work.append(time.perf_counter() - t0)
        span = DataSpan(
            shard_id=order[0], offset_start=start_offset, offset_end=start_offset + inner_steps * batch
        )
        t0 = time.perf_counter()
        batches = claimed_batches(
            source=dataset.source,
            manifest=dataset.manifest,
            wallet_id=wallet,
            spans=[span],
            batch_size=batch,
            seq_len=seq,
        )
        replayed = replay_inner_steps(config, diloco_cfg, theta, batches, inner_optimizer_state=state)
        result = compare_deltas(delta, replayed)
        replay.append(time.perf_counter() - t0)
        assert result.ok, result.reason
    w, r = statistics.median(work), statistics.median(replay)
    print(
        f"\nspot check: tiny model, H={inner_steps} inner steps of {batch}x{seq}, {threads} threads, median of 3"
    )
    print(
        f"| | seconds |\n|---|---|\n| replica's inner steps (the work) | {w:.2f} |\n| verifier's replay (read claimed data + same steps + compare) | {r:.2f} |"
    )
    print(
        f"ratio replay/work = {r / w:.2f}; checking a fraction s of receipts costs s x {r / w:.2f} of the network's compute"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default=os.environ.get(TEST_DATABASE_ENV, "postgresql://127.0.0.1:5432/test"))
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--inner-steps", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench_http(args.db, args.seconds, args.concurrency, Path(tmp))
    with tempfile.TemporaryDirectory() as tmp:
        bench_spot_check(args.threads, args.inner_steps, Path(tmp))


if __name__ == "__main__":
    main()
