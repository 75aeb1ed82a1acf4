"""kill -9 the verifier while nodes submit receipts: every acknowledged receipt is there after a restart."""

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from neuroshard.node.wallet import Wallet
from neuroshard.testing.api import start_verifier_process
from neuroshard.testing.ports import free_port
from neuroshard.testing.verifier import signed_json
from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database

THREADS = 4
WALLETS_PER_THREAD = 3
"""Receipts rotate over several wallets so no wallet exceeds its rate-limit burst (30)."""


def post(client: httpx.Client, wallet: Wallet, path: str, doc: dict[str, object]) -> httpx.Response:
    body, headers = signed_json(wallet, path, doc, timestamp=time.time())
    return client.post(path, content=body, headers=headers)


def receipt(round_: int) -> dict[str, object]:
    return {
        "stage": 0,
        "round": round_,
        "inner_steps": 4,
        "start_step": 4 * round_,
        "tokens": 256,
        "data": [{"shard_id": 0, "offset_start": 0, "offset_end": 8}],
        "losses": [5.0, 4.9, 4.8, 4.7],
        "base_hash": "0" * 64,
        "result_hash": f"{round_:064x}",
        "delta_digest": "d" * 64,
    }


@pytest.mark.slow
def test_kill_9_loses_no_acknowledged_receipt(tmp_path: Path, database_url: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = start_verifier_process(tmp_path, database_url, port)
    wallets = [
        [Wallet.from_token(f"durable-{t}-{k}") for k in range(WALLETS_PER_THREAD)] for t in range(THREADS)
    ]
    acknowledged: list[tuple[str, int]] = []
    lock = threading.Lock()
    try:
        with httpx.Client(base_url=base, timeout=5) as client:
            for group in wallets:
                for w in group:
                    doc = {"address": "http://127.0.0.1:9000", "stage": 0, "software_version": "0.1.0"}
                    assert post(client, w, "/api/register", doc).status_code == 200

        def submit(group: list[Wallet]) -> None:
            with httpx.Client(base_url=base, timeout=5) as client:
                for round_ in range(25):
                    for w in group:
                        try:
                            r = post(client, w, "/api/receipts", receipt(round_))
                        except httpx.TransportError:
                            return  # the verifier is gone
                        if r.is_success:
                            with lock:
                                acknowledged.append((w.wallet_id, round_))

        threads = [threading.Thread(target=submit, args=(g,)) for g in wallets]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with lock:
                if len(acknowledged) >= 40:
                    break
            time.sleep(0.005)
        os.kill(process.pid, signal.SIGKILL)  # mid-stream: requests are in flight
        process.wait(timeout=10)
        for t in threads:
            t.join(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert len(acknowledged) >= 40

    restarted = start_verifier_process(tmp_path, database_url, port)  # upgrade head on the existing data
    try:
        db = Database(database_url)
        with db.read() as session:
            stored = {(w, r) for w, r in session.execute(select(m.Receipt.wallet_id, m.Receipt.round))}
        db.dispose()
        missing = set(acknowledged) - stored
        assert not missing, f"{len(missing)} acknowledged receipts lost: {sorted(missing)[:5]}"
        assert httpx.get(f"{base}/api/training/global", timeout=5).json()["total_inner_steps"] == 4 * len(
            stored
        )
    finally:
        restarted.terminate()
        restarted.wait(timeout=10)
