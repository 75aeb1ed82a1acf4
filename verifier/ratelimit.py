"""Per-wallet token buckets for the signed write endpoints.

In memory on purpose: a limit only has to hold within one verifier process, and losing
the buckets on restart merely forgives everybody once. Checked after the signature, so a
stranger cannot drain another wallet's bucket.
"""

from __future__ import annotations

import ipaddress
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(kw_only=True)
class RateLimitConfig:
    capacity: float = 30.0
    """Burst: requests a wallet may send back to back. A node needs 1 register + 1 receipt per
    round + 1 heartbeat every few seconds, so 30 absorbs restarts and retries."""
    refill_per_s: float = 2.0
    """Sustained requests per second per wallet."""
    max_wallets: int = 100_000
    """Buckets kept; the least recently used is forgotten beyond this (bounds memory under a flood
    of fresh wallets, each of which still had to sign its requests)."""

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.refill_per_s <= 0 or self.max_wallets < 1:
            raise ValueError(
                f"RateLimitConfig needs capacity ≥ 1 ({self.capacity}), refill_per_s > 0 "
                f"({self.refill_per_s}) and max_wallets ≥ 1 ({self.max_wallets})"
            )


class RateLimiter:
    """Token bucket per key: `capacity` tokens, refilled at `refill_per_s`, one per request."""

    def __init__(self, config: RateLimitConfig, clock: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)
        self._lock = threading.Lock()

    def acquire(self, key: str) -> float:
        """Take one token for `key`: 0.0 when granted, else the seconds until one is available."""
        cfg = self._config
        with self._lock:
            now = self._clock()
            tokens, at = self._buckets.pop(key, (cfg.capacity, now))
            tokens = min(cfg.capacity, tokens + max(0.0, now - at) * cfg.refill_per_s)
            wait = 0.0
            if tokens >= 1.0:
                tokens -= 1.0
            else:
                wait = (1.0 - tokens) / cfg.refill_per_s
            self._buckets[key] = (tokens, now)
            while len(self._buckets) > cfg.max_wallets:
                self._buckets.popitem(last=False)
            return wait


@dataclass(kw_only=True)
class SourceLimitConfig:
    """Registrations of new wallets per source address (issue 19): minting wallets from one
    machine costs time as well as the proof of work. Sources are IPv4 addresses and IPv6 /64
    prefixes (one subscriber's allocation: a host has 2^64 addresses to rotate through)."""

    capacity: float = 20.0
    """Burst: new wallets one source may register back to back."""
    per_hour: float = 60.0
    """Sustained new wallets per source per hour."""
    exempt_loopback: bool = True
    """127.0.0.0/8 and ::1 are not limited: the local swarm, the benchmarks and a reverse proxy on
    the same host (uvicorn takes the client from X-Forwarded-For when the proxy is trusted)."""

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.per_hour <= 0:
            raise ValueError(
                f"SourceLimitConfig needs capacity ≥ 1 ({self.capacity}) and per_hour > 0 ({self.per_hour})"
            )

    def limiter(self, clock: Callable[[], float]) -> RateLimiter:
        return RateLimiter(
            RateLimitConfig(capacity=self.capacity, refill_per_s=self.per_hour / 3600.0), clock
        )


def source_key(host: str | None, *, exempt_loopback: bool) -> str | None:
    """The bucket a client address falls in; None when it is not limited (loopback, if exempt)."""
    if host is None:
        return "unknown"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]  # not an IP (a test client's name, a Unix socket)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if exempt_loopback and address.is_loopback:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)
