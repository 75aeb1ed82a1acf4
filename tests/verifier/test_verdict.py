import math

import pytest

from neuroshard.verifier.verdict import LossPoint, VerdictConfig, judge_training, loss_trend

CFG = VerdictConfig()


def points(*losses: float, stderr: float | None = None) -> list[LossPoint]:
    return [LossPoint(round=5 * i, loss=x, stderr=stderr) for i, x in enumerate(losses)]


def test_no_evaluations() -> None:
    v = judge_training([], CFG)
    assert not v.training_verified
    assert v.reason == "insufficient data: 0 evaluations, need 3"
    assert v.trend == "unknown"


def test_one_evaluation_says_so_in_words() -> None:
    v = judge_training(points(6.0), CFG)
    assert not v.training_verified
    assert v.reason == "insufficient data: 1 evaluation, need 3"


def test_two_falling_evaluations_are_still_not_enough() -> None:
    v = judge_training(points(6.0, 3.0), CFG)
    assert not v.training_verified
    assert v.reason == "insufficient data: 2 evaluations, need 3"
    assert v.trend == "falling"


def test_a_clear_fall_over_three_evaluations_is_verified() -> None:
    v = judge_training(points(6.2, 5.5, 4.9), CFG)
    assert v.training_verified
    assert v.drop == pytest.approx(1.3)
    assert v.required_drop == pytest.approx(0.05)
    assert "fell 1.3000 nats" in v.reason


def test_a_fall_below_the_minimum_is_not_learning() -> None:
    v = judge_training(points(6.00, 5.99, 5.97), CFG)
    assert not v.training_verified
    assert v.reason.startswith("not learning yet")


def test_noisy_measurements_need_a_fall_beyond_two_standard_errors() -> None:
    # se of the difference = hypot(0.1, 0.1) ≈ 0.1414, so 2·se ≈ 0.283 > the 0.2 fall
    v = judge_training(points(6.0, 5.9, 5.8, stderr=0.1), CFG)
    assert not v.training_verified
    assert v.required_drop == pytest.approx(2 * math.hypot(0.1, 0.1))
    assert judge_training(points(6.0, 5.9, 5.6, stderr=0.1), CFG).training_verified


def test_rising_loss_is_not_verified_even_if_a_middle_point_dipped() -> None:
    v = judge_training(points(6.0, 4.0, 6.5), CFG)
    assert not v.training_verified
    assert v.drop == pytest.approx(-0.5)


def test_non_finite_measurements_are_never_verified() -> None:
    v = judge_training(points(6.0, 5.0, float("nan")), CFG)
    assert not v.training_verified
    assert "not finite" in v.reason


def test_trend_labels() -> None:
    assert loss_trend(points(5.0, 5.0, 5.0), CFG)[0] == "flat"
    assert loss_trend(points(5.0, 5.5, 6.0), CFG)[0] == "rising"
    label, slope = loss_trend(points(6.0, 5.0, 4.0), CFG)
    assert label == "falling"
    assert slope == pytest.approx(-0.2)  # -1 nat per 5 rounds


def test_trend_uses_only_the_recent_window() -> None:
    old_fall_then_flat = points(9.0, 5.0, 5.0, 5.0, 5.0, 5.0)
    assert loss_trend(old_fall_then_flat, VerdictConfig(trend_window=5))[0] == "flat"


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="min_evaluations"):
        VerdictConfig(min_evaluations=1)
