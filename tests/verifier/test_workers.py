"""`neuroshard-verifier --workers 2` on PostgreSQL: real processes on loopback.

Both workers answer and write; exactly one leads the background work and runs the held-out
evaluator and the replay checker (its /metrics says so, the other runs none, and PostgreSQL shows one lease lock); SIGKILL of the leader loses no acknowledged write, the
parent starts a replacement, and another worker takes the lease.
"""

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from neuroshard.node.wallet import Wallet
from neuroshard.testing.api import receipt_doc, start_verifier_process
from neuroshard.testing.ports import free_port
from neuroshard.testing.verifier import scratch_database, signed_json
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database
from neuroshard.verifier.leader import LEADER_LOCK_CLASS

pytestmark = pytest.mark.slow
WALLETS = [Wallet.from_token(f"worker-test-{i}") for i in range(8)]


@pytest.fixture
def pg_url(database_url: str, tmp_path: Path) -> Iterator[str]:
    if not database_url.startswith("postgresql"):
        pytest.skip("several workers need PostgreSQL (SQLite's refusal is in test_cli)")
    with scratch_database("postgresql", tmp_path, os.environ) as url:
        yield url


def post(base: str, signer: Wallet, path: str, doc: object) -> int:
    body, headers = signed_json(signer, path, doc, timestamp=time.time())
    request = urllib.request.Request(base + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def sample_metrics(base: str, requests: int = 64) -> dict[int, int]:
    """worker pid → its background_leader gauge, from `requests` fresh connections, 8 at a time
    (each connection goes to whichever worker accepts it). A leader must be running the
    evaluator, the housekeeping sweep, the replay checker and the vocabulary watch, a follower none."""

    def one(_: int) -> tuple[int, int]:
        with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
            text_ = response.read().decode()
        pid = re.search(r"^neuroshard_worker_pid (\d+)", text_, re.M)
        leader = re.search(r"^neuroshard_background_leader (\d+)", text_, re.M)
        assert pid and leader, text_
        jobs = re.findall(r'^neuroshard_background_jobs\{job="(\w+)"\} (\d+)', text_, re.M)
        expected = (
            [("Evaluator", "1"), ("Housekeeping", "1"), ("ReplayChecker", "1"), ("VocabWatch", "1")]
            if leader.group(1) == "1"
            else []
        )
        assert jobs == expected, text_
        return int(pid.group(1)), int(leader.group(1))

    with ThreadPoolExecutor(8) as pool:
        return dict(pool.map(one, range(requests)))


def children(pid: int) -> set[int]:
    return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def lease_locks(db: Database) -> int:
    with db.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = :cls AND granted "
                    "AND objid::bigint = (hashtext(current_schema())::bigint & 4294967295)"
                ),
                {"cls": LEADER_LOCK_CLASS},
            ).scalar()
            or 0
        )


def write_round(base: str, round_: int) -> list[int]:
    with ThreadPoolExecutor(8) as pool:
        return list(
            pool.map(lambda w: post(base, w, "/api/receipts", receipt_doc(round_, f"{round_:064x}")), WALLETS)
        )


def test_two_workers_serve_write_and_fail_over(pg_url: str, tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    parent = start_verifier_process(tmp_path, pg_url, port, extra_args=["--workers", "2"])
    db = Database(pg_url)
    try:
        deadline = time.monotonic() + 30
        while len(children(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = children(parent.pid)
        assert len(workers) == 2
        deadline = time.monotonic() + 30  # the second worker may still be starting
        seen = sample_metrics(base)
        while set(seen) != workers and time.monotonic() < deadline:
            seen |= sample_metrics(base)
        assert set(seen) == workers, "both workers answer requests"
        assert sorted(seen.values()) == [0, 1], "exactly one worker leads the background work"
        assert lease_locks(db) == 1
        leader = next(pid for pid, flag in seen.items() if flag)

        with ThreadPoolExecutor(8) as pool:
            registered = list(
                pool.map(
                    lambda w: post(base, w, "/api/register", {"address": "http://127.0.0.1:9000", "stage": 0, "software_version": "0.1.0"}),
                    WALLETS,
                )
            )  # fmt: skip
        assert registered == [200] * len(WALLETS)
        acknowledged = 0
        for r in range(3):
            statuses = write_round(base, r)
            assert statuses == [201] * len(WALLETS)
            acknowledged += len(statuses)

        os.kill(leader, signal.SIGKILL)
        deadline = time.monotonic() + 30
        new_leader = None
        while time.monotonic() < deadline:
            workers = children(parent.pid)
            if leader not in workers and len(workers) == 2:
                seen = sample_metrics(base, 16)
                leaders = [pid for pid, flag in seen.items() if flag]
                if leaders:
                    new_leader = leaders[0]
                    break
            time.sleep(0.2)
        assert new_leader is not None and new_leader != leader, "another worker took the lease"
        assert leader not in children(parent.pid) and len(children(parent.pid)) == 2, "a replacement started"
        assert lease_locks(db) == 1

        for r in range(3, 5):
            statuses = write_round(base, r)
            assert statuses == [201] * len(WALLETS)
            acknowledged += len(statuses)
        with db.read() as session:
            stored = session.scalar(select(func.count()).select_from(m.Receipt))
        assert stored == acknowledged == 5 * len(WALLETS)
        # Every (stage, round) before the last is settled exactly once, whichever worker did it:
        # by a receipt, or within a sweep (2 s) by the lease holder's housekeeping when the
        # settlement gate (1 s per stage per worker) let the last receipts pass unsettled.
        deadline = time.monotonic() + 15
        while True:
            with db.read() as session:
                settled = session.scalar(select(func.count()).select_from(m.Round))
            if settled == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert settled == 4
    finally:
        parent.send_signal(signal.SIGTERM)
        try:
            parent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            parent.kill()
            parent.wait()
        db.dispose()
    assert parent.returncode == 0
