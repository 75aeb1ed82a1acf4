import pytest

from neuroshard.testing.verifier import ManualClock
from neuroshard.verifier.ratelimit import RateLimitConfig, RateLimiter


def test_burst_then_refill() -> None:
    clock = ManualClock()
    limiter = RateLimiter(RateLimitConfig(capacity=3, refill_per_s=1.0), clock)
    assert [limiter.acquire("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("a") == pytest.approx(1.0)
    clock.advance(0.5)
    assert limiter.acquire("a") == pytest.approx(0.5)
    clock.advance(0.5)
    assert limiter.acquire("a") == 0.0


def test_buckets_are_per_key() -> None:
    limiter = RateLimiter(RateLimitConfig(capacity=1, refill_per_s=1.0), ManualClock())
    assert limiter.acquire("a") == 0.0
    assert limiter.acquire("a") > 0
    assert limiter.acquire("b") == 0.0


def test_forgotten_wallets_start_full_and_memory_is_bounded() -> None:
    limiter = RateLimiter(RateLimitConfig(capacity=1, refill_per_s=0.001, max_wallets=2), ManualClock())
    for key in ("a", "b", "c"):
        assert limiter.acquire(key) == 0.0
    assert limiter.acquire("a") == 0.0  # "a" was evicted as least recently used
    assert limiter.acquire("c") > 0


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        RateLimitConfig(capacity=0)
