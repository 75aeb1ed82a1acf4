"""`training_verified`: is the global model really learning, judged from measured loss only.

The verifier evaluates the majority model on a held-out shard no node trains on
(verifier.evaluate) and records each measurement. Training counts as verified when

    n ≥ min_evaluations   and   last < first − max(min_drop, stderr_multiplier · se)

with se = sqrt(se_first² + se_last²), the standard error of the difference of the two
measurements (each se is the standard error of the mean over evaluation batches; 0 when
unknown). With the defaults: at least 3 evaluations, and the newest held-out loss at least
0.05 nats, and at least two standard errors, below the first one. 0.05 nats is ~5% in
perplexity: well above the noise of a few-thousand-token evaluation on a fixed held-out
shard, well below what even one DiLoCo round of real training removes from a fresh model.

Self-reported training losses from receipts are shown beside this verdict and never feed it:
a node can write any number into a receipt, but it cannot change what θ scores on data it
never saw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Trend = Literal["falling", "flat", "rising", "unknown"]


@dataclass(kw_only=True)
class VerdictConfig:
    min_evaluations: int = 3
    """Fewer measurements cannot tell a trend from the noise of one lucky evaluation."""
    min_drop: float = 0.05
    """Nats the measured loss must fall since the first evaluation, at least."""
    stderr_multiplier: float = 2.0
    """The fall must also exceed this many standard errors of the difference (~95% one-sided)."""
    trend_window: int = 5
    """Most recent evaluations the trend (least-squares slope) is fitted over."""
    flat_tolerance: float = 0.01
    """A fitted change smaller than this over the trend window (nats) is 'flat'."""

    def __post_init__(self) -> None:
        if self.min_evaluations < 2 or self.min_drop < 0 or self.stderr_multiplier < 0:
            raise ValueError(
                f"VerdictConfig needs min_evaluations ≥ 2 ({self.min_evaluations}), "
                f"min_drop ≥ 0 ({self.min_drop}), stderr_multiplier ≥ 0 ({self.stderr_multiplier})"
            )
        if self.trend_window < 2:
            raise ValueError(f"VerdictConfig.trend_window must be ≥ 2, got {self.trend_window}")


@dataclass(frozen=True)
class LossPoint:
    """One measured held-out loss."""

    round: int
    loss: float
    stderr: float | None = None


@dataclass(frozen=True)
class Verdict:
    training_verified: bool
    reason: str
    evaluations: int
    first_loss: float | None
    last_loss: float | None
    drop: float | None
    """first − last (positive when the loss fell)."""
    required_drop: float | None
    trend: Trend
    """'unknown' with fewer than 2 evaluations."""
    slope: float | None
    """Least-squares slope of the recent measured losses, nats per round."""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def loss_trend(points: Sequence[LossPoint], cfg: VerdictConfig) -> tuple[Trend, float | None]:
    """Label and least-squares slope (nats per round) over the last `trend_window` points."""
    recent = list(points)[-cfg.trend_window :]
    if len(recent) < 2:
        return "unknown", None
    xs = [float(p.round) for p in recent]
    ys = [p.loss for p in recent]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:  # every point from the same round: compare first and last instead
        change = ys[-1] - ys[0]
        slope = None
    else:
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        change = slope * (xs[-1] - xs[0])
    if not math.isfinite(change):
        return "unknown", None
    if change < -cfg.flat_tolerance:
        return "falling", slope
    if change > cfg.flat_tolerance:
        return "rising", slope
    return "flat", slope


def judge_training(points: Sequence[LossPoint], cfg: VerdictConfig) -> Verdict:
    """The verdict from measured losses in evaluation order (oldest first)."""
    n = len(points)
    trend, slope = loss_trend(points, cfg)
    if n == 0:
        return Verdict(
            training_verified=False,
            reason=f"insufficient data: 0 evaluations, need {cfg.min_evaluations}",
            evaluations=0,
            first_loss=None,
            last_loss=None,
            drop=None,
            required_drop=None,
            trend=trend,
            slope=slope,
        )
    first, last = points[0], points[-1]
    se = math.hypot(first.stderr or 0.0, last.stderr or 0.0)
    required = max(cfg.min_drop, cfg.stderr_multiplier * se)
    drop = first.loss - last.loss

    def verdict(ok: bool, reason: str) -> Verdict:
        return Verdict(
            training_verified=ok,
            reason=reason,
            evaluations=n,
            first_loss=first.loss,
            last_loss=last.loss,
            drop=drop if math.isfinite(drop) else None,
            required_drop=required,
            trend=trend,
            slope=slope,
        )

    if not (math.isfinite(first.loss) and math.isfinite(last.loss)):
        return verdict(False, f"measured loss is not finite (first {first.loss}, last {last.loss})")
    if n < cfg.min_evaluations:
        return verdict(False, f"insufficient data: {_plural(n, 'evaluation')}, need {cfg.min_evaluations}")
    fell = (
        f"measured held-out loss {first.loss:.4f} (round {first.round}) → {last.loss:.4f} "
        f"(round {last.round}): fell {drop:.4f} nats"
    )
    needed = f"{required:.4f} required = max({cfg.min_drop:g}, {cfg.stderr_multiplier:g}·stderr {se:.4f})"
    if drop >= required:
        return verdict(True, f"{fell} over {_plural(n, 'evaluation')}, ≥ {needed}")
    return verdict(False, f"not learning yet: {fell}, < {needed}")
