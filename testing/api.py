"""Test helpers for the verifier's HTTP API: an app on a scratch database with a hand-moved
clock, and signed requests. Imported by tests only.

Starlette's TestClient is built on httpx2 (it falls back to httpx with a deprecation warning,
an error under our pytest settings), so responses here are httpx2 responses."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from neuroshard.api.services import Services
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.signing import sign_request
from neuroshard.testing.verifier import ManualClock, signed_json, small_network
from neuroshard.verifier import models as m
from neuroshard.verifier.config import ReadCacheConfig, VerifierConfig
from neuroshard.verifier.housekeeping import HousekeepingConfig
from neuroshard.verifier.ratelimit import RateLimitConfig

OPERATOR = Wallet.from_token("test-operator")
ADDRESS = "http://127.0.0.1:9000"


def test_config(database_url: str, clock: ManualClock, **overrides: Any) -> VerifierConfig:
    """A verifier on `database_url` with the small test network; rate limits (per wallet, and new
    wallets per source) out of the way, reads re-rendered by the request that finds them stale
    and every receipt settling its stage, so a test reads its own writes."""
    fields: dict[str, Any] = {
        "database_url": database_url,
        "network": small_network(),
        "operator": OPERATOR,
        "clock": clock,
        "rate_limit": RateLimitConfig(capacity=1000, refill_per_s=1000),
        "registration_limit": None,
        "reads": ReadCacheConfig(background=False, min_interval_s=0.0),
        "settle_interval_s": 0.0,
        # No sweep behind the test's back (it would settle rounds and stale the reads on its
        # own schedule); tests that want one run Housekeeping.run_once themselves.
        "housekeeping": HousekeepingConfig(period_s=3600.0),
        **overrides,
    }
    return VerifierConfig(**fields)


test_config.__test__ = False  # type: ignore[attr-defined]  # not a pytest test despite the name


def receipt_doc(round_: int, result_hash: str, **overrides: Any) -> dict[str, Any]:
    """A valid stage-0 receipt body for `round_` whose base hash is the previous round's f'{r:064x}'."""
    doc: dict[str, Any] = {
        "stage": 0,
        "round": round_,
        "inner_steps": 4,
        "start_step": 4 * round_,
        "tokens": 256,
        "data": [{"shard_id": round_ % 5, "offset_start": 0, "offset_end": 8}],
        "losses": [6.0 - 0.1 * round_] * 4,
        "base_hash": f"{round_ - 1:064x}" if round_ else "0" * 64,
        "result_hash": result_hash,
        "delta_digest": "d" * 64,
        "accepted": [],
        "rejected": [],
        "equivocators": [],
    }
    doc.update(overrides)
    return doc


@dataclass
class Harness:
    client: TestClient
    clock: ManualClock
    config: VerifierConfig

    @property
    def services(self) -> Services:
        services: Services = self.client.app.state.services  # type: ignore[attr-defined]
        return services

    def post(self, signer: Wallet, path: str, doc: Any, *, skew: float = 0.0) -> httpx2.Response:
        body, headers = signed_json(signer, path, doc, timestamp=self.clock() + skew)
        return self.client.post(path, content=body, headers=headers)

    def post_raw(self, signer: Wallet, path: str, body: bytes) -> httpx2.Response:
        """Sign and send exact bytes (malformed JSON, NaN, …)."""
        headers = sign_request(signer, "POST", path, body, now=self.clock())
        headers["Content-Type"] = "application/json"
        return self.client.post(path, content=body, headers=headers)

    def register(self, wallet: Wallet, stage: int = 0, address: str = ADDRESS) -> httpx2.Response:
        doc = {"address": address, "stage": stage, "software_version": "0.1.0"}
        response = self.post(wallet, "/api/register", doc)
        if response.status_code != 200:
            raise AssertionError(f"registration failed: {response.status_code} {response.text}")
        return response

    def count(self, table: type[m.Base]) -> int:
        with self.services.db.read() as session:
            return session.scalar(select(func.count()).select_from(table)) or 0

    def counts(self) -> dict[str, int]:
        tables: tuple[type[m.Base], ...] = (
            m.Wallet,
            m.Peer,
            m.Receipt,
            m.Nonce,
            m.HashVote,
            m.Round,
            m.ReputationEvent,
        )
        return {str(t.__tablename__): self.count(t) for t in tables}


SMALL_NETWORK_TOML = """
name = "test"
[model]
size = "tiny"
vocab_size = 512
[data]
manifest_url = "http://127.0.0.1:1/"
publisher_key = "%s"
""" % ("ab" * 32)


def start_verifier_process(
    directory: Path,
    database_url: str,
    port: int,
    *,
    network_toml: str = SMALL_NETWORK_TOML,
    timeout_s: float = 60.0,
    extra_args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """`python -m neuroshard.cli.verifier` on loopback, returned once it answers; output in
    directory/verifier-PORT.log. The caller stops it (terminate, or kill for crash tests)."""
    network = directory / "network.toml"
    network.write_text(network_toml)
    argv = [
        sys.executable,
        "-m",
        "neuroshard.cli.verifier",
        "--network",
        str(network),
        "--db",
        database_url,
        "--port",
        str(port),
        "--home",
        str(directory),
        "--init-operator-key",
        "--log-level",
        "warning",
        *extra_args,
    ]
    log_path = directory / f"verifier-{port}.log"
    with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=directory)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"verifier exited with {process.returncode}: {log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/training/verify", timeout=1) as r:
                if r.status == 200:
                    return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    process.wait()
    raise RuntimeError(f"verifier did not answer within {timeout_s:.0f} s: {log_path.read_text()}")
