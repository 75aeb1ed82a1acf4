"""What every route needs, built once per app and reached through `request.app.state`."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from fastapi import Request

from neuroshard.verifier.config import VerifierConfig
from neuroshard.verifier.db import Database
from neuroshard.verifier.groupcommit import WRITERS, GroupCommit
from neuroshard.verifier.leader import LeaderLease
from neuroshard.verifier.ledger import LedgerConfig
from neuroshard.verifier.network import sign_network
from neuroshard.verifier.ratelimit import RateLimiter

from .cache import ReadCache
from .metrics import RequestCounter

BACKGROUND_CONNECTIONS = WRITERS + 4
"""Connections beyond the request threads: each group-commit writer (verifier.groupcommit), the
read-cache refresher, the evaluator, the replay checker and the leader lease (verifier.leader)
hold at most one. The lease holder's other jobs (the vocabulary watch, the housekeeping sweep)
hold one briefly, from the pool's overflow (verifier.db: 3): 12 + 6 + 3 = 21 a process by
default, so `--workers 4` stays within PostgreSQL's default 100 connections."""


class SettleGate:
    """Whether a receipt should settle its stage now: at most once per `interval_s` per stage in
    this process (VerifierConfig.settle_interval_s), on the monotonic clock."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[int, float] = {}
        self._lock = threading.Lock()

    def due(self, stage: int) -> bool:
        if self.interval_s <= 0:
            return True
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(stage, -self.interval_s) < self.interval_s:
                return False
            self._last[stage] = now
            return True


@dataclass
class Services:
    config: VerifierConfig
    db: Database
    limiter: RateLimiter
    registrations: RateLimiter | None
    """New wallets per source address (verifier.ratelimit.source_key); None: unlimited."""
    ledger: LedgerConfig
    network_body: bytes
    """Canonical JSON of the network definition, exactly the bytes the signature covers."""
    network_signature: str
    requests: RequestCounter
    reads: ReadCache
    settle: SettleGate
    """When a receipt settles its stage (the lead process's housekeeping settles the rest)."""
    writes: GroupCommit
    """Heartbeats and receipts, committed in groups by the writer threads (verifier.groupcommit)."""
    lease: LeaderLease | None = None
    """Set by create_app: whether this process runs the background work (shown in /metrics)."""

    @classmethod
    def build(cls, config: VerifierConfig) -> Services:
        body, signature = sign_network(config.network, config.operator)
        db = Database(config.database_url, pool_size=config.request_threads + BACKGROUND_CONNECTIONS)
        return cls(
            config=config,
            db=db,
            limiter=RateLimiter(config.rate_limit, config.clock),
            registrations=(
                config.registration_limit.limiter(config.clock)
                if config.registration_limit is not None
                else None
            ),
            ledger=LedgerConfig(
                reputation=config.reputation,
                num_stages=config.network.num_stages,
                nonce_window_s=config.freshness_window_s,
                peer_ttl_s=config.peer_ttl_s,
                settle_after_rounds=config.settle_after_rounds,
                membership=config.membership,
                network_name=config.network.name,
                registration_pow_bits=config.registration_pow_bits,
            ),
            network_body=body,
            network_signature=signature,
            requests=RequestCounter(),
            reads=ReadCache(config.reads, clock=config.clock, generation=lambda: db.generation),
            settle=SettleGate(config.settle_interval_s),
            writes=GroupCommit(db),
        )

    def now(self) -> float:
        return self.config.clock()


def services_of(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


async def get_services(request: Request) -> Services:
    """The app's Services as a FastAPI dependency. Async so that FastAPI calls it on the event
    loop: a sync dependency costs every request a hop to the thread pool and back."""
    return services_of(request)
