"""Write load on the verifier from a simulated network: N nodes, signed, on loopback.

Each of N wallets (distinct keys) registers, then for --seconds sends a signed heartbeat
every 10 s (each at its own phase) and, every --round-s, a signed receipt for the round
(which carries its θ hash vote): its replica ends the round within the first --receipt-spread of
it (0.25: a quarter, the harsh default: every replica finishes its inner steps at nearly the same
time) and then, as the node's verifier client does, waits its splay before sending: --node-splay
(the client's `receipt_splay`, 0.5) of the round times its wallet's share for that round
(node.verifier_client.splay_share), at most `receipt_splay_max_s`, except its first receipt,
which a node sends at once; --node-splay 0 sends every one at once, as nodes did before the splay.
The wallets are spread over 4 stages. Receipts after the first round are also reported alone.
The schedule starts START_LEAD_S after its requests are set up, so none is due while this
single-threaded generator is still busy starting them. The verifier runs
`neuroshard-verifier --workers W` on PostgreSQL.
Printed: p50/p99 per endpoint, measured from when each request was due (queueing counts)
and from when it was sent; status counts (no 5xx expected); PostgreSQL backends seen
(distinct pids, sampled each second: the pool should keep a fixed set); and, with
--kill-after, receipts acknowledged vs stored after one worker is SIGKILLed mid-load.

    .venv/bin/python bench/bench_verifier_writes.py [--nodes 1000] [--workers 4] [--seconds 60]
        [--round-s 20] [--receipt-spread 0.25] [--node-splay 0.5] [--kill-after 30] [--db postgresql://127.0.0.1:5432/test] [--quick]

The load generator (asyncio + aiohttp, one process) shares the machine's cores with the
verifier and PostgreSQL, so it also measures what is left of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import aiohttp
from bench_verifier import NETWORK_TOML, client_session, free_port, serve
from common import parse_with_quick
from sqlalchemy import func, select, text

from neuroshard.node.verifier_client import VerifierClientConfig, splay_share
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.signing import sign_request
from neuroshard.testing.verifier import TEST_DATABASE_ENV, scratch_database
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database

STAGES = 4
HEARTBEAT_S = 10.0


def signed_post(wallet: Wallet, path: str, doc: object) -> tuple[bytes, dict[str, str]]:
    body = json.dumps(doc).encode()
    headers = sign_request(wallet, "POST", path, body, now=time.time())
    headers["Content-Type"] = "application/json"
    return body, headers


def receipt(stage: int, round_: int) -> dict[str, object]:
    return {
        "stage": stage, "round": round_, "inner_steps": 100, "start_step": 100 * round_, "tokens": 102_400,
        "data": [{"shard_id": round_ % 40, "offset_start": 0, "offset_end": 100}] if stage == 0 else [],
        "losses": [6.0 - round_ / 100] * 100, "base_hash": f"{round_ - 1:064x}" if round_ else "0" * 64,
        "result_hash": f"{round_:064x}", "delta_digest": "d" * 64,
    }  # fmt: skip


class Load:
    """The simulated network's requests and what came back."""

    def __init__(self, base: str, wallets: list[Wallet], connections: int) -> None:
        self.base = base
        self.wallets = wallets
        self.client = client_session(connections, timeout_s=120.0)
        self.due_ms: dict[str, list[float]] = {}
        self.sent_ms: dict[str, list[float]] = {}
        self.status: Counter[tuple[str, int | str]] = Counter()
        self.acknowledged: set[tuple[str, int, int]] = set()

    async def post(
        self, wallet: Wallet, path: str, doc: Mapping[str, object], due: float, also: str | None = None
    ) -> int | None:
        """Send at `due`; latencies are kept under `path` and, when given, under `also` too."""
        await asyncio.sleep(max(0.0, due - time.time()))
        body, headers = signed_post(wallet, path, doc)
        sent = time.time()
        try:
            async with self.client.post(self.base + path, data=body, headers=headers) as response:
                await response.read()
                code = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:  # a killed worker's connections
            self.status[(path, type(exc).__name__)] += 1
            return None
        done = time.time()
        for key in (path, also) if also else (path,):
            self.due_ms.setdefault(key, []).append((done - due) * 1000)
            self.sent_ms.setdefault(key, []).append((done - sent) * 1000)
        self.status[(path, code)] += 1
        return code

    async def register(self) -> None:
        now = time.time()
        docs = [{"address": "http://127.0.0.1:9000", "stage": i % STAGES, "software_version": "0.1.0"}
                for i in range(len(self.wallets))]  # fmt: skip
        pending = list(zip(self.wallets, docs, strict=True))
        for _ in range(3):  # a node retries a registration the network lost; so does this one
            codes = await asyncio.gather(*(self.post(w, "/api/register", d, now) for w, d in pending))
            if any(c not in (200, None) for c in codes):
                raise SystemExit(f"registration refused: {Counter(codes)}")
            pending = [p for p, code in zip(pending, codes, strict=True) if code is None]
        if pending:
            raise SystemExit(f"{len(pending)} registrations failed three times")

    async def run(
        self, seconds: float, round_s: float, spread: float, splay: float, rng: random.Random
    ) -> None:
        # Starting the ~10,000 request tasks takes this single-threaded generator a few hundred ms;
        # requests due during that would go out in one burst and have their answers read late,
        # which the latencies would blame on the verifier. So the schedule starts after it.
        start = time.time() + START_LEAD_S
        tasks = []
        for i, w in enumerate(self.wallets):
            phase = rng.uniform(0, HEARTBEAT_S)
            beats = int((seconds - phase) // HEARTBEAT_S) + 1
            for k in range(max(0, beats)):
                at = start + phase + k * HEARTBEAT_S
                doc = {"stage": i % STAGES, "round": int((at - start) // round_s), "steps_in_round": 10}
                tasks.append(self.post(w, "/api/heartbeat", doc, at))
            window = min(splay * round_s, VerifierClientConfig.receipt_splay_max_s)  # a round since the last
            for r in range(int(seconds // round_s)):
                at = start + r * round_s + rng.uniform(0, round_s * spread)
                at += window * splay_share(w.public_key_hex, r) if r > 0 else 0.0  # the first: at once
                tasks.append(self._receipt(w, i % STAGES, r, at))
        await asyncio.gather(*tasks)

    async def _receipt(self, wallet: Wallet, stage: int, round_: int, due: float) -> None:
        later = "/api/receipts, rounds ≥ 1" if round_ > 0 else None  # the first round's go at once
        code = await self.post(wallet, "/api/receipts", receipt(stage, round_), due, later)
        if code in (200, 201):
            self.acknowledged.add((wallet.wallet_id, stage, round_))


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds a process has used (/proc/PID/stat), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU time of the verifier's processes and of PostgreSQL's backends, sampled every second
    (the last sample of a process that dies, a SIGKILLed worker's, is what it counts for)."""

    def __init__(self, parent: int) -> None:
        self.parent = parent
        self.verifier: dict[int, float] = {}
        self.postgres: dict[int, float] = {}

    def sample(self, backend_pids: set[int]) -> None:
        for pid in [self.parent, *worker_pids(self.parent)]:
            used = cpu_s(pid)
            if used is not None:
                self.verifier[pid] = used
        for pid in backend_pids:
            used = cpu_s(pid)
            if used is not None:
                self.postgres[pid] = used


def backends_seen(db: Database, seen: set[int], stop: asyncio.Event, meter: CpuMeter) -> asyncio.Task[None]:
    async def sample() -> None:
        while not stop.is_set():
            with db.engine.connect() as conn:
                pids = conn.execute(
                    text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
                )
                now = {int(p) for (p,) in pids}
            seen.update(now)
            meter.sample(now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        meter.sample(seen)

    return asyncio.create_task(sample())


def worker_pids(parent: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
    except FileNotFoundError:
        return []


async def main_async(args: argparse.Namespace, url: str, base: str, parent: int) -> Load:
    wallets = [Wallet.from_token(f"bench-load-{i}") for i in range(args.nodes)]
    load = Load(base, wallets, args.connections)
    db = Database(url)
    seen: set[int] = set()
    stop = asyncio.Event()
    meter = CpuMeter(parent)
    meter.sample(set())
    before = sum(meter.verifier.values())  # start-up and migrations, not the load
    sampler = backends_seen(db, seen, stop, meter) if db.dialect == "postgresql" else None
    try:
        await load.register()
        killer = None
        if args.kill_after is not None:

            async def kill() -> None:
                await asyncio.sleep(START_LEAD_S + args.kill_after)  # seconds into the load's schedule
                victim = worker_pids(parent)[0]
                os.kill(victim, signal.SIGKILL)
                print(f"SIGKILL worker {victim} at {args.kill_after:.0f} s", flush=True)

            killer = asyncio.create_task(kill())
        await load.run(args.seconds, args.round_s, args.receipt_spread, args.node_splay, random.Random(0))
        if killer is not None:
            await killer
    finally:
        stop.set()
        if sampler is not None:
            await sampler
        await load.client.close()
    with db.read() as session:
        stored = {
            (w, s, r)
            for w, s, r in session.execute(select(m.Receipt.wallet_id, m.Receipt.stage, m.Receipt.round))
        }
        settled = session.scalar(select(func.count()).select_from(m.Round))
    db.dispose()
    lost = load.acknowledged - stored
    print(
        f"\nreceipts acknowledged {len(load.acknowledged):,}, stored {len(stored):,}, acknowledged but not stored {len(lost)}"
    )
    print(f"(stage, round)s settled: {settled}")
    if sampler is not None:
        print(f"PostgreSQL backends seen (distinct pids, sampled every second): {len(seen)}")
        answered = sum(n for (_, code), n in load.status.items() if isinstance(code, int))
        verifier_s, postgres_s = sum(meter.verifier.values()) - before, sum(meter.postgres.values())
        print(
            f"CPU per answered request ({answered:,}): verifier {verifier_s / answered * 1000:.2f} ms "
            f"({verifier_s:.1f} s over {len(meter.verifier)} processes), PostgreSQL backends "
            f"{postgres_s / answered * 1000:.2f} ms ({postgres_s:.1f} s; the sampler's own included)"
        )
    return load


START_LEAD_S = 2.0
"""Seconds between building the load's schedule and its first request (Load.run)."""


def q(values: list[float], percent: int) -> float:
    return statistics.quantiles(values, n=100)[percent - 1] if len(values) > 1 else values[0]


def report(load: Load, args: argparse.Namespace) -> None:
    print(
        f"\n{args.nodes} nodes over {STAGES} stages, heartbeat every {HEARTBEAT_S:.0f} s, a receipt per "
        f"{args.round_s:.0f} s round ended in its first {args.receipt_spread:.0%} and sent after a splay of "
        f"up to {args.node_splay:.0%} of the round, {args.seconds:.0f} s, "
        f"{args.workers} verifier worker(s), "
        f"{args.connections} client connections"
    )
    print(
        "| endpoint | requests | p50 ms (sent) | p99 ms (sent) | p50 ms (due) | p99 ms (due) |\n|---|---|---|---|---|---|"
    )
    for path in sorted(load.sent_ms):
        sent, due = load.sent_ms[path], load.due_ms[path]
        print(
            f"| {path} | {len(sent):,} | {q(sent, 50):.0f} | {q(sent, 99):.0f} | {q(due, 50):.0f} | {q(due, 99):.0f} |"
        )
    print("statuses:", ", ".join(f"{p} {s}: {n}" for (p, s), n in sorted(load.status.items(), key=str)))
    errors = sum(n for (_, s), n in load.status.items() if isinstance(s, int) and s >= 500)
    print(f"5xx: {errors}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--db",
        default=os.environ.get(TEST_DATABASE_ENV, "postgresql://127.0.0.1:5432/test"),
        help="PostgreSQL URL (a scratch schema is made in it), or 'sqlite' (then --workers 1)",
    )
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--round-s", type=float, default=20.0)
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument(
        "--receipt-spread",
        type=float,
        default=0.25,
        help="fraction of the round over which the replicas end it (0 < x <= 1); each then waits its splay",
    )
    ap.add_argument(
        "--node-splay",
        type=float,
        default=VerifierClientConfig.receipt_splay,
        help="the nodes' receipt splay: each receipt waits up to this fraction of the round (0: none)",
    )
    ap.add_argument("--kill-after", type=float, help="SIGKILL one worker this many seconds into the load")
    args = parse_with_quick(ap, nodes=40, workers=2, seconds=6.0, round_s=3.0, connections=20)
    if not 0 < args.receipt_spread <= 1:
        ap.error(f"--receipt-spread must be in (0, 1], got {args.receipt_spread}")
    if not 0 <= args.node_splay <= 1:
        ap.error(f"--node-splay must be in [0, 1], got {args.node_splay}")
    if args.quick and args.db == "sqlite":
        args.workers = 1
    backend = "sqlite" if args.db == "sqlite" else "postgresql"
    with (
        tempfile.TemporaryDirectory() as tmp_name,
        scratch_database(backend, Path(tmp_name), {TEST_DATABASE_ENV: args.db}) as url,
    ):
        tmp = Path(tmp_name)
        (tmp / "network.toml").write_text(NETWORK_TOML + f"[stages]\ncount = {STAGES}\n")
        port = free_port()
        verifier = serve(
            [sys.executable, "-m", "neuroshard.cli.verifier", "--network", str(tmp / "network.toml"), "--db", url,
             "--port", str(port), "--home", str(tmp), "--init-operator-key", "--log-level", "warning",
             "--no-evaluation", "--replay-rate", "0", "--workers", str(args.workers)],
            port,
            tmp / "verifier.log",
        )  # fmt: skip
        try:
            load = asyncio.run(main_async(args, url, f"http://127.0.0.1:{port}", verifier.pid))
        finally:
            verifier.terminate()
            verifier.wait(timeout=60)
        report(load, args)


if __name__ == "__main__":
    main()
