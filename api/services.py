"""What every route needs, built once per app and reached through `request.app.state`."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from neuroshard.verifier.config import VerifierConfig
from neuroshard.verifier.db import Database
from neuroshard.verifier.leader import LeaderLease
from neuroshard.verifier.ledger import LedgerConfig
from neuroshard.verifier.network import sign_network
from neuroshard.verifier.ratelimit import RateLimiter

from .cache import ReadCache
from .metrics import RequestCounter

BACKGROUND_CONNECTIONS = 4
"""Connections beyond the request threads: the read-cache refresher, the evaluator, the replay
checker and the leader lease (verifier.leader) each hold at most one."""


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
        )

    def now(self) -> float:
        return self.config.clock()


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services
