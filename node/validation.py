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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .aggregation import MEDIAN_BLOCK, NETWORK_MEDIAN_MAX_N, coordinate_median, median_blocks


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

    On non-IID replicas (each reads its own text) these limits refuse honest parts: 34 of 320
    honest contributions in clean runs of bench/robustness.py's non-IID 8 + 2, 49 of 400 at
    10 + 3. Opening them (norm ratio 8, cosine ≥ −0.5, variance ratio [0.05, 64]) behind the
    default rule's centered clipping removed those refusals and helped against the adaptive
    searches, but let a plain sign-flipped Δ through wherever the attacker's own Δ agreed weakly
    with the others, and the flips cost more than the limits saved (non-IID 10 + 3: 1.117× clean
    with these limits, 1.249× with the open ones; RESULTS.md, issue 13), so they stay.
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


ANCHORED_VALIDATION = ValidationConfig(
    max_norm_ratio=8.0, min_cosine=-0.5, min_variance_ratio=0.05, max_variance_ratio=64.0
)
"""The per-part limits of a round with an anchor (``node.outer.reduce.AnchorCheck``: a network that
names ``[aggregation] anchor_floor``). The anchor refuses a Δ that points away as a whole, so the
per-part cosine limit, which refused honest parts of replicas whose data differs (34 of 320 in
clean non-IID runs), opens to −0.5 and the ratios to [0.5, 8] and [0.05, 64]: a Δ boosted
ten-fold is still refused on nearly every part. bench/robustness.py, non-IID 8 + 2, 2 seeds,
these limits from round 1 and the node's in round 0 (which has no anchor): 1 honest refusal in
320 in clean runs, a sign flip 1.026× clean, the worst adaptive attack 1.075× (RESULTS.md)."""


@dataclass(frozen=True, kw_only=True)
class ValidationResult:
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


def robust_reference(xs: Tensor | list[Tensor]) -> Tensor:
    """The reference to validate a round against: the coordinate median of its contributions,
    (n, d) → (d,). Inside the honest per-coordinate range while attackers are a minority; its
    bits do not depend on the row order (``coordinate_median``), so replicas agree on it."""
    return coordinate_median(xs)


MOMENT_BLOCK = MEDIAN_BLOCK
"""Columns per block of the float64 moments when there is no median to compute alongside."""


@dataclass(frozen=True)
class _Moments:
    """Sums over the coordinates of k rows, in float64: the Gram matrix (k, k) and row sums (k,).

    Every statistic here — norms, cosines, variances, pairwise distances — is a function of
    them, so one blocked pass over the rows gives them all (the earlier per-statistic float64
    copies read each 29.5M-value Δ about ten times). float32 products are exact in float64 and
    the blocks are added in a fixed order; what remains is float64 rounding (~1e-16 relative),
    far inside every threshold's margin.
    """

    gram: Tensor
    sums: Tensor
    numel: int

    @classmethod
    def of(cls, columns: Iterable[Tensor], k: int) -> _Moments:
        """Accumulate (k, w) float64 blocks of columns; numel is the total of their widths."""
        gram = torch.zeros(k, k, dtype=torch.float64)
        sums = torch.zeros(k, dtype=torch.float64)
        numel = 0
        for block in columns:
            gram.addmm_(block, block.T)
            sums += block.sum(dim=1)
            numel += block.shape[1]
        return cls(gram, sums, numel)

    def norm(self, i: int) -> float:
        return math.sqrt(float(self.gram[i, i]))

    def variance(self, i: int) -> float:
        """Population variance over the coordinates: mean of squares − square of the mean."""
        mean = float(self.sums[i]) / self.numel
        return max(float(self.gram[i, i]) / self.numel - mean * mean, 0.0)

    def distance(self, i: int, j: int) -> float:
        """‖row i − row j‖ = √(‖a‖² + ‖b‖² − 2⟨a, b⟩): for copies 5% apart the cancellation costs
        ~1e-13 relative in float64 (in float32 it was ~1e-3 and needed an exact second pass)."""
        return math.sqrt(max(float(self.gram[i, i] + self.gram[j, j] - 2 * self.gram[i, j]), 0.0))

    def stats(self, i: int, ref: int) -> dict[str, float]:
        """``contribution_stats`` of row i against row ref."""
        norm, ref_norm, ref_var = self.norm(i), self.norm(ref), self.variance(ref)
        return {
            "norm": norm,
            "reference_norm": ref_norm,
            "norm_ratio": norm / ref_norm,
            "cosine": float(self.gram[i, ref]) / (norm * ref_norm) if norm > 0 else 0.0,
            "variance_ratio": self.variance(i) / ref_var if ref_var > 0 else math.inf,
        }


def _blocks(rows: Sequence[Tensor], width: int = MOMENT_BLOCK) -> Iterator[Tensor]:
    """The rows' columns as (k, w) float64 blocks, w ≤ width (a reused buffer)."""
    d = rows[0].numel()
    buffer = torch.empty(len(rows), max(1, min(width, d)), dtype=torch.float64)
    for start in range(0, d, buffer.shape[1]):
        block = buffer[:, : min(buffer.shape[1], d - start)]
        for i, row in enumerate(rows):
            block[i] = row[start : start + block.shape[1]]
        yield block


def _with_reference(rows: Sequence[Tensor]) -> tuple[Tensor, _Moments]:
    """The rows' coordinate median and the moments of [rows; median], (k + 1) rows, in one pass:
    each block's median is computed and its moments taken while the block is in cache."""
    k, d = len(rows), rows[0].numel()
    if k > NETWORK_MEDIAN_MAX_N:  # sorted per coordinate in one go, then read back by block
        reference = coordinate_median(list(rows))
        return reference, _Moments.of(_blocks([*rows, reference]), k + 1)
    reference = torch.empty(d, dtype=rows[0].dtype)

    def columns() -> Iterator[Tensor]:
        buffer = None  # as wide as the first (widest) block
        for start, median in median_blocks(rows):
            w = median.numel()
            reference[start : start + w] = median
            if buffer is None:
                buffer = torch.empty(k + 1, w, dtype=torch.float64)
            block = buffer[:, :w]
            for i, row in enumerate(rows):
                block[i] = row[start : start + w]
            block[k] = median
            yield block

    return reference, _Moments.of(columns(), k + 1)


def contribution_stats(delta: Tensor, reference: Tensor) -> dict[str, float]:
    """norm, reference_norm, norm_ratio, cosine and variance_ratio of a finite Δ against the reference."""
    return _Moments.of(_blocks([delta, reference]), 2).stats(0, 1)


def validate_contribution(
    delta: object, reference: Tensor, config: ValidationConfig | None = None
) -> ValidationResult:
    """Accept or reject one contribution Δ (d,) against a robust reference (d,)."""
    _check_reference(reference)
    config = config or ValidationConfig()
    failure = _structural(delta, tuple(reference.shape), config)
    if failure is not None:
        return failure
    assert isinstance(delta, Tensor)  # _structural checked it; this narrows the type for mypy
    return _judge(contribution_stats(delta, reference), config)


def _judge(stats: Mapping[str, float], config: ValidationConfig) -> ValidationResult:
    """The verdict on a structurally valid Δ from its statistics against the reference."""
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
            return ValidationResult(ok=False, reason=reason, stats=dict(stats))
    return ValidationResult(ok=True, stats=dict(stats))


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


def find_copies(deltas_by_wallet: Mapping[str, Tensor], tolerance: float = 0.05) -> list[frozenset[str]]:
    """Groups (≥ 2 wallets) whose Δs are within ``tolerance`` relative L2 of each other in one round.

    Closeness is ‖a − b‖ ≤ tolerance·max(‖a‖, ‖b‖), grouped transitively. All-zero Δs are left
    to ``validate_contribution`` (free riders). Within one round, content cannot tell the
    original from the copy — both arrive signed, and arrival order is the network's, not the
    maths' — so every member of a group is flagged. The partitioned round keeps copies from
    arising: every member commits to its Δ before any Δ can be read.
    """
    wallets = sorted(deltas_by_wallet)
    moments = _Moments.of(_blocks([deltas_by_wallet[w] for w in wallets]), len(wallets))
    return _copy_groups(wallets, moments, tolerance)


def _copy_groups(wallets: Sequence[str], moments: _Moments, tolerance: float) -> list[frozenset[str]]:
    """find_copies over rows 0..len(wallets)−1 of `moments` (row i is wallets[i]'s Δ)."""
    live = [i for i in range(len(wallets)) if moments.norm(i) > 0]
    parent = {i: i for i in live}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, i in enumerate(live):
        for j in live[a + 1 :]:
            if moments.distance(i, j) <= tolerance * max(moments.norm(i), moments.norm(j)):
                parent[root(i)] = root(j)
    groups: dict[int, set[str]] = {}
    for i in live:
        groups.setdefault(root(i), set()).add(wallets[i])
    return sorted((frozenset(g) for g in groups.values() if len(g) > 1), key=sorted)


def screen_round(
    deltas_by_wallet: Mapping[str, object],
    shape: tuple[int, ...],
    config: ValidationConfig | None = None,
    copiers: Callable[[frozenset[str]], Iterable[str]] | None = None,
) -> dict[str, ValidationResult]:
    """Verdicts for every wallet's contribution to one round of one stage.

    Structural checks (type, dtype, shape, finite) first; the reference is the coordinate median
    of the contributions that pass them; then each is validated against it, and members of a
    copy group (``find_copies``) are rejected as duplicates: all of them, or those `copiers`
    names when the caller holds evidence of who copied whom (the partitioned round passes none:
    every member commits before any Δ can be read). Raises if no contribution is structurally valid
    (there is nothing to aggregate) or if the reference is all zeros.

    The median and every statistic come from one blocked pass over the rows (``_with_reference``),
    in wallet order: the verdicts are a function of the contributions alone.
    """
    config = config or ValidationConfig()
    structural = {w: _structural(d, shape, config) for w, d in deltas_by_wallet.items()}
    valid = {
        w: d for w, d in sorted(deltas_by_wallet.items()) if structural[w] is None and isinstance(d, Tensor)
    }
    if not valid:
        raise ValueError(
            f"none of the {len(deltas_by_wallet)} contributions is a finite {config.dtype} tensor of shape {shape}"
        )
    wallets, rows = list(valid), list(valid.values())
    reference, moments = _with_reference(rows)
    ref = len(rows)
    if moments.norm(ref) == 0:
        raise ValueError(f"reference of {reference.numel()} values is all zeros; nothing to compare against")
    verdicts: dict[str, ValidationResult] = {w: v for w, v in structural.items() if v is not None}
    for i, wallet in enumerate(wallets):
        verdicts[wallet] = _judge(moments.stats(i, ref), config)
    for group in _copy_groups(wallets, moments, config.duplicate_tolerance):
        for wallet in group if copiers is None else sorted(set(copiers(group)) & group):
            others = ", ".join(sorted(group - {wallet}))
            verdicts[wallet] = ValidationResult(
                ok=False,
                reason=f"duplicate: within {config.duplicate_tolerance:.0%} relative L2 of {others}",
                stats=verdicts[wallet].stats,
            )
    return {w: verdicts[w] for w in deltas_by_wallet}


def _structural(delta: object, shape: tuple[int, ...], config: ValidationConfig) -> ValidationResult | None:
    """The verdict of the reference-free checks, or None if Δ passes them."""
    if not isinstance(delta, Tensor):
        return ValidationResult(ok=False, reason=f"type: expected a Tensor, got {type(delta).__name__}")
    if delta.dtype != config.dtype:
        return ValidationResult(ok=False, reason=f"dtype: got {delta.dtype}, expected {config.dtype}")
    if tuple(delta.shape) != tuple(shape):
        return ValidationResult(ok=False, reason=f"shape: got {tuple(delta.shape)}, expected {tuple(shape)}")
    if delta.numel() and not all(map(math.isfinite, map(float, torch.aminmax(delta)))):
        # min and max are NaN if any value is, ±inf if any is: one reduction, no (d,) mask
        # (8 ms against 0.35 s for isfinite().all() at 29.5M values on one thread).
        bad = int((~torch.isfinite(delta)).sum())
        return ValidationResult(ok=False, reason=f"nonfinite: {bad} of {delta.numel()} values are NaN or inf")
    return None
