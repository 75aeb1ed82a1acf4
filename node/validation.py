"""Contribution validation: reject a pseudo-gradient before it reaches the aggregation rule.

Checks run cheapest first: type, dtype, shape, finiteness, zero (free rider), then the
statistics against a robust reference — the coordinate median of the round's contributions, or
the validating node's own Δ: norm ratio, cosine similarity, variance ratio. Separately,
``find_copies`` flags wallets whose Δ equals (or nearly equals) another wallet's in the same round.

Validation is a filter in front of robust aggregation, not a replacement for it: an attack
built to look honest (ALIE, Baruch et al. 2019; small-ε IPM, Xie et al. 2020) passes these
checks by design and must be absorbed by the rule (bench/robustness.py measures both).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .aggregation import coordinate_median, pairwise_sq_distances


@dataclass(kw_only=True)
class ValidationConfig:
    """Thresholds of ``validate_contribution``, against the coordinate median of the round.

    Calibrated on ``bench/robustness.py`` (every run prints the honest distribution): tiny LM
    (dim 32, 2 layers, vocab 512, 53k parameters) on austen.txt, H = 10 inner steps of batch
    8×32, 6 rounds, 8 and 10 honest replicas with 2–3 attackers of every kind in the median,
    2 seeds: 28,332 honest contributions, none rejected. The measured honest range (min–max,
    with the 1st–99th percentile) is next to each threshold, which sits about 2× (ratios) or
    0.2 (cosine) beyond it. These describe DiLoCo pseudo-gradients of replicas on different
    data against the median; against a single other Δ (a node's own), honest cosines drop
    to ~0.2 (tests/node/test_validation.py), and a stage with a very different H or batch
    noise should re-measure.
    """

    dtype: torch.dtype = torch.float32
    """The wire dtype of contributions (DiLoCo sends float32 Δ)."""
    min_norm_ratio: float = 0.5
    """‖Δ‖ / ‖reference‖ below this is a near-free-rider. Honest measured 0.87–1.94 (1–99%:
    1.02–1.60): the median of n noisy Δs is shorter than any one of them, so honest ratios sit near 1.2."""
    max_norm_ratio: float = 4.0
    """‖Δ‖ / ‖reference‖ above this is a boosted Δ (scale attacks, Gaussian noise). Honest max 1.94,
    so a Δ scaled by k ≳ 3 is caught; smaller boosts pass and are left to the rule."""
    min_cosine: float = 0.2
    """cos(Δ, reference) below this points away from the round's consensus (sign flip, noise,
    a Δ against the wrong base). Honest measured 0.40–0.97 (1–99%: 0.64–0.89)."""
    min_variance_ratio: float = 0.25
    """Var(Δ) / Var(reference) over coordinates, lower bound; ≈ norm ratio² for zero-mean Δs
    (honest 0.76–3.75, 1–99%: 1.05–2.57), kept as a second opinion on Δs whose energy is a
    constant offset, which the norm ratio alone cannot see."""
    max_variance_ratio: float = 16.0
    """Upper bound of the variance ratio (honest max 3.75)."""
    duplicate_tolerance: float = 0.05
    """Two Δs closer than this in relative L2 (‖a − b‖ ≤ tol·max(‖a‖, ‖b‖)) are copies. The
    issue asks for 1%; 5% also catches a copier adding up to 5% noise, and the closest honest
    pair measured 0.33 apart, 6.7× further."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_norm_ratio < self.max_norm_ratio:
            raise ValueError(
                f"ValidationConfig: need 0 <= min_norm_ratio < max_norm_ratio, got {self.min_norm_ratio}, {self.max_norm_ratio}"
            )
        if not -1 <= self.min_cosine <= 1:
            raise ValueError(f"ValidationConfig: min_cosine must lie in [-1, 1], got {self.min_cosine}")
        if not 0 <= self.min_variance_ratio < self.max_variance_ratio:
            raise ValueError(
                f"ValidationConfig: need 0 <= min_variance_ratio < max_variance_ratio, got {self.min_variance_ratio}, {self.max_variance_ratio}"
            )
        if not 0 <= self.duplicate_tolerance < 1:
            raise ValueError(
                f"ValidationConfig: duplicate_tolerance must lie in [0, 1), got {self.duplicate_tolerance}"
            )


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The outcome for one contribution. ``reason`` is "" when ok, else "<code>: <details with
    the numbers>"; codes: type, dtype, shape, nonfinite, zero, norm_ratio, cosine,
    variance_ratio, duplicate."""

    ok: bool
    reason: str = ""
    stats: Mapping[str, float] = field(default_factory=dict)

    @property
    def code(self) -> str:
        """The machine-readable part of the reason ("" when ok)."""
        return self.reason.split(":", 1)[0]


NETWORK_MEDIAN_MAX_N = 8
"""Up to this many contributions the reference median comes from a sorting network over whole
rows instead of a per-coordinate sort (see ``robust_reference``)."""


def robust_reference(xs: Tensor | list[Tensor]) -> Tensor:
    """The reference to validate a round against: the coordinate median of its contributions,
    (n, d) → (d,). Inside the honest per-coordinate range while attackers are a minority.

    For n ≤ NETWORK_MEDIAN_MAX_N it is computed by odd–even transposition (n rounds of
    element-wise min/max between neighbouring rows): the same values as ``coordinate_median``
    up to the sign of a zero, which none of the statistics here can see, and contiguous passes
    instead of a sort along the short axis — 29.5M values × 5 rows on one thread measured 8.2 s
    with the sort. The values do not depend on the row order, so replicas agree.
    """
    rows = list(xs.unbind(0)) if isinstance(xs, Tensor) else list(xs)
    if not 0 < len(rows) <= NETWORK_MEDIAN_MAX_N:
        return coordinate_median(xs)
    rows = [r.contiguous() for r in rows]
    n = len(rows)
    for step in range(n):
        for i in range(step % 2, n - 1, 2):
            rows[i], rows[i + 1] = torch.minimum(rows[i], rows[i + 1]), torch.maximum(rows[i], rows[i + 1])
    if n % 2 == 1:
        return rows[n // 2].clone()
    # In float64 the midpoint cannot overflow and rounds once (as coordinate_median does).
    return ((rows[n // 2 - 1].double() + rows[n // 2].double()) / 2).to(rows[0].dtype)


@dataclass(frozen=True)
class _Reference:
    """A reference in float64 with its norm and variance: computed once per round instead of once
    per contribution (at 29.5M values that is 5 of a contribution's ~10 passes over memory)."""

    r64: Tensor
    norm: float
    var: float

    @classmethod
    def of(cls, reference: Tensor) -> _Reference:
        r64 = reference.double()  # float64: d up to 1e8 sums without drift
        return cls(r64, float(r64.norm()), float(r64.var(correction=0)))


def contribution_stats(delta: Tensor, reference: Tensor | _Reference) -> dict[str, float]:
    """norm, reference_norm, norm_ratio, cosine and variance_ratio of a finite Δ against the reference."""
    ref = reference if isinstance(reference, _Reference) else _Reference.of(reference)
    d64, r64, ref_norm, ref_var = delta.double(), ref.r64, ref.norm, ref.var
    norm = float(d64.norm())
    return {
        "norm": norm,
        "reference_norm": ref_norm,
        "norm_ratio": norm / ref_norm,
        "cosine": float(d64 @ r64) / (norm * ref_norm) if norm > 0 else 0.0,
        "variance_ratio": float(d64.var(correction=0)) / ref_var if ref_var > 0 else math.inf,
    }


def validate_contribution(
    delta: object, reference: Tensor, config: ValidationConfig | None = None
) -> Verdict:
    """Accept or reject one contribution Δ (d,) against a robust reference (d,)."""
    _check_reference(reference)
    return _validate(delta, _Reference.of(reference), config or ValidationConfig())


def _validate(
    delta: object, reference: _Reference, config: ValidationConfig, *, checked: bool = False
) -> Verdict:
    """`validate_contribution` against a prepared reference; `checked`: Δ already passed `_structural`."""
    failure = None if checked else _structural(delta, tuple(reference.r64.shape), config)
    if failure is not None:
        return failure
    assert isinstance(delta, Tensor)  # _structural checked it; this narrows the type for mypy
    stats = contribution_stats(delta, reference)
    checks = [
        (stats["norm"] > 0, "zero: Δ is all zeros (free rider)"),
        (
            config.min_norm_ratio <= stats["norm_ratio"] <= config.max_norm_ratio,
            f"norm_ratio: ‖Δ‖/‖reference‖ = {stats['norm_ratio']:.3g} outside "
            f"[{config.min_norm_ratio}, {config.max_norm_ratio}]",
        ),
        (
            stats["cosine"] >= config.min_cosine,
            f"cosine: cos(Δ, reference) = {stats['cosine']:.3g} below {config.min_cosine}",
        ),
        (
            config.min_variance_ratio <= stats["variance_ratio"] <= config.max_variance_ratio,
            f"variance_ratio: Var(Δ)/Var(reference) = {stats['variance_ratio']:.3g} outside "
            f"[{config.min_variance_ratio}, {config.max_variance_ratio}]",
        ),
    ]
    for ok, reason in checks:
        if not ok:
            return Verdict(ok=False, reason=reason, stats=stats)
    return Verdict(ok=True, stats=stats)


def _check_reference(reference: Tensor) -> None:
    if not isinstance(reference, Tensor) or reference.dim() != 1:
        raise ValueError(
            f"reference must be a 1-D tensor, got {getattr(reference, 'shape', type(reference))}"
        )
    if not bool(torch.isfinite(reference).all()):
        raise ValueError(
            "reference has non-finite values; build it from contributions that passed the structural checks"
        )
    if not bool(reference.any()):
        raise ValueError(f"reference of {reference.numel()} values is all zeros; nothing to compare against")


def find_copies(
    deltas_by_wallet: Mapping[str, Tensor], tolerance: float = 0.05, center: Tensor | None = None
) -> list[frozenset[str]]:
    """Groups (≥ 2 wallets) whose Δs are within ``tolerance`` relative L2 of each other in one round.

    Closeness is ‖a − b‖ ≤ tolerance·max(‖a‖, ‖b‖), grouped transitively. All-zero Δs are left
    to ``validate_contribution`` (free riders). Within one round, content cannot tell the
    original from the copy — both arrive signed, and arrival order is the network's, not the
    maths' — so every member of a group is flagged; the network's commit-then-reveal digests
    are what can clear the original. ``center``, when the caller holds the round's reference,
    spares recomputing the median the distances are centred on (any centre gives the same
    distances; a central one keeps the cancellation error small).
    """
    wallets = sorted(w for w, d in deltas_by_wallet.items() if bool(d.any()))
    if len(wallets) < 2:
        return []
    stack = torch.stack([deltas_by_wallet[w] for w in wallets])  # (n, d), wallet order
    norms = torch.linalg.vector_norm(stack.double(), dim=1)  # (n,)
    dist = pairwise_sq_distances(stack, center).double().sqrt()  # (n, n), screening only
    parent = list(range(len(wallets)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    # The Gram-matrix distance is screened with a 2× margin, then confirmed exactly, because
    # its cancellation error can reach ~1e-3 relative for near-equal rows in float32.
    limit = tolerance * torch.maximum(norms[:, None], norms[None, :])  # (n, n)
    candidates = torch.nonzero(torch.triu(dist <= 2 * limit + 1e-12, diagonal=1)).tolist()
    for i, j in candidates:
        exact = float(torch.linalg.vector_norm(stack[i].double() - stack[j].double()))
        if exact <= float(limit[i, j]):
            parent[root(i)] = root(j)
    groups: dict[int, set[str]] = {}
    for i, wallet in enumerate(wallets):
        groups.setdefault(root(i), set()).add(wallet)
    return sorted((frozenset(g) for g in groups.values() if len(g) > 1), key=sorted)


def screen_round(
    deltas_by_wallet: Mapping[str, object],
    shape: tuple[int, ...],
    config: ValidationConfig | None = None,
    copiers: Callable[[frozenset[str]], Iterable[str]] | None = None,
) -> dict[str, Verdict]:
    """Verdicts for every wallet's contribution to one round of one stage.

    Structural checks (type, dtype, shape, finite) first; the reference is the coordinate median
    of the contributions that pass them; then each is validated against it, and members of a
    copy group (``find_copies``) are rejected as duplicates: all of them, or those `copiers`
    names when the caller holds evidence of who copied whom (the network's signed reveals,
    ``neuroshard.node.p2p.screening.copiers``). Raises if no contribution is structurally valid
    (there is nothing to aggregate).
    """
    config = config or ValidationConfig()
    structural = {w: _structural(d, shape, config) for w, d in deltas_by_wallet.items()}
    valid = {w: d for w, d in deltas_by_wallet.items() if structural[w] is None and isinstance(d, Tensor)}
    if not valid:
        raise ValueError(
            f"none of the {len(deltas_by_wallet)} contributions is a finite {config.dtype} tensor of shape {shape}"
        )
    reference = robust_reference(list(valid.values()))
    _check_reference(reference)
    prepared = _Reference.of(reference)
    verdicts: dict[str, Verdict] = {}
    for wallet, delta in deltas_by_wallet.items():
        failure = structural[wallet]
        verdicts[wallet] = (
            failure if failure is not None else _validate(delta, prepared, config, checked=True)
        )
    for group in find_copies(valid, config.duplicate_tolerance, center=reference):
        for wallet in group if copiers is None else sorted(set(copiers(group)) & group):
            others = ", ".join(sorted(group - {wallet}))
            verdicts[wallet] = Verdict(
                ok=False,
                reason=f"duplicate: within {config.duplicate_tolerance:.0%} relative L2 of {others}",
                stats=verdicts[wallet].stats,
            )
    return verdicts


def _structural(delta: object, shape: tuple[int, ...], config: ValidationConfig) -> Verdict | None:
    """The verdict of the reference-free checks, or None if Δ passes them."""
    if not isinstance(delta, Tensor):
        return Verdict(ok=False, reason=f"type: expected a Tensor, got {type(delta).__name__}")
    if delta.dtype != config.dtype:
        return Verdict(ok=False, reason=f"dtype: got {delta.dtype}, expected {config.dtype}")
    if tuple(delta.shape) != tuple(shape):
        return Verdict(ok=False, reason=f"shape: got {tuple(delta.shape)}, expected {tuple(shape)}")
    finite = torch.isfinite(delta)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        return Verdict(ok=False, reason=f"nonfinite: {bad} of {delta.numel()} values are NaN or inf")
    return None
