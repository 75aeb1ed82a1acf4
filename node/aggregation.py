"""Robust aggregation of one round's contributions: an (n, d) stack of pseudo-gradients → one (d,) Δ.

Every rule is a pure function: it never modifies its input, returns a new 1-D tensor of the
input's dtype, and depends only on the *multiset* of contributions, bit for bit, whatever order
the messages arrived in: the weight-hash agreement after each round relies on it. The
coordinate-wise rules (mean, trimmed mean, median) sort each column and sum it one row at a time,
so a column's result depends on that column alone (a partitioned round's part equals the same
columns of the whole-vector rule). The whole-vector rules first put the rows in a canonical order
(by a hash of their bytes) so that their sums are taken in the same order on every replica.

Breakdown bounds (f = number of Byzantine contributions tolerated) are checked up front and
violations raise ``ValueError`` naming n, f and the bound.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

Contributions = Tensor | Sequence[Tensor]
"""Either an (n, d) tensor or a sequence of n tensors of shape (d,)."""

DEFAULT_TRIM_FRACTION = 0.2
"""The network default trims ⌈0.2·n⌉ per side. A public implementation of this design trims
0.1·n rounded down, which is 0 (a plain mean) below 10 peers; 0.2 trims at least one per side
from n = 3 and tolerates the 8+2 and 10+3 splits of bench/robustness.py."""

SMALL_N = 5
"""Below this many contributions the default rule is the coordinate median: for n = 3, 4 a trim
of ⌈0.2·n⌉ = 1 per side already *is* the median, and for n ≤ 2 no f ≥ 1 satisfies n > 2f."""


def as_stack(xs: Contributions) -> Tensor:
    """The contributions as one (n, d) floating tensor; the input is not copied if already a tensor."""
    if isinstance(xs, Tensor):
        stack = xs
    else:
        rows = list(xs)
        if not rows:
            raise ValueError("no contributions: need at least one (got an empty sequence)")
        shapes = {tuple(r.shape) for r in rows}
        if len(shapes) != 1 or len(next(iter(shapes))) != 1:
            raise ValueError(f"contributions must be 1-D tensors of one length, got shapes {sorted(shapes)}")
        dtypes = {r.dtype for r in rows}
        if len(dtypes) != 1:
            raise ValueError(f"contributions must share one dtype, got {sorted(map(str, dtypes))}")
        stack = torch.stack(rows)
    if stack.dim() != 2 or stack.shape[0] == 0:
        raise ValueError(
            f"contributions must form an (n, d) stack with n >= 1, got shape {tuple(stack.shape)}"
        )
    if not stack.is_floating_point():
        raise ValueError(f"contributions must be floating point, got {stack.dtype}")
    return stack


def canonical(xs: Contributions) -> Tensor:
    """The rows sorted by the BLAKE2b hash of their bytes: (n, d), a new contiguous tensor.

    Equal rows hash equally and are interchangeable, so the order depends only on the multiset.
    Hashing costs one pass over the bytes (~40 ms for 100 × 1e5 float32), far less than a
    lexicographic sort over d columns.
    """
    stack = as_stack(xs).contiguous()
    raw = stack.detach().cpu().view(torch.uint8).numpy()  # (n, d·itemsize)
    keys = [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in raw]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return stack[torch.tensor(order, dtype=torch.long, device=stack.device)]


def _check_f(rule: str, n: int, f: int, need: int, bound: str) -> None:
    if not isinstance(f, int) or isinstance(f, bool) or f < 0:
        raise ValueError(f"{rule}: f must be an int >= 0, got {f!r}")
    if n < need:
        raise ValueError(f"{rule} needs {bound}; got n={n}, f={f} (so n must be >= {need})")


def mean(xs: Contributions) -> Tensor:
    """Plain average (Douillard et al. 2023's DiLoCo outer gradient): (n, d) → (d,). Breaks with one attacker.

    Each coordinate sums its own values in ascending order, one element-wise add per row, so the
    result depends only on that column's multiset: any slice of columns averages to the same bits
    as inside the whole stack (a partitioned round's parts), on any hardware. That costs a
    per-column sort, which the network's rules (trimmed mean, median) pay anyway."""
    return trimmed_mean(xs, 0)


def trimmed_mean(xs: Contributions, f: int) -> Tensor:
    """Per coordinate, drop the f largest and f smallest values and average the rest (Yin et al.
    2018, arXiv:1803.01498). Needs n > 2f. NaN sorts last, so up to f NaN rows are trimmed too.

    Up to NETWORK_MEDIAN_MAX_N rows by ``sorted_blocks`` (5 × 29.5M on one thread: 12–16 s with
    the per-coordinate sort at load 4–6), summing the kept rows in sorted order with zeros made
    +0.0, so no canonical order is needed. Above that, a per-coordinate sort and the same
    row-by-row sum: never torch's ``mean(dim=0)``, whose summation order depends on the width of
    the slice it is given, so a part of a partitioned round would differ from the same columns of
    the whole stack in the last bits."""
    stack = as_stack(xs)
    n = stack.shape[0]
    _check_f("trimmed_mean", n, f, 2 * f + 1, "n > 2f")
    if n <= NETWORK_MEDIAN_MAX_N:
        return _by_block(stack, lambda ordered: _mean_of(ordered[f : n - f]))
    ordered = torch.sort(stack, dim=0, stable=True).values  # (n, d), ascending per coordinate
    return _mean_of(ordered[f : n - f].unbind(0)).add_(0.0)  # −0.0 + 0.0 = +0.0


def coordinate_median(xs: Contributions) -> Tensor:
    """Per-coordinate median; the midpoint of the two middle values when n is even (Yin et al. 2018).

    Up to NETWORK_MEDIAN_MAX_N rows the blocks of ``sorted_blocks`` need no canonical order (their
    zeros are all +0.0), which spares hashing and copying the stack."""
    stack = as_stack(xs)
    return _median(stack if stack.shape[0] <= NETWORK_MEDIAN_MAX_N else canonical(stack))


NETWORK_MEDIAN_MAX_N = 8
"""Up to this many rows the median and the trimmed mean come from a sorting network over blocks
of whole rows (``sorted_blocks``) instead of a per-coordinate sort."""

MEDIAN_BLOCK = 1 << 15
"""Columns per block of ``sorted_blocks``: 8 rows × 32K float32 are 1 MB, so the network's
n rounds of min/max stay in cache. At 29.5M × 5 on one thread (load average ~6, medians of 3):
median alone 1.52 / 0.66 / 0.68 / 0.51 s with 8K / 32K / 64K / 256K columns; with validation's
float64 moments taken from the same block, 2.59 / 1.06 / 1.31 / 1.40 s."""


def _median(stack: Tensor) -> Tensor:
    """coordinate_median of an (n, d) stack, canonical when n > NETWORK_MEDIAN_MAX_N (a stable sort
    keeps −0.0 and +0.0, equal as values, in input order)."""
    n = stack.shape[0]
    if n <= NETWORK_MEDIAN_MAX_N:
        return _by_block(stack, _middle)
    ordered = torch.sort(stack, dim=0, stable=True).values  # (n, d)
    return _middle(list(ordered.unbind(0)))


def _by_block(stack: Tensor, reduce: Callable[[list[Tensor]], Tensor]) -> Tensor:
    """(d,): `reduce` of each block's column-sorted rows (``sorted_blocks``), zeros made +0.0."""
    out = torch.empty(stack.shape[1], dtype=stack.dtype, device=stack.device)
    for start, ordered in sorted_blocks(list(stack.unbind(0))):
        out[start : start + ordered[0].numel()] = reduce(ordered).add_(0.0)  # −0.0 + 0.0 = +0.0
    return out


def _middle(ordered: Sequence[Tensor]) -> Tensor:
    """The median of column-sorted rows (ascending): the middle row, or the midpoint of the two."""
    n = len(ordered)
    if n % 2 == 1:
        return ordered[n // 2].clone()
    lo, hi = ordered[n // 2 - 1], ordered[n // 2]
    if lo.dtype == torch.float64:
        return lo / 2 + hi / 2
    # In float64, (lo + hi) / 2 cannot overflow and rounds once, so huge attacker values near the
    # float32 limit give the exact midpoint instead of inf.
    return ((lo.double() + hi.double()) / 2).to(lo.dtype)


def _mean_of(rows: Sequence[Tensor]) -> Tensor:
    """Mean of the rows, summed one at a time in the given order."""
    total = rows[0].clone()
    for row in rows[1:]:
        total += row
    return total.div_(len(rows))


def median_blocks(rows: Sequence[Tensor]) -> Iterator[tuple[int, Tensor]]:
    """The coordinate median of n ≤ NETWORK_MEDIAN_MAX_N rows, block by block: yields (first
    column, the block's median with zeros made +0.0, so its bits do not depend on the row order).
    Validation computes its statistics of the same columns while they are in cache."""
    for start, ordered in sorted_blocks(rows):
        yield start, _middle(ordered).add_(0.0)


def sorted_blocks(rows: Sequence[Tensor]) -> Iterator[tuple[int, list[Tensor]]]:
    """n ≤ NETWORK_MEDIAN_MAX_N equal-length 1-D rows sorted per column, block by block: yields
    (first column, the block's n rows ascending per column), w ≤ MEDIAN_BLOCK columns each.

    Odd–even transposition (n rounds of element-wise min/max between neighbouring rows) sorts
    each column of a cache-sized block; a block holding a NaN (seen as a NaN sum) is sorted
    instead, so NaN sorts last as in ``torch.sort``. Equal values of different bits (−0.0, +0.0)
    may come out in either order. The yielded rows are scratch space reused by the next block:
    use them before asking for it.
    """
    n, d = len(rows), rows[0].numel()
    if not 0 < n <= NETWORK_MEDIAN_MAX_N:
        raise ValueError(f"sorted_blocks takes 1 to {NETWORK_MEDIAN_MAX_N} rows, got {n}")
    width = max(1, min(MEDIAN_BLOCK, d))  # d = 0: one empty block
    scratch = torch.empty(n + 1, width, dtype=rows[0].dtype, device=rows[0].device)  # n rows + 1 spare
    for start in range(0, max(d, 1), width):
        w = min(width, d - start)
        block = scratch[:, :w]
        for i, row in enumerate(rows):
            block[i] = row[start : start + w]
        if math.isnan(float(block[:n].sum())):  # inf − inf is NaN too: then sorting is merely slower
            yield start, list(torch.sort(block[:n], dim=0, stable=True).values.unbind(0))
        else:
            yield start, _network_sort(block)


def _network_sort(scratch: Tensor) -> list[Tensor]:
    """The first n rows of `scratch` (n + 1, w) sorted per column by odd–even transposition in
    place: the returned list holds views of scratch, ascending."""
    n = scratch.shape[0] - 1
    slots = list(scratch.unbind(0))  # slots[i] holds sorted position i; slots[n] is spare
    for step in range(n):
        for i in range(step % 2, n - 1, 2):
            lo, hi, spare = slots[i], slots[i + 1], slots[n]
            torch.minimum(lo, hi, out=spare)
            torch.maximum(lo, hi, out=hi)
            slots[i], slots[n] = spare, lo
    return slots[:n]


def pairwise_sq_distances(stack: Tensor, center: Tensor | None = None) -> Tensor:
    """Squared L2 distances between all rows, (n, d) → (n, n), without Python loops.

    ‖a − b‖² = ‖a‖² + ‖b‖² − 2⟨a, b⟩ from one Gram matrix. Rows are first centred on their
    coordinate median (or `center`, when the caller already holds it): distances do not change,
    but the norms shrink to the spread of the contributions, which keeps the cancellation error small. Non-finite entries (rows with NaN or
    inf) become +inf, so such rows are never anybody's near neighbour. Rows stay in the given
    order; pass ``canonical(stack)`` for values that do not depend on it.
    """
    centred = stack - (_median(stack) if center is None else center)  # (n, d)
    gram = centred @ centred.T  # (n, n)
    sq = gram.diagonal()
    dist = (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0)
    dist.fill_diagonal_(0)
    return torch.where(torch.isfinite(dist), dist, torch.full_like(dist, math.inf))


def krum_scores(xs: Contributions, f: int) -> tuple[Tensor, Tensor]:
    """(canonical stack (n, d), Krum scores (n,)): each row's sum of squared distances to its
    n − f − 2 nearest other rows (Blanchard et al. 2017, NeurIPS). Needs n ≥ 2f + 3."""
    stack = canonical(xs)
    n = stack.shape[0]
    _check_f("krum", n, f, 2 * f + 3, "n >= 2f + 3")
    dist = pairwise_sq_distances(stack)  # (n, n)
    dist.fill_diagonal_(math.inf)  # a row is not its own neighbour
    nearest = torch.sort(dist, dim=1, stable=True).values[:, : n - f - 2]  # (n, n−f−2)
    return stack, nearest.sum(dim=1)


def krum(xs: Contributions, f: int) -> Tensor:
    """The contribution with the lowest Krum score (Blanchard et al. 2017); ties go to the
    canonically first row. Needs n ≥ 2f + 3."""
    stack, scores = krum_scores(xs, f)
    return stack[int(torch.argmin(scores))].clone()


def multi_krum(xs: Contributions, f: int, m: int | None = None) -> Tensor:
    """Average of the m lowest-scoring contributions (Blanchard et al. 2017's Multi-Krum; default
    m = n − f, El Mhamdi et al. 2018). Needs n ≥ 2f + 3 and 1 ≤ m ≤ n."""
    stack, scores = krum_scores(xs, f)
    n = stack.shape[0]
    m = n - f if m is None else m
    if not 1 <= m <= n:
        raise ValueError(f"multi_krum needs 1 <= m <= n; got m={m}, n={n}, f={f}")
    chosen = torch.sort(torch.argsort(scores, stable=True)[:m]).values  # canonical order for the sum
    return stack[chosen].mean(dim=0)


def geometric_median(xs: Contributions, eps: float = 1e-8, max_iter: int = 100, tol: float = 1e-6) -> Tensor:
    """Smoothed Weiszfeld iterations (Pillutla, Kakade & Harchaoui 2022, "Robust aggregation for
    federated learning", IEEE TSP): z ← Σ βᵢxᵢ / Σ βᵢ with βᵢ = 1 / max(eps, ‖z − xᵢ‖).

    ``eps`` is the smoothing that keeps β finite when z lands on a contribution; iteration stops
    when a step moves z by less than ``tol`` times the mean distance to the contributions (the
    objective is flat at the optimum, so its change would stop ~√tol too early), or after ``max_iter``.
    Starts at the coordinate median, which is already within the honest range. Breakdown point
    1/2: needs more honest than Byzantine rows. Rows with NaN or inf are left out (weight 0).
    """
    if eps <= 0 or max_iter < 1 or tol < 0:
        raise ValueError(
            f"geometric_median needs eps > 0, max_iter >= 1, tol >= 0; got {eps}, {max_iter}, {tol}"
        )
    stack = _finite_rows(canonical(xs))
    z = _median(stack)  # (d,)
    for _ in range(max_iter):
        distances = torch.linalg.vector_norm(stack - z, dim=1)  # (n,)
        beta = 1.0 / distances.clamp_min(eps)  # (n,)
        new_z = (beta / beta.sum()) @ stack  # (d,)
        step = float(torch.linalg.vector_norm(new_z - z))
        z = new_z
        if step <= tol * float(distances.mean()):
            break
    return z


def _finite_rows(stack: Tensor) -> Tensor:
    """The rows without NaN or inf. Such a row is infinitely far from everything: its Weiszfeld
    weight 1/‖z − x‖ and its clipped pull would be 0, but 0 × NaN is NaN, so drop it instead."""
    finite = torch.isfinite(stack).all(dim=1)
    if not bool(finite.any()):
        raise ValueError(f"all {stack.shape[0]} contributions have non-finite values")
    return stack if bool(finite.all()) else stack[finite]


def centered_clip(
    xs: Contributions, center: Tensor | None = None, tau: float | None = None, iters: int = 1
) -> Tensor:
    """Centered clipping (Karimireddy, He & Jaggi 2021, "Learning from history for Byzantine robust
    optimization", ICML): v ← v + mean_i (xᵢ − v)·min(1, τ / ‖xᵢ − v‖), ``iters`` times from ``center``.

    The paper carries the center across rounds (the previous aggregate / momentum); the caller
    does that. ``center=None`` starts from the coordinate median; ``tau=None`` uses the median of
    the distances ‖xᵢ − center‖ — an honest-majority scale, so at most half the rows are clipped
    and a far-away attacker moves v by at most τ·f/n per iteration. Rows with NaN or inf are
    left out (a clipped pull from infinitely far has no defined direction).
    """
    stack = _finite_rows(canonical(xs))
    v = _median(stack) if center is None else center.to(stack.dtype)
    if v.shape != stack.shape[1:]:
        raise ValueError(
            f"centered_clip: center has shape {tuple(v.shape)}, contributions ({stack.shape[1]},)"
        )
    if iters < 1:
        raise ValueError(f"centered_clip needs iters >= 1, got {iters}")
    if tau is None:
        tau = float(torch.linalg.vector_norm(stack - v, dim=1).median())
    if not tau > 0:
        raise ValueError(f"centered_clip needs tau > 0, got {tau}")
    for _ in range(iters):
        diff = stack - v  # (n, d)
        norms = torch.linalg.vector_norm(diff, dim=1, keepdim=True)  # (n, 1)
        weight = torch.clamp(tau / norms, max=1.0)  # (n, 1); τ/0 = inf → 1
        v = v + (diff * weight).mean(dim=0)
    return v


def nnm(xs: Contributions, f: int) -> Tensor:
    """Nearest-neighbour mixing (Allouah et al. 2023, "Fixing by mixing", AISTATS): replace each
    contribution by the average of its n − f nearest contributions (itself included).

    Returns the mixed (n, d) stack, row i mixing input row i, to feed any rule. Needs n > 2f.
    Computed in canonical order, so each mixed row is bit-identical under input permutation.
    """
    stack = as_stack(xs)
    n = stack.shape[0]
    _check_f("nnm", n, f, 2 * f + 1, "n > 2f")
    ordered = canonical(stack)
    dist = pairwise_sq_distances(ordered)  # (n, n)
    neighbours = torch.argsort(dist, dim=1, stable=True)[:, : n - f]  # (n, n−f), ties by canonical index
    neighbours = torch.sort(neighbours, dim=1).values  # sum each group in canonical order
    # A row-by-row mean, not weights @ ordered: a 0 weight times a NaN row is still NaN.
    mixed = torch.stack([ordered[group].mean(dim=0) for group in neighbours])  # (n, d), canonical order
    # Map back: input row i sits at canonical position position_of[i].
    position_of = _positions(stack, ordered)
    return mixed[position_of]


def _positions(stack: Tensor, ordered: Tensor) -> Tensor:
    """For each row of ``stack``, its index in ``ordered`` (a permutation of it): (n,) long."""

    def key(row: Tensor) -> bytes:
        return row.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()

    where: dict[bytes, int] = {}
    for j in range(ordered.shape[0]):
        where.setdefault(key(ordered[j]), j)  # equal rows mix equally, any of their indices will do
    return torch.tensor([where[key(stack[i])] for i in range(stack.shape[0])], dtype=torch.long)


def default_rule(n: int) -> tuple[str, int]:
    """The network's default (rule name, f) for n contributions.

    Trimmed mean with f = ⌈0.2·n⌉ capped by the bound n > 2f; for n < SMALL_N (= 5) the
    coordinate median, which for n = 3, 4 equals that trimmed mean and for n ≤ 2 is the best
    there is (no f ≥ 1 is tolerable; the returned f says how many attackers are tolerated).
    """
    if n < 1:
        raise ValueError(f"default_rule needs n >= 1 contributions, got n={n}")
    if n < SMALL_N:
        return "median", (n - 1) // 2
    f = min(math.ceil(DEFAULT_TRIM_FRACTION * n), (n - 1) // 2)
    return "trimmed_mean", f


RULES: dict[str, Callable[..., Tensor]] = {
    "mean": lambda xs, f, **kw: mean(xs, **kw),
    "trimmed_mean": trimmed_mean,
    "median": lambda xs, f, **kw: coordinate_median(xs, **kw),
    "krum": krum,
    "multi_krum": multi_krum,
    "geometric_median": lambda xs, f, **kw: geometric_median(xs, **kw),
    "centered_clip": lambda xs, f, **kw: centered_clip(xs, **kw),
}
"""Rules by name, each called as rule(xs, f, **kw). Rules without an f still check the honest-majority
bound n > 2f in ``aggregate`` so a config cannot ask them for more than they give."""


def aggregate(name: str, xs: Contributions, f: int = 0, **kw: Any) -> Tensor:
    """Dispatch by name: one of RULES, ``"nnm+<rule>"`` (mixing first, then the rule, both with f),
    or ``"default"`` (``default_rule(n)``; f is ignored). Extra keywords go to the rule."""
    stack = as_stack(xs)
    n = stack.shape[0]
    if name == "default":
        rule, f = default_rule(n)
        return aggregate(rule, stack, f, **kw)
    if name.startswith("nnm+"):
        return aggregate(name[len("nnm+") :], nnm(stack, f), f, **kw)
    if name not in RULES:
        raise ValueError(f"unknown aggregation rule {name!r}; known: {', '.join(RULES)}, default, nnm+<rule>")
    if name not in ("mean",):
        _check_f(name, n, f, 2 * f + 1, "n > 2f")
    return RULES[name](stack, f, **kw)


def min_contributions(name: str, f: int) -> int:
    """The fewest contributions ``aggregate(name, ·, f)`` accepts (its breakdown bound)."""
    if name == "default" or name == "mean":
        return 1
    if name.startswith("nnm+"):
        return max(2 * f + 1, min_contributions(name[len("nnm+") :], f))
    if name in ("krum", "multi_krum"):
        return 2 * f + 3
    return 2 * f + 1


def network_rule(name: str, f: int) -> Callable[[Tensor], Tensor]:
    """The stage's aggregation as a network definition names it ([aggregation] rule and f).

    A round where fewer contributions arrived than the rule needs for f (replicas left, or were
    refused) falls back to ``default_rule(n)`` rather than ending the round: with so few inputs
    f attackers cannot be tolerated anyway, and the median is the best there is.
    """
    need = min_contributions(name, f)

    def rule(xs: Tensor) -> Tensor:
        if xs.shape[0] < need:
            return aggregate("default", xs)
        return aggregate(name, xs, f)

    return rule
