"""Per-wallet token buckets for the signed write endpoints.

In memory on purpose: a limit only has to hold within one verifier process, and losing
the buckets on restart merely forgives everybody once. Checked after the signature, so a
stranger cannot drain another wallet's bucket.
"""

from __future__ import annotations

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
