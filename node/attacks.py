"""Byzantine attack transforms on contributions, for tests and benchmarks only.

Each is a pure function of what the attacker holds: its own honest Δ (d,), and — since
colluding attackers share what they observe — the honest contributions of the same round
(m, d). Random attacks take a ``torch.Generator`` so runs are reproducible. Nothing here
touches the network: the swarm's ``--attack`` flag will call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import NormalDist

import torch
from torch import Tensor

ATTACKS = (
    "sign_flip",
    "scale",
    "gaussian",
    "zero",
    "copy",
    "alie",
    "ipm",
    "stale",
    "nan",
    "equivocate",
    "wrong_base",
)
"""The attack modes of issue 5, one word each, as the CLI will name them."""


def sign_flip(delta: Tensor) -> Tensor:
    """−Δ: pushes the model up the loss by as much as the attacker's honest Δ pushes it down."""
    return -delta


def scale(delta: Tensor, k: float) -> Tensor:
    """k·Δ: a boosted (k > 1) or shrunk contribution; with the plain mean one replica of
    k ≫ n steers the whole update (the model-replacement idea of Bagdasaryan et al. 2020)."""
    return delta * k


def gaussian(like: Tensor, sigma: float, generator: torch.Generator) -> Tensor:
    """Pure noise N(0, σ²) of Δ's shape and dtype, sent instead of a Δ (the Gaussian attack of
    Xie, Koyejo & Gupta 2018, "Generalized Byzantine-tolerant SGD")."""
    return torch.randn(like.shape, generator=generator, dtype=like.dtype) * sigma


def zero(delta: Tensor) -> Tensor:
    """An all-zero Δ: a free rider that claims the round without training."""
    return torch.zeros_like(delta)


def copy(source: Tensor, noise: float = 0.0, generator: torch.Generator | None = None) -> Tensor:
    """Another wallet's Δ replayed as one's own, exactly (noise = 0) or with Gaussian noise of
    relative L2 norm exactly ``noise`` (0.01 = 1%), so ‖copy − source‖ = noise·‖source‖."""
    if noise == 0:
        return source.clone()
    if generator is None:
        raise ValueError("copy with noise > 0 needs a generator (seeded, for reproducible runs)")
    direction = torch.randn(source.shape, generator=generator, dtype=source.dtype)
    return source + direction * (noise * source.norm() / direction.norm())


def alie_z(n: int, f: int) -> float:
    """z_max of "A little is enough" (Baruch, Baruch & Goldberg 2019, NeurIPS), Eq. 3-4: with
    s = ⌊n/2 + 1⌋ − f honest supporters needed, z = Φ⁻¹((n − s) / n). E.g. n=10, f=2: 0.25."""
    if not 0 < f < n:
        raise ValueError(f"alie_z needs 0 < f < n, got n={n}, f={f}")
    s = (n // 2 + 1) - f
    return NormalDist().inv_cdf((n - s) / n)


def alie(honest: Tensor, n: int, f: int, z: float | None = None) -> Tensor:
    """Per coordinate μ + z·σ of the honest contributions (m, d) → (d,) (Baruch et al. 2019).

    Stays within z standard deviations of the honest mean in every coordinate, so it looks
    honest to per-coordinate and distance-based defences while biasing every coordinate the
    same way. ``z=None`` uses ``alie_z(n, f)`` for n contributions of which f are Byzantine.
    """
    z = alie_z(n, f) if z is None else z
    mu = honest.mean(dim=0)
    sigma = honest.std(dim=0) if honest.shape[0] > 1 else torch.zeros_like(mu)
    return mu + z * sigma


def ipm(honest: Tensor, epsilon: float) -> Tensor:
    """Inner product manipulation (Xie, Koyejo & Gupta 2020, "Fall of empires", UAI): −ε·mean of
    the honest contributions (m, d) → (d,), so the aggregate's inner product with the true
    gradient turns small (small ε fools robust rules) or negative (large ε breaks the mean)."""
    return -epsilon * honest.mean(dim=0)


def stale(past: Sequence[Tensor], k: int) -> Tensor:
    """The Δ from k rounds ago: ``past`` holds this attacker's Δs oldest first, the current one last."""
    if not 1 <= k < len(past):
        raise ValueError(f"stale needs 1 <= k < len(past); got k={k}, {len(past)} rounds of history")
    return past[-1 - k].clone()


def nan(delta: Tensor, count: int | None = 1, generator: torch.Generator | None = None) -> Tensor:
    """Δ with ``count`` coordinates set to NaN (all of them for None). One NaN suffices to poison
    a mean, and a single bad value in 10⁵ is what a buggy node, not just a malicious one, sends."""
    out = delta.clone()
    if count is None:
        return out.fill_(float("nan"))
    if not 1 <= count <= delta.numel():
        raise ValueError(f"nan needs 1 <= count <= {delta.numel()}, got {count}")
    where = torch.randperm(delta.numel(), generator=generator)[:count]
    out.view(-1)[where] = float("nan")
    return out


def equivocate(delta: Tensor, generator: torch.Generator, spread: float = 0.1) -> tuple[Tensor, Tensor]:
    """Two different valid-looking Δs for different peers: Δ itself, and Δ plus Gaussian noise of
    relative norm ``spread``. Each passes validation where it is seen; only comparing the
    digests peers received (the network's job) shows two payloads for one wallet and round."""
    return delta.clone(), copy(delta, spread, generator)


def wrong_base(delta: Tensor, theta_now: Tensor, theta_old: Tensor) -> Tensor:
    """A Δ trained from an old θ but sent against the current one: Δ + (θ_now − θ_old).

    With Δ = θ_base − θ_local, a replica that trained from θ_old reaches θ_local = θ_old − Δ,
    and θ_now − θ_local = Δ + (θ_now − θ_old): applying it would undo the outer steps since θ_old.
    """
    if not theta_now.shape == theta_old.shape == delta.shape:
        raise ValueError(
            f"wrong_base needs equal shapes, got Δ {tuple(delta.shape)}, θ_now {tuple(theta_now.shape)}, θ_old {tuple(theta_old.shape)}"
        )
    return delta + (theta_now - theta_old)
