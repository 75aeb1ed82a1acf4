"""What a replica keeps so the verifier can replay one of its rounds (verifier.replaycheck).

A spot check re-runs a round's inner steps and is exact only from the inner AdamW state
the replica had at the round's start (DiLoCo keeps the moments across rounds; without them
a replay reaches cosine ~0.66, tests/verifier/test_spotcheck.py). So the replica snapshots
that state when a round starts, commits to its digest in the round's receipt, and keeps
(θ_round, inner state, Δ) for the last few rounds to serve when challenged. Committing
before the challenge is the point: a replica cannot pick a state after it knows which
round is checked.

Pure torch and plain Python: the peer route that serves these is node.p2p.replay.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from .diloco import DiLoCo

ADAM_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})


@dataclass(frozen=True)
class InnerState:
    """AdamW's per-parameter state flattened in parameter order: the first and second moments
    as (d,) float32 vectors and the step count of each parameter tensor (k,) float32. A fresh
    optimizer is all zeros."""

    exp_avg: Tensor
    exp_avg_sq: Tensor
    steps: Tensor

    def digest(self) -> str:
        """sha256 over steps, exp_avg, exp_avg_sq as little-endian float32: the receipt's commitment."""
        h = hashlib.sha256()
        for t in (self.steps, self.exp_avg, self.exp_avg_sq):
            h.update(t.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes())
        return h.hexdigest()


def capture_inner_state(diloco: DiLoCo) -> InnerState | None:
    """A copy of the engine's inner AdamW state now; None for an optimizer that is not AdamW-shaped
    (a custom factory), which replay cannot reproduce."""
    moments: list[Tensor] = []
    squares: list[Tensor] = []
    steps: list[float] = []
    for p in diloco.params:
        state = diloco.inner_optimizer.state.get(p, {})
        if state and set(state) != ADAM_KEYS:
            return None
        if state:
            # On the CPU in float32 whatever the training device: the digest and the peer route read it.
            moments.append(state["exp_avg"].detach().reshape(-1).to("cpu", torch.float32))
            squares.append(state["exp_avg_sq"].detach().reshape(-1).to("cpu", torch.float32))
            steps.append(float(state["step"]))
        else:
            moments.append(torch.zeros(p.numel()))
            squares.append(torch.zeros(p.numel()))
            steps.append(0.0)
    return InnerState(
        exp_avg=torch.cat(moments),
        exp_avg_sq=torch.cat(squares),
        steps=torch.tensor(steps, dtype=torch.float32),
    )


def install_inner_state(diloco: DiLoCo, inner: InnerState) -> None:
    """Load `inner` into the engine's AdamW (copies: later steps leave `inner` as it was).
    Parameters with step 0 keep no state, exactly as a fresh optimizer has none."""
    numel = sum(p.numel() for p in diloco.params)
    if inner.exp_avg.shape != (numel,) or inner.exp_avg_sq.shape != (numel,):
        raise ValueError(
            f"inner state moments have shapes {tuple(inner.exp_avg.shape)}, {tuple(inner.exp_avg_sq.shape)}; "
            f"the model needs ({numel},)"
        )
    if inner.steps.shape != (len(diloco.params),):
        raise ValueError(
            f"inner state has {inner.steps.numel()} step counts for {len(diloco.params)} parameters"
        )
    diloco.inner_optimizer.state.clear()
    offset = 0
    for p, step in zip(diloco.params, inner.steps.tolist(), strict=True):
        n = p.numel()
        if step > 0:
            exp_avg = inner.exp_avg[offset : offset + n].view_as(p)
            exp_avg_sq = inner.exp_avg_sq[offset : offset + n].view_as(p)
            diloco.inner_optimizer.state[p] = {
                # fused AdamW keeps `step` as a float32 scalar tensor on the parameter's device
                "step": torch.tensor(step, dtype=torch.float32, device=p.device),
                # copies on the parameter's device: a state captured on one device installs on another
                "exp_avg": exp_avg.to(p.device, p.dtype, copy=True),
                "exp_avg_sq": exp_avg_sq.to(p.device, p.dtype, copy=True),
            }
        offset += n


def fresh_inner_digest(numel: int, n_tensors: int) -> str:
    """`InnerState.digest()` of a fresh optimizer (all zeros) for `numel` values in `n_tensors`
    parameter tensors, hashed in 1 MiB pieces instead of allocating 8 bytes per value."""
    h = hashlib.sha256()
    h.update(bytes(4 * n_tensors))
    piece = bytes(1 << 20)
    for _ in range(2):  # exp_avg, then exp_avg_sq
        left = 4 * numel
        while left:
            take = min(left, len(piece))
            h.update(piece[:take] if take < len(piece) else piece)
            left -= take
    return h.hexdigest()


def reset_inner_state(diloco: DiLoCo) -> bool:
    """Drop the engine's inner AdamW state (a fresh optimizer's); whether there was any."""
    had = bool(diloco.inner_optimizer.state)
    diloco.inner_optimizer.state.clear()
    return had


@dataclass(frozen=True)
class ReplayRecord:
    """One round as the replica ran it: its start θ_round, inner state at the start, and its Δ."""

    round: int
    theta_round: Tensor
    inner: InnerState
    delta: Tensor


class ReplayArchive:
    """The last `keep_rounds` ReplayRecords; the training thread adds, the peer server reads."""

    def __init__(self, keep_rounds: int = 4) -> None:
        if keep_rounds < 1:
            raise ValueError(f"ReplayArchive keeps at least one round, got keep_rounds={keep_rounds}")
        self.keep_rounds = keep_rounds
        self._records: OrderedDict[int, ReplayRecord] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, record: ReplayRecord) -> None:
        with self._lock:
            self._records.pop(record.round, None)
            self._records[record.round] = record
            while len(self._records) > self.keep_rounds:
                self._records.popitem(last=False)

    def get(self, round_: int) -> ReplayRecord | None:
        with self._lock:
            return self._records.get(round_)

    def rounds(self) -> list[int]:
        with self._lock:
            return list(self._records)
