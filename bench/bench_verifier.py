"""Verifier benchmarks, each printed as a ratio measured side by side in one run.

1. Reads under a loopback load generator (asyncio + aiohttp, C concurrent connections) against
   a uvicorn verifier on PostgreSQL seeded with a run's history (W wallets x R rounds), vs the
   same load on a bare FastAPI app returning a constant JSON under the same uvicorn settings.
   The two servers take turns (verifier, bare, bare, verifier, ...) for --repeats turns each;
   req/s and p50/p99 are medians over the turns. Then every read endpoint alone, a paced
   load of --rate req/s on /api/training/verify (latency from each request's scheduled
   start, so queueing counts), and the bytes of one dashboard poll, fresh and when unchanged.
2. Spot-check cost relative to the work it checks: a replica's H inner steps vs the
   verifier's replay of them (claimed batches read from the shards + the same H steps).

    .venv/bin/python bench/bench_verifier.py [--db postgresql://127.0.0.1:5432/test | --db sqlite]
        [--wallets 20] [--rounds 200] [--seconds 5] [--repeats 3] [--concurrency 16]
        [--rate 200] [--workers 1] [--threads 2] [--quick]

The database named by --db gets a scratch schema, dropped afterwards (--db sqlite: a scratch
file). Server and load generator share the machine's cores, so absolute numbers understate
a dedicated host.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp
import httpx
import torch
from common import BENCH_KEY, DEFAULT_TEXT, parse_with_quick, quick_text
from sqlalchemy import insert

from neuroshard.data import BatchStream, Dataset, assign_shards, open_dataset
from neuroshard.data.publish import TOKENIZER_NAME, publish_shards
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.replay import capture_inner_state
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.reports import DataSpan, Receipt, RegisterRequest
from neuroshard.protocol.signing import SignedBy, new_nonce
from neuroshard.testing.ports import free_port
from neuroshard.testing.verifier import TEST_DATABASE_ENV, scratch_database
from neuroshard.tokenizer import BPETokenizer
from neuroshard.verifier import ledger
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database
from neuroshard.verifier.reputation import ReputationConfig
from neuroshard.verifier.spotcheck import claimed_batches, compare_deltas, replay_inner_steps

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
                req = Receipt(
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


def seed_bulk(url: str, wallets: int, rounds: int, evaluations: int, stages: int = 4) -> None:
    """The same shape of history written straight into the tables (no signatures, no settlement
    logic): 1,000 wallets x 200 rounds through the ledger would take the better part of an hour.
    Wallets are spread over `stages`; every round of every stage is settled; one in ten disagrees."""
    db = Database(url)
    db.upgrade()
    now = time.time()
    ids = [f"{i:020x}" for i in range(wallets)]
    with db.write() as s:
        s.execute(insert(m.Wallet), [
            {"wallet_id": w, "public_key": f"{i:064x}", "reputation": 0.5, "status": m.STATUS_ACTIVE,
             "registered_at": now, "software_version": "0.1.0"} for i, w in enumerate(ids)
        ])  # fmt: skip
        s.execute(insert(m.Peer), [
            {"wallet_id": w, "address": "http://127.0.0.1:9000", "stage": i % stages, "registered_at": now,
             "last_heartbeat": now + 3600, "round": rounds, "steps_in_round": 10} for i, w in enumerate(ids)
        ])  # fmt: skip
    for r in range(rounds):
        receipts, votes = [], []
        for i, w in enumerate(ids):
            result = f"{r:064x}" if (i + r) % 10 else f"f{r:063x}"
            receipts.append({
                "wallet_id": w, "stage": i % stages, "round": r, "inner_steps": 100, "start_step": 100 * r,
                "tokens": 102_400, "shard_id": (i + r) % 40, "offset_start": 0, "offset_end": 800,
                "data_spans": [[(i + r) % 40, 0, 800]], "losses": [6.0 - r * 0.01] * 100,
                "loss_sum": (6.0 - r * 0.01) * 100, "loss_count": 100, "base_hash": "0" * 64,
                "result_hash": result, "delta_digest": "d" * 64, "accepted": [], "rejected": [],
                "equivocators": [], "accepted_count": 0, "rejected_count": 0, "body_sha256": f"{r:032x}{i:032x}",
                "received_at": now,
            })  # fmt: skip
            votes.append(
                {
                    "stage": i % stages,
                    "round": r,
                    "wallet_id": w,
                    "result_hash": result,
                    "base_hash": "0" * 64,
                }
            )
        with db.write() as s:
            s.execute(insert(m.Receipt), receipts)
            s.execute(insert(m.HashVote), votes)
            for stage in range(stages):
                n = sum(1 for i in range(wallets) if i % stages == stage)
                s.add(m.Round(stage=stage, round=r, majority_hash=f"{r:064x}", votes=n, agreeing=n - n // 10,
                              synced=n, sync_checked=n, settled_at=now))  # fmt: skip
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


def client_session(connections: int, timeout_s: float = 30.0) -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp (the peer plane's library), keep-alive, at most
    `connections` sockets. httpx was the load generator here until 2026-11-26; with thousands of
    requests queued on a 200-socket pool its pool spent ~60% of the generator's CPU choosing a
    connection (py-spy: httpcore `_assign_requests_to_connections`/`is_idle`), so the benchmark
    measured its own client, not the verifier."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, force_close=False),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def get(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url) as response:
        await response.read()
        return response.status


async def load(url: str, seconds: float, concurrency: int) -> tuple[float, list[float]]:
    """Closed loop: `concurrency` clients, each sending its next GET when the last one answered."""
    latencies: list[float] = []
    async with client_session(concurrency) as session:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < end:
                start = time.perf_counter()
                status = await get(session, url)
                latencies.append(time.perf_counter() - start)
                if status != 200:
                    raise SystemExit(f"GET {url} answered {status}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, latencies


async def paced(url: str, rate: float, seconds: float, max_in_flight: int = 256) -> list[float]:
    """Requests started at a fixed rate (open loop); each latency counts from its scheduled start."""
    latencies: list[float] = []
    async with client_session(64) as session:
        gate = asyncio.Semaphore(max_in_flight)
        begin = time.perf_counter() + 0.05

        async def one(i: int) -> None:
            due = begin + i / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            async with gate:
                status = await get(session, url)
            latencies.append(time.perf_counter() - due)
            if status != 200:
                raise SystemExit(f"GET {url} answered {status}")

        await asyncio.gather(*(one(i) for i in range(int(rate * seconds))))
    return latencies


def p(latencies: list[float], q: float) -> float:
    return statistics.quantiles(latencies, n=100)[int(q) - 1] * 1000


READS = ("/api/training/verify", "/api/training/global", "/api/training/history", "/api/nodes")
"""What the dashboard polls (and /api/training/verify is what `curl` users poll)."""


def poll_bytes(base: str) -> tuple[int, int, int]:
    """One dashboard poll: bytes on the wire (bodies + headers) fresh, then with the ETags it got
    (unchanged data), and how many of those answered 304."""
    fresh, again, not_modified = 0, 0, 0
    with httpx.Client(timeout=30) as client:
        tags = {}
        for path in READS:
            r = client.get(base + path)
            fresh += len(r.content) + sum(len(k) + len(v) + 4 for k, v in r.headers.items())
            tags[path] = r.headers.get("etag", "")
        for path in READS:
            r = client.get(base + path, headers={"If-None-Match": tags[path]})
            again += len(r.content) + sum(len(k) + len(v) + 4 for k, v in r.headers.items())
            not_modified += r.status_code == 304
    return fresh, again, not_modified


def bench_http(args: argparse.Namespace, tmp: Path) -> None:
    backend = "sqlite" if args.db == "sqlite" else "postgresql"
    with scratch_database(backend, tmp, {TEST_DATABASE_ENV: args.db}) as url:
        start = time.perf_counter()
        evaluations = max(1, args.rounds // 5)
        (seed_bulk if args.bulk_seed else seed)(url, args.wallets, args.rounds, evaluations)
        print(
            f"seeded {args.wallets} wallets x {args.rounds} rounds ({args.wallets * args.rounds:,} receipts, "
            f"{evaluations} evaluations{', 4 stages, written in bulk' if args.bulk_seed else ''}) on {backend} "
            f"in {time.perf_counter() - start:.1f}s"
        )
        (tmp / "network.toml").write_text(NETWORK_TOML + ("[stages]\ncount = 4\n" if args.bulk_seed else ""))
        port = free_port()
        verifier = serve(
            [sys.executable, "-m", "neuroshard.cli.verifier", "--network", str(tmp / "network.toml"), "--db", url,
             "--port", str(port), "--home", str(tmp), "--init-operator-key", "--log-level", "warning",
             "--no-evaluation", "--workers", str(args.workers)],
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
            before = rss_mb(verifier.pid)
            _compare(args, port, base_port)
            print(
                f"verifier resident memory: {before:.0f} MB after start, {rss_mb(verifier.pid):.0f} MB after the loads"
            )
        finally:
            for process in (verifier, baseline):
                process.terminate()
                process.wait(timeout=30)


def rss_mb(pid: int) -> float:
    """Resident set size of a process (Linux /proc), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _compare(args: argparse.Namespace, port: int, base_port: int) -> None:
    sides = {
        f"verifier /api/training/verify ({args.workers} worker(s))": f"http://127.0.0.1:{port}/api/training/verify",
        "bare FastAPI, constant JSON": f"http://127.0.0.1:{base_port}/api/training/verify",
    }
    for target in sides.values():
        asyncio.run(load(target, 1.0, args.concurrency))  # warm-up
    turns: dict[str, list[tuple[float, float, float]]] = {name: [] for name in sides}
    for i in range(args.repeats):
        for name in list(sides) if i % 2 == 0 else reversed(sides):
            elapsed, lat = asyncio.run(load(sides[name], args.seconds, args.concurrency))
            turns[name].append((len(lat) / elapsed, p(lat, 50), p(lat, 99)))
    print(
        f"\nload: {args.concurrency} concurrent connections, {args.repeats} alternating turns of "
        f"{args.seconds:.0f}s per server, loopback; medians over the turns"
    )
    print("| server | req/s | p50 ms | p99 ms |\n|---|---|---|---|")
    medians = {}
    for name, rows in turns.items():
        medians[name] = [statistics.median(r[k] for r in rows) for k in range(3)]
        rps, p50, p99 = medians[name]
        print(f"| {name} | {rps:,.0f} | {p50:.1f} | {p99:.1f} |")
    ours, bare = (medians[name][0] for name in sides)
    print(f"ratio verifier/bare req/s = {ours / bare:.2f} (per turn: "
          + ", ".join(f"{a[0] / b[0]:.2f}" for a, b in zip(*turns.values(), strict=True)) + ")")  # fmt: skip

    print(f"\nevery read endpoint, {args.concurrency} connections, {args.seconds:.0f}s each:")
    print(
        "| endpoint | first GET ms (renders) | req/s | p50 ms | p99 ms | body bytes |\n|---|---|---|---|---|---|"
    )
    for path in (
        *READS,
        "/api/training/history?limit=1000",
        "/api/nodes?limit=1000",
        "/api/peers?stage=0",
        "/metrics",
    ):
        target = f"http://127.0.0.1:{port}{path}"
        start = time.perf_counter()
        size = len(httpx.get(target, timeout=30).content)
        first = (time.perf_counter() - start) * 1000
        elapsed, lat = asyncio.run(load(target, args.seconds, args.concurrency))
        print(
            f"| {path} | {first:.0f} | {len(lat) / elapsed:,.0f} | {p(lat, 50):.1f} | {p(lat, 99):.1f} | {size:,} |"
        )

    lat = asyncio.run(paced(sides[next(iter(sides))], args.rate, args.seconds))
    print(
        f"\npaced: {args.rate:.0f} req/s on /api/training/verify for {args.seconds:.0f}s: "
        f"p50 {p(lat, 50):.1f} ms, p99 {p(lat, 99):.1f} ms (from each request's scheduled start)"
    )
    fresh, again, not_modified = poll_bytes(f"http://127.0.0.1:{port}")
    print(
        f"dashboard poll ({len(READS)} GETs): {fresh:,} bytes fresh, {again:,} bytes when unchanged "
        f"({not_modified}/{len(READS)} answered 304)"
    )


def spot_check_dataset(directory: Path, text_path: Path, vocab_size: int) -> Dataset:
    """A small data set of its own (100k-token shards) from the benchmarks' text."""
    text = text_path.read_text(encoding="utf-8")[:1_000_000]
    BPETokenizer.train([text[:300_000]], vocab_size).save(directory / TOKENIZER_NAME)
    publish_shards(text.split("\n\n"), out=directory, key=BENCH_KEY, shard_tokens=100_000)
    return open_dataset(directory, bytes(BENCH_KEY.verify_key))


def bench_spot_check(threads: int, inner_steps: int, tmp: Path, quick: bool) -> None:
    torch.set_num_threads(threads)
    dataset = spot_check_dataset(tmp, quick_text() if quick else DEFAULT_TEXT, 300 if quick else 1024)
    config = ModelConfig.named("micro" if quick else "tiny", vocab_size=dataset.tokenizer.vocab_size)
    diloco_cfg = DiLoCoConfig(inner_steps=inner_steps, warmup_steps=10, total_steps=10_000)
    wallet = Wallet.from_token("bench-spot").wallet_id
    batch, seq = (2, 32) if quick else (8, 128)
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
        theta, state = diloco.theta_round.detach().clone(), capture_inner_state(diloco)
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
        replayed = replay_inner_steps(
            config, diloco_cfg, theta, batches, round_=diloco.round, inner_state=state
        )
        result = compare_deltas(delta, replayed)
        replay.append(time.perf_counter() - t0)
        assert result.ok, result.reason
    w, r = statistics.median(work), statistics.median(replay)
    print(
        f"\nspot check: {'micro' if quick else 'tiny'} model, H={inner_steps} inner steps of {batch}x{seq}, {threads} threads, median of 3"
    )
    print(
        f"| | seconds |\n|---|---|\n| replica's inner steps (the work) | {w:.2f} |\n| verifier's replay (read claimed data + same steps + compare) | {r:.2f} |"
    )
    print(
        f"ratio replay/work = {r / w:.2f}; checking a fraction s of receipts costs s x {r / w:.2f} of the network's compute"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--db",
        default=os.environ.get(TEST_DATABASE_ENV, "postgresql://127.0.0.1:5432/test"),
        help="PostgreSQL URL (a scratch schema is made in it), or 'sqlite' for a scratch file",
    )
    ap.add_argument("--wallets", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each load turn")
    ap.add_argument("--repeats", type=int, default=3, help="turns per server, alternating")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rate", type=float, default=200.0, help="req/s of the paced run")
    ap.add_argument("--workers", type=int, default=1, help="neuroshard-verifier --workers (PostgreSQL)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--no-spot-check", action="store_true", help="only the HTTP part")
    ap.add_argument(
        "--bulk-seed",
        action="store_true",
        help="write the history straight into the tables, over 4 stages (fast)",
    )
    args = parse_with_quick(
        ap, wallets=4, rounds=10, seconds=0.5, repeats=1, rate=50.0, inner_steps=3, threads=1
    )
    with tempfile.TemporaryDirectory() as tmp:
        bench_http(args, Path(tmp))
    if args.no_spot_check:
        return
    with tempfile.TemporaryDirectory() as tmp:
        bench_spot_check(args.threads, args.inner_steps, Path(tmp), args.quick)


if __name__ == "__main__":
    main()
