"""When to leave a shard early: a windowed test on the training loss.

A node moves to its next shard when the current one is exhausted (BatchStream does that)
or when the loss has stopped improving on it: after at least `min_steps` inner steps on
the shard, the mean loss of the last `window` steps is compared with the `window` before
them; if the fall is smaller than `z` standard errors of the difference (a one-sided
Welch-style test), more steps on this shard are not paying and the node rotates.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import fmean, variance
from typing import Any


@dataclass(kw_only=True)
class RotationConfig:
    min_steps: int = 300
    """Inner steps on a shard before a plateau can end it (a fresh shard's loss is noisy at first)."""
    window: int = 50
    """Steps per window; the test compares the last two windows."""
    z: float = 1.0
    """Rotate when the loss fell by less than this many standard errors between the windows."""
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"window must be >= 2 to estimate a variance, got {self.window}")
        if self.min_steps < 2 * self.window:
            raise ValueError(f"min_steps ({self.min_steps}) must be >= 2 * window ({2 * self.window})")


class PlateauDetector:
    """Feed it each inner step's loss; it says when the current shard has plateaued."""

    def __init__(self, config: RotationConfig) -> None:
        self.config = config
        self._losses: deque[float] = deque(maxlen=2 * config.window)
        self._steps = 0

    def reset(self) -> None:
        """Call when the node starts a new shard."""
        self._losses.clear()
        self._steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Steps on the current shard and the recent losses: checkpointed so a resume rotates when
        an uninterrupted run would."""
        return {"steps": self._steps, "losses": list(self._losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps = int(state["steps"])
        self._losses.clear()
        self._losses.extend(float(x) for x in state["losses"])

    def observe(self, loss: float) -> bool:
        """Record one step's loss; True when the node should rotate to its next shard now."""
        self._steps += 1
        self._losses.append(loss)
        cfg = self.config
        if not cfg.enabled or self._steps < cfg.min_steps or len(self._losses) < 2 * cfg.window:
            return False
        losses = list(self._losses)
        before, recent = losses[: cfg.window], losses[cfg.window :]
        fall = fmean(before) - fmean(recent)
        stderr = math.sqrt(variance(before) / cfg.window + variance(recent) / cfg.window)
        return fall < cfg.z * stderr
