"""The plateau test rotates off a shard whose loss stopped falling, and only then."""

import random

import pytest

from neuroshard.node.rotation import PlateauDetector, RotationConfig

CONFIG = RotationConfig(min_steps=100, window=20, z=1.0)


def test_flat_noisy_loss_rotates_right_after_min_steps() -> None:
    rng = random.Random(0)
    detector = PlateauDetector(CONFIG)
    decisions = [detector.observe(3.0 + rng.gauss(0, 0.2)) for _ in range(200)]
    assert not any(decisions[:99])
    assert any(decisions[99:110])


def test_steadily_falling_loss_never_rotates() -> None:
    rng = random.Random(1)
    detector = PlateauDetector(CONFIG)
    assert not any(detector.observe(6.0 - 0.01 * step + rng.gauss(0, 0.05)) for step in range(400))


def test_reset_starts_the_count_again() -> None:
    detector = PlateauDetector(CONFIG)
    for _ in range(150):
        detector.observe(2.0)
    detector.reset()
    assert not any(detector.observe(2.0) for _ in range(99))


def test_disabled_never_rotates() -> None:
    detector = PlateauDetector(RotationConfig(min_steps=100, window=20, enabled=False))
    assert not any(detector.observe(2.0) for _ in range(500))


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match=r"min_steps \(10\) must be >= 2 \* window \(40\)"):
        RotationConfig(min_steps=10, window=20)
