"""Byzantine attack transforms on contributions, for tests and benchmarks only.

Each is a pure function of what the attacker holds: its own honest Δ (d,), and — since
colluding attackers share what they observe — the honest contributions of the same round
(m, d). Random attacks take a ``torch.Generator`` so runs are reproducible. Nothing here
touches the network: the swarm's ``--attack`` flag calls these.

The adaptive attacks (``ADAPTIVE``, second half of the file) know the defence: each is a
one-parameter family, and the colluders pick the parameter every round as the largest whose
rows still pass ``validation.screen_round`` with the configured thresholds (``adapt``), so
nothing is refused and the damage is left to the rule. What they know of the honest rows is
an ``estimate``: the round's honest Δs themselves (omniscient: a simulator-only upper bound —
on the wire every member commits before any Δ is revealed), or a surrogate built from the
colluders' own honestly trained Δs and earlier rounds' revealed payloads (realistic).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist

import torch
from torch import Tensor

from neuroshard.node.aggregation import coordinate_median
from neuroshard.node.validation import ValidationConfig, contribution_stats, screen_round

FIXED = (
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
"""The fixed-parameter attack modes of issue 5, one word each, as the CLI names them."""


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


# ---------------------------------------------------------------------------------------------
# Adaptive attacks: one-parameter families whose parameter is searched against the screening.

ADAPTIVE = (
    "alie_search",
    "minmax_unit",
    "minmax_std",
    "minmax_sign",
    "minsum_unit",
    "minsum_std",
    "minsum_sign",
    "fang",
    "edge",
    "ipm_search",
    "mimic",
)
"""The adaptive families (``craft``), as the CLI and the benchmarks name them."""

ATTACKS = FIXED + ADAPTIVE
"""Every attack mode ``--attack NAME`` takes."""

KNOWLEDGE = ("omniscient", "realistic")
"""What the colluders see of the honest Δs (module docstring)."""

COLLUDER_SPREAD = 0.05
"""Relative size of the noise each colluder multiplies into the crafted vector, v ⊙ (1 + 0.05·ε):
without it K colluders would send one vector and ``find_copies`` (tolerance 5%) flags them all.
Multiplicative, so every slice of the vector — every part of a partitioned round, screened on
its own — carries ≈ 5% relative noise and colluders sit ≈ 7% apart in each; the search screens
the rows with their noise, so its cost is priced in."""

REALISTIC_MARGIN = 0.1
"""A realistic colluder screens against a surrogate of the honest rows, not the rows themselves, so
it keeps this share of each threshold's room in reserve (``tightened``): measured in
bench/robustness.py, the realistic attacks are then refused in few rounds (the table's "caught")."""


def honest_spread(rows: Tensor) -> tuple[Tensor, Tensor]:
    """(per-coordinate mean (d,), per-coordinate sample std (d,); zeros for a single row)."""
    mu = rows.mean(dim=0)
    sigma = rows.std(dim=0) if rows.shape[0] > 1 else torch.zeros_like(mu)
    return mu, sigma


def realistic_estimate(own: Tensor, deviations: Tensor | None = None) -> Tensor:
    """A surrogate of the round's honest rows from what colluders hold when they commit: their own
    honestly trained Δs ``own`` (k, d) — a sample of the honest distribution, since they trained
    like everyone else — plus ``deviations`` (m, d) from earlier rounds (revealed payloads minus
    their mean, or a colluder's own Δ minus the revealed aggregate), re-centred on the own mean.
    Returns (k + m, d). The mean is off by ~σ/√k and the spread is last round's."""
    if own.dim() != 2 or own.shape[0] < 1:
        raise ValueError(
            f"realistic_estimate needs own Δs as a (k, d) stack with k >= 1, got {tuple(own.shape)}"
        )
    if deviations is None or deviations.shape[0] == 0:
        return own.clone()
    if deviations.shape[1:] != own.shape[1:]:
        raise ValueError(
            f"realistic_estimate: deviations have shape {tuple(deviations.shape)}, own Δs {tuple(own.shape)}"
        )
    return torch.cat([own, own.mean(dim=0) + deviations])


def _unit(x: Tensor) -> Tensor:
    norm = float(x.norm())
    return x / norm if norm > 0 else x


def _top_direction(centred: Tensor, iters: int = 20) -> Tensor:
    """The top principal direction of centred rows (m, d) → (d,) by power iteration on the m × m
    Gram matrix, from a fixed start (deterministic)."""
    gram = centred @ centred.T  # (m, m)
    v = torch.ones(gram.shape[0], dtype=gram.dtype)
    for _ in range(iters):
        v = _unit(gram @ v)
    return _unit(centred.T @ v)


@dataclass(frozen=True)
class Anchor:
    """A whole-Δ check besides ``screen_round``: every row's cosine to ``direction`` (the previous
    round's aggregate, which every replica and colluder holds) must be at least ``floor``."""

    direction: Tensor
    floor: float

    def admits(self, row: Tensor) -> bool:
        """Whether `row`'s cosine to the direction clears the floor (float64, as screening takes it);
        a zero direction judges nothing, as in ``AnchorCheck``."""
        if not bool(self.direction.any()):
            return True
        return contribution_stats(row, self.direction)["cosine"] >= self.floor


def craft(
    name: str,
    rows: Tensor,
    gamma: float,
    config: ValidationConfig | None = None,
    anchor: Anchor | None = None,
) -> Tensor:
    """The family ``name``'s vector (d,) at parameter ``gamma`` ≥ 0 from (estimated) honest rows
    (m, d); gamma = 0 is harmless (about the honest mean) and the damage grows with gamma.

    - alie_search: μ − γσ per coordinate (Baruch et al. 2019, z searched instead of z_max);
    - minmax_* / minsum_*: μ + γp with Shejwalkar & Houmansadr's (NDSS 2021) perturbations p:
      inverse unit vector −μ/‖μ‖, inverse std −σ, inverse sign −sign(μ) — p scaled to ‖μ‖ so one
      γ range fits all three. The distance criteria that tell min-max from min-sum are applied
      by ``paper_bound``;
    - fang: per coordinate, beyond the honest extreme opposite to the mean's sign, by γσ (Fang et
      al., USENIX Security 2020, full-knowledge attack on trimmed mean and median: values just
      past w_min where the change is positive, past w_max where it is negative);
    - edge: at the validator's limits (``config``): γ ∈ [0, 1] moves from the median's direction
      with its norm (γ = 0) to cosine = min_cosine and norm = max_norm_ratio × ‖median‖ (γ = 1),
      the rest pointing along −sign(μ) made orthogonal to the median (the same direction every
      round, so the outer momentum adds it up). Against an ``anchor`` that direction is also made
      orthogonal to the anchor, and the cosine to the median kept high enough that the cosine to
      the anchor stays at its floor (the edge of both checks);
    - ipm_search: (1 − γ)μ (Xie et al., UAI 2019). −εμ itself has cosine −1 to any reference
      and never passes; γ ≤ 1 shrinks the honest step, γ > 1 is IPM's −εμ with ε = γ − 1;
    - mimic: an honest row x* over-represented (Karimireddy, He & Jaggi, ICLR 2022): x* is the
      row furthest along the top principal direction of the honest deviations, and the colluders
      send x* + γ(x* − μ) (an exact copy would be refused by ``find_copies``).
    """
    if rows.dim() != 2 or rows.shape[0] < 1:
        raise ValueError(f"craft needs honest rows as an (m, d) stack, got {tuple(rows.shape)}")
    if not gamma >= 0:
        raise ValueError(f"craft: gamma must be >= 0, got {gamma}")
    mu, sigma = honest_spread(rows)
    scale = float(mu.norm())
    if name == "alie_search":
        return mu - gamma * sigma
    if name.startswith(("minmax_", "minsum_")):
        return mu + gamma * scale * _unit(_perturbation(name.split("_", 1)[1], mu, sigma))
    if name == "fang":
        lo, hi = rows.min(dim=0).values, rows.max(dim=0).values
        return torch.where(mu > 0, lo - gamma * sigma, hi + gamma * sigma)
    if name == "edge":
        return _edge(rows, mu, min(gamma, 1.0), config or ValidationConfig(), anchor)
    if name == "ipm_search":
        return (1 - gamma) * mu
    if name == "mimic":
        centred = rows - mu
        z = _top_direction(centred)
        target = rows[int(torch.argmax((centred @ z).abs()))]
        return target + gamma * (target - mu)
    raise ValueError(f"unknown adaptive attack {name!r}; known: {', '.join(ADAPTIVE)}")


def _perturbation(kind: str, mu: Tensor, sigma: Tensor) -> Tensor:
    if kind == "unit":
        return -mu
    if kind == "std":
        return -sigma
    if kind == "sign":
        return -torch.sign(mu)
    raise ValueError(f"unknown perturbation {kind!r}; known: unit, std, sign")


def _edge(
    rows: Tensor, mu: Tensor, gamma: float, config: ValidationConfig, anchor: Anchor | None = None
) -> Tensor:
    reference = coordinate_median(rows)
    ref_norm = float(reference.norm())
    u = _unit(reference)
    w = -torch.sign(mu)
    w = _unit(w - (w @ u) * u)  # orthogonal to the reference
    lowest = config.min_cosine
    if anchor is not None:
        # x = |x|·(c·u + s·w) with w ⟂ u and w ⟂ a has cos(x, a) = c·(u·a): keep it at the floor.
        a = _unit(anchor.direction - (anchor.direction @ u) * u)
        w = _unit(w - (w @ a) * a)
        along = float(u @ _unit(anchor.direction))
        lowest = max(lowest, anchor.floor / along) if along > 0 else 1.0
    cosine = 1 - gamma * (1 - min(1.0, lowest))
    norm = ref_norm * (1 + gamma * (config.max_norm_ratio - 1))
    return norm * (cosine * u + math.sqrt(max(0.0, 1 - cosine * cosine)) * w)


def paper_bound(name: str, rows: Tensor, vector: Tensor) -> bool:
    """Shejwalkar & Houmansadr's criteria (NDSS 2021): min-max keeps the vector's largest distance
    to an honest row within the largest honest pairwise distance; min-sum keeps its sum of squared
    distances within the largest honest row's. Other families have none (True)."""
    if not name.startswith(("minmax_", "minsum_")) or rows.shape[0] < 2:
        return True
    pair = torch.cdist(rows[None].double(), rows[None].double())[0]  # (m, m)
    to_vector = (rows.double() - vector.double()).norm(dim=1)  # (m,)
    if name.startswith("minmax_"):
        return float(to_vector.max()) <= float(pair.max())
    return float(to_vector.pow(2).sum()) <= float(pair.pow(2).sum(dim=1).max())


def tightened(config: ValidationConfig, margin: float) -> ValidationConfig:
    """``config`` with each threshold moved ``margin`` (0–1) of its room towards the honest centre
    (norm and variance ratios towards 1, cosine towards 1): what a colluder unsure of the real
    reference aims for."""
    if not 0 <= margin < 1:
        raise ValueError(f"tightened needs 0 <= margin < 1, got {margin}")
    if margin == 0:
        return config
    return replace(
        config,
        min_norm_ratio=config.min_norm_ratio + margin * (1 - config.min_norm_ratio),
        max_norm_ratio=config.max_norm_ratio - margin * (config.max_norm_ratio - 1),
        min_cosine=config.min_cosine + margin * (1 - config.min_cosine),
        min_variance_ratio=config.min_variance_ratio + margin * (1 - config.min_variance_ratio),
        max_variance_ratio=config.max_variance_ratio - margin * (config.max_variance_ratio - 1),
    )


Screen = Callable[[Tensor, Tensor], bool]
"""(honest rows (m, d), crafted rows (k, d)) → whether every crafted row passes the defence's screening."""


def screen_passes(config: ValidationConfig | None = None) -> Screen:
    """The whole-vector ``screen_round`` with ``config``: the colluders' acceptance test."""

    def passes(honest: Tensor, crafted: Tensor) -> bool:
        rows = {f"h{i:04d}": r for i, r in enumerate(honest)} | {
            f"x{j:04d}": r for j, r in enumerate(crafted)
        }
        verdicts = screen_round(rows, (honest.shape[1],), config)
        return all(verdicts[f"x{j:04d}"].ok for j in range(crafted.shape[0]))

    return passes


@dataclass(frozen=True, kw_only=True)
class Adapted:
    """The outcome of ``adapt``: the colluders' rows and the parameter they chose."""

    rows: Tensor
    """(k, d): what the k colluders send."""
    gamma: float
    """The largest parameter found that passes (0 when no parameter did)."""
    passed: bool
    """Whether some parameter passed the colluders' own test (their estimate of the screening);
    when none did, the rows are the estimated honest mean (with the colluders' noise)."""


def adapt(
    name: str,
    estimate: Tensor,
    k: int,
    generator: torch.Generator,
    *,
    config: ValidationConfig | None = None,
    screen: Screen | None = None,
    iters: int = 6,
    start: float = 0.5,
    cap: float = 1e4,
    anchor: Anchor | None = None,
) -> Adapted:
    """The colluders' round: the largest γ whose k rows (``craft`` + ``spread_colluders``) pass
    ``screen`` (default: ``screen_round`` with ``config``) against the ``estimate`` of the honest
    rows, and, for min-max / min-sum, the paper's distance criterion. Doubling from ``start`` until
    a γ fails (or ``cap``), then ``iters`` bisection steps (when γ = 0 fails, the first passing γ of
    a geometric grid is the start); ``anchor`` is a whole-Δ check the screen also applies, which
    the edge family builds around; the noise is drawn once per round, so
    the test is a function of γ alone. Assumes passing is monotone in γ (larger γ moves further
    from the honest rows in every family), as the unit tests check."""
    config = config or ValidationConfig()
    screen = screen or screen_passes(config)
    d = estimate.shape[1]
    noise = 1 + COLLUDER_SPREAD * torch.randn(k, d, generator=generator) if k > 1 else torch.ones(1, d)

    def rows_at(gamma: float) -> Tensor:
        return craft(name, estimate, gamma, config, anchor)[None] * noise  # (k, d)

    def ok(gamma: float) -> bool:
        rows = rows_at(gamma)
        return all(paper_bound(name, estimate, r) for r in rows) and screen(estimate, rows)

    upper = 1.0 if name == "edge" else cap
    lo = 0.0
    if not ok(lo):  # mimic's harmless end is a near-copy of an honest row: find the window above it
        lo = next((g for g in _grid(start, upper) if ok(g)), math.nan)
        if math.isnan(lo):  # the family cannot pass: send the estimated mean, not be refused
            return Adapted(rows=estimate.mean(dim=0)[None] * noise, gamma=0.0, passed=False)
    hi = min(max(start, 2 * lo), upper)
    while ok(hi):
        lo = hi
        if hi >= upper:
            return Adapted(rows=rows_at(hi), gamma=hi, passed=True)
        hi = min(2 * hi, upper)
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return Adapted(rows=rows_at(lo), gamma=lo, passed=True)


def _grid(start: float, upper: float, steps: int = 24) -> list[float]:
    """γ from start/64 up to ``upper`` in steps of ×√2."""
    values = [start / 64 * 2 ** (j / 2) for j in range(steps)]
    return [v for v in values if v <= upper]
