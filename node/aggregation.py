"""Robust aggregation of one round's contributions: an (n, d) stack of pseudo-gradients → one (d,) Δ.

Every rule is a pure function: it never modifies its input, returns a new 1-D tensor of the
input's dtype, and depends only on the *multiset* of contributions, bit for bit, whatever order
the messages arrived in: the weight-hash agreement after each round relies on it. The
coordinate-wise rules (mean, trimmed mean, median) sort each column and sum it one row at a time,
so a column's result depends on that column alone (a partitioned round's part equals the same
columns of the whole-vector rule). The whole-vector rules first put the rows in a canonical order
(byte-lexicographic) so that their sums are taken in the same order on every replica. Krum and
the geometric median take distances from one float64 Gram matrix (the geometric median iterates
on it and forms the d-long vector once); centered clipping, the default, reads the rows twice per
iteration instead, O(n·d) with no n × n matrix, after the coordinate median it starts from, so
its cost in a partitioned round grows with n only as that median's does (bench/bench_aggregation.py:
each rule beside ByzFL's).

Breakdown bounds (f = number of Byzantine contributions tolerated) are checked up front and
violations raise ``ValueError`` naming n, f and the bound.

The default against adaptive attackers (issue 13). ``default_rule`` is centered clipping from the
coordinate median (one iteration, τ = the median distance; Karimireddy, He & Jaggi 2021), behind
the screening (``validation.ValidationConfig``); until 2026-11-27 it was the trimmed mean with
f = ⌈0.2·n⌉. bench/robustness.py (20 rounds of H = 10, the outer defaults, colluders choosing
every round the largest parameter that passes the screening, 2 seeds) measured both in the
partitioned round, trimmed mean → centered clipping:

- non-IID replicas (each reads its own region of the standard library's source), 8 + 2: clean
  cost 1.102× → 1.052×; worst realistic attack 1.071× → 1.029×; worst omniscient search
  1.145× → 1.157× (the "edge" attack at the screening's limits); a plain sign flip 1.154× → 1.147×;
- non-IID, 10 + 3: clean 1.082× → 1.046×; realistic 1.061× → 1.012×; omniscient 1.193× →
  1.127× (min-sum with the inverse std; ALIE with z searched 1.123×); sign flip 1.148× → 1.117×;
- IID, 8 + 2: worst omniscient 1.040× → 1.018×, realistic 1.011× → 1.001×, clean 1.001×;
- centered clipping around the previous round's aggregate (the paper's center) did no better
  than around the median (non-IID 8 + 2: clean 1.048×, realistic 1.031×, omniscient 1.147×) and
  would make a part's aggregate depend on state a joining replica or a fraud-proof checker does
  not hold, so the default needs none: it is a pure function of the part's rows.

The rows that differ most are the honest replicas with unusual data: a trimmed mean drops whole
coordinates of theirs every round, clipping only shortens them, so the model still learns their
text. Not met: the issue's 1.05× on non-IID replicas (worst 1.12–1.16× without the outer ramp
below), and the screening still refuses honest parts there (34 of 320 in clean runs); opening
its limits removed those refusals but let sign flips through (``validation.ValidationConfig``).
RESULTS.md has the tables.

The rule is not the whole defence. On one seed of those runs, most of an attack's damage came
from the first rounds, where one shifted aggregate slowed the young model for the rest of the
20-round run. So a network.toml's outer step now ramps over 3 rounds
(``network_definition.DEFAULT_OUTER_WARMUP_ROUNDS``). With it the default's worst case on non-IID
8 + 2 went from 1.130× to 1.083× of the clean loss (4 seeds): the tail cut, for a slower start.

Nor is a part the whole Δ. Since 2026-11-28 a network.toml anchors every round after the first to
the outer momentum buffer (``[aggregation] anchor_floor``, default 0.1;
``neuroshard.node.outer.reduce.AnchorCheck``): a contributor whose whole Δ points away from it is
refused on every part from its signed sums, and the per-part screening opens
(``validation.ANCHORED_VALIDATION``). Simulated with 2 seeds, against the default before it: non-IID
8 + 2, the sign flip 1.092× → 1.026×, the worst adaptive attack 1.093× → 1.075×, the clean cost
1.051× → 1.036×, honest refusals in clean runs 33 → 1 of 320; non-IID 10 + 3, the worst 1.112× →
1.078× (44 → 1 of 400 refused; the two ran different attack sets); IID 8 + 2 unchanged (two-seed
means ≤ 1.002×). Still not the issue's 1.05× on
non-IID replicas (RESULTS.md, "The anchored round").

Nor is τ the median distance in a network.toml since 2026-12-06: with sign flips refused by the
anchor, a network.toml that names no ``[aggregation] clip_scale``/``clip_iterations`` clips with
τ = 1.25 × the median distance and three iterations (``DEFAULT_CLIPPING``; ``network_rule``). A
wider τ gives honest replicas whose data differs their pull (less clean cost, less room for the
sign-direction searches); the iterations move the center from the coordinate median towards the
clipped mean, where ALIE's searched pair pulls less. Non-IID 8 + 2, against one iteration at the
median distance: worst attack (mean over seeds) 1.061× → 1.048× over four seeds (fresh seeds
alone 1.051× → 1.047×), clean 1.021–1.033× → 1.010–1.025×; non-IID 10 + 3 1.078× → 1.077× (ALIE with
z searched: not the issue's 1.05×); IID ≤ 1.023×. Per seed the worst attack still reaches
1.049–1.072×. A served definition without the keys, and one built in code, keep
``LEGACY_CLIPPING`` (1, 1). RESULTS.md, "The clipping's τ and iterations".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

Contributions = Tensor | Sequence[Tensor]
"""Either an (n, d) tensor or a sequence of n tensors of shape (d,)."""

DEFAULT_F_FRACTION = 0.2
"""The default rule claims to tolerate f = ⌈0.2·n⌉ attackers (the 8+2 and 10+3 splits of
bench/robustness.py); the trimmed mean it replaced trimmed that many per side."""

SMALL_N = 5
"""Below this many contributions the default rule is the coordinate median: with n = 3, 4 one
attacker is already a quarter to a third of the rows, and for n ≤ 2 no f ≥ 1 satisfies n > 2f."""


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
    """The rows in byte-lexicographic order (``canonical_order``): (n, d), a new contiguous tensor."""
    stack = as_stack(xs).contiguous()
    return stack[torch.tensor(canonical_order(stack), dtype=torch.long, device=stack.device)]


CANONICAL_PREFIX = 64
"""Bytes of each row compared first by ``canonical_order``; only rows equal on them are compared further."""


def canonical_order(stack: Tensor) -> list[int]:
    """The permutation that puts the rows of an (n, d) stack in lexicographic order of their bytes.

    Equal rows are interchangeable, so the sorted stack depends only on the multiset of rows. Rows
    are told apart by their first CANONICAL_PREFIX bytes (16 float32 values) — a first pass that
    reads 1 KB however long the rows — and only rows equal there (copies, or rows built to collide)
    by their first differing byte. Hashing every row instead (the earlier BLAKE2b order) read the
    whole stack: 0.9 s of Krum's 2.5 s at n = 16, d = 2M.
    """
    raw = (
        stack.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(stack.shape[0], -1)
    )  # (n, bytes)
    prefixes = [row[:CANONICAL_PREFIX].tobytes() for row in raw]

    def compare(i: int, j: int) -> int:
        if prefixes[i] != prefixes[j]:
            return -1 if prefixes[i] < prefixes[j] else 1
        differ = (raw[i] != raw[j]).nonzero()[0]
        if differ.size == 0:
            return 0
        k = int(differ[0])
        return -1 if raw[i, k] < raw[j, k] else 1

    return sorted(range(len(prefixes)), key=functools.cmp_to_key(compare))


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


NETWORK_MEDIAN_MAX_N = 64
"""Up to this many rows the median and the trimmed mean come from a sorting network over blocks
of whole rows (``sorted_blocks``) instead of a per-coordinate sort: at n = 16, d = 2M on one
thread, Batcher's network (63 comparators) sorted every column in 0.14 s where ``torch.sort``
along the rows took 2.0 s (2.4 s stable); bench/bench_aggregation.py has the d = 10M numbers."""

MEDIAN_BLOCK = 1 << 15
"""Columns per block of ``sorted_blocks`` for up to 8 rows (fewer for more rows, so a block stays
~1 MB: ``_block_width``): the network's min/max passes stay in cache. At 29.5M × 5 on one thread
(load average ~6, medians of 3): median alone 1.52 / 0.66 / 0.68 / 0.51 s with 8K / 32K / 64K /
256K columns; with validation's float64 moments taken from the same block, 2.59 / 1.06 / 1.31 / 1.40 s."""


def _block_width(n: int) -> int:
    """Columns per block of ``sorted_blocks`` for n rows: MEDIAN_BLOCK × 8 / n, at least 1."""
    return max(1, MEDIAN_BLOCK * 8 // max(n, 8))


@functools.cache
def batcher_comparators(n: int) -> tuple[tuple[int, int], ...]:
    """The comparators (i, j), i < j, of Batcher's odd–even merge sort for n inputs, in order
    (Knuth, TAOCP vol. 3, §5.3.4; the iterative form for any n, equivalent to padding to a power of
    two with +inf and dropping the comparators that touch the padding). n = 16: 63 comparators,
    against 120 for odd–even transposition."""
    pairs: list[tuple[int, int]] = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


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

    Batcher's odd–even merge sort network (element-wise min/max between rows,
    ``batcher_comparators``) sorts each column of a cache-sized block; a block holding a NaN (seen as a NaN sum) is sorted
    instead, so NaN sorts last as in ``torch.sort``. Equal values of different bits (−0.0, +0.0)
    may come out in either order. The yielded rows are scratch space reused by the next block:
    use them before asking for it.
    """
    n, d = len(rows), rows[0].numel()
    if not 0 < n <= NETWORK_MEDIAN_MAX_N:
        raise ValueError(f"sorted_blocks takes 1 to {NETWORK_MEDIAN_MAX_N} rows, got {n}")
    width = max(1, min(_block_width(n), d))  # d = 0: one empty block
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
    """The first n rows of `scratch` (n + 1, w) sorted per column by Batcher's network in place:
    the returned list holds views of scratch, ascending."""
    n = scratch.shape[0] - 1
    slots = list(scratch.unbind(0))  # slots[i] holds sorted position i; slots[n] is spare
    for i, j in batcher_comparators(n):
        lo, hi, spare = slots[i], slots[j], slots[n]
        torch.minimum(lo, hi, out=spare)
        torch.maximum(lo, hi, out=hi)
        slots[i], slots[n] = spare, lo
    return slots[:n]


GRAM_BLOCK = 1 << 15
"""Columns per block of ``gram64``: k rows × 32K float64 stay in cache while addmm reads them."""


def gram64(rows: Sequence[Tensor]) -> Tensor:
    """The (k, k) float64 Gram matrix of k equal-length 1-D rows, accumulated block by block in
    column order. float32 products are exact in float64; what is left is float64 rounding of the
    sums, ~1e-16 relative. Rows with NaN or inf give non-finite entries in their row and column."""
    k, d = len(rows), rows[0].numel()
    gram = torch.zeros(k, k, dtype=torch.float64)
    buffer = torch.empty(k, max(1, min(GRAM_BLOCK, d)), dtype=torch.float64)
    for start in range(0, d, buffer.shape[1]):
        block = buffer[:, : min(buffer.shape[1], d - start)]
        for i, row in enumerate(rows):
            block[i] = row[start : start + block.shape[1]]
        gram.addmm_(block, block.T)
    return gram


def _distances_from_gram(gram: Tensor) -> Tensor:
    """Squared distances (n, n) float64 from a Gram matrix: ‖a‖² + ‖b‖² − 2⟨a, b⟩, +inf for rows
    with non-finite values (their ‖a‖² is not finite), 0 on the diagonal."""
    sq = gram.diagonal()
    dist = (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0)
    bad = ~torch.isfinite(sq)
    dist[bad, :] = math.inf
    dist[:, bad] = math.inf
    dist = torch.where(torch.isfinite(dist), dist, torch.full_like(dist, math.inf))
    return dist.fill_diagonal_(0)


def pairwise_sq_distances(stack: Tensor) -> Tensor:
    """Squared L2 distances between all rows, (n, d) → (n, n) float64, from one float64 Gram matrix
    (``gram64``): no centring pass, and a far-away row (an attacker's 1e30s) does not cost the others
    any precision, since each entry involves only its own pair. The cancellation in ‖a‖² + ‖b‖² −
    2⟨a, b⟩ costs ~1e-16·‖a‖² absolute: for two honest Δs 5% apart, ~1e-13 relative. Non-finite
    rows are +inf from everyone (never a near neighbour). Rows stay in the given order; pass
    ``canonical(stack)`` for values that do not depend on it.
    """
    return _distances_from_gram(gram64(list(stack.unbind(0))))


def canonical_rows(xs: Contributions, finite_only: bool = False) -> list[Tensor]:
    """The rows in canonical order (``canonical_order``) as views, without copying the stack;
    with ``finite_only``, rows holding NaN or inf left out (raises if none is left)."""
    stack = as_stack(xs)
    rows = [stack[i] for i in canonical_order(stack)]
    if not finite_only:
        return rows
    # min and max are NaN if any value is, ±inf if any is: one reduction per row, no (n, d) mask.
    finite = [r for r in rows if r.numel() == 0 or all(map(math.isfinite, map(float, torch.aminmax(r))))]
    if not finite:
        raise ValueError(f"all {len(rows)} contributions have non-finite values")
    return finite


def krum_scores(xs: Contributions, f: int) -> tuple[list[Tensor], Tensor]:
    """(the rows in canonical order, their Krum scores (n,) float64): each row's sum of squared
    distances to its n − f − 2 nearest other rows (Blanchard et al. 2017, NeurIPS). Needs n ≥ 2f + 3."""
    rows = canonical_rows(xs)
    n = len(rows)
    _check_f("krum", n, f, 2 * f + 3, "n >= 2f + 3")
    dist = _distances_from_gram(gram64(rows))  # (n, n)
    dist.fill_diagonal_(math.inf)  # a row is not its own neighbour
    nearest = torch.sort(dist, dim=1, stable=True).values[:, : n - f - 2]  # (n, n−f−2)
    return rows, nearest.sum(dim=1)


def krum(xs: Contributions, f: int) -> Tensor:
    """The contribution with the lowest Krum score (Blanchard et al. 2017); ties go to the
    canonically first row. Needs n ≥ 2f + 3."""
    rows, scores = krum_scores(xs, f)
    return rows[int(torch.argmin(scores))].clone()


def multi_krum(xs: Contributions, f: int, m: int | None = None) -> Tensor:
    """Average of the m lowest-scoring contributions (Blanchard et al. 2017's Multi-Krum; default
    m = n − f, El Mhamdi et al. 2018), summed one row at a time in canonical order. Needs
    n ≥ 2f + 3 and 1 ≤ m ≤ n."""
    rows, scores = krum_scores(xs, f)
    n = len(rows)
    m = n - f if m is None else m
    if not 1 <= m <= n:
        raise ValueError(f"multi_krum needs 1 <= m <= n; got m={m}, n={n}, f={f}")
    chosen = torch.sort(torch.argsort(scores, stable=True)[:m]).values  # canonical order for the sum
    return _mean_of([rows[int(i)] for i in chosen])


def _combine(c: Tensor, rows: Sequence[Tensor]) -> Tensor:
    """Σ c_i·rows[i] (d,), one row at a time in the given order, in the rows' dtype."""
    out = torch.zeros_like(rows[0])
    for weight, row in zip(c.tolist(), rows, strict=True):
        if weight != 0:
            out.add_(row, alpha=weight)
    return out


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
    rows = canonical_rows(xs, finite_only=True)
    n = len(rows)
    # Every iterate is a combination of the rows (after the first, of the rows alone): z = cᵀY with
    # Y = [rows; median], so distances and steps come from Y's Gram matrix (n + 1)² and the d-long
    # vector is formed once at the end: one pass over the stack instead of three per iteration.
    gram = gram64([*rows, _median_of_rows(rows)])  # (n + 1, n + 1)
    c = torch.zeros(n + 1, dtype=torch.float64)
    c[n] = 1.0  # start at the coordinate median
    for _ in range(max_iter):
        distances = _distances_to(gram, c)[:n]  # (n,)
        beta = 1.0 / distances.clamp_min(eps)  # (n,)
        new_c = torch.zeros_like(c)
        new_c[:n] = beta / beta.sum()
        moved = new_c - c
        step = math.sqrt(max(float(moved @ gram @ moved), 0.0))
        c = new_c
        if step <= tol * float(distances.mean()):
            break
    return _combine(c[:n], rows)  # (d,)


def _distances_to(gram: Tensor, c: Tensor) -> Tensor:
    """‖y_i − cᵀY‖ for every row i of Y, from Y's Gram matrix: √(G_ii − 2(Gc)_i + cᵀGc)."""
    gc = gram @ c
    return (gram.diagonal() - 2 * gc + c @ gc).clamp_min(0).sqrt()


def _median_of_rows(rows: Sequence[Tensor]) -> Tensor:
    """The coordinate median of a list of rows, without stacking them when the network takes them."""
    if len(rows) <= NETWORK_MEDIAN_MAX_N:
        out = torch.empty_like(rows[0])
        for start, median in median_blocks(rows):
            out[start : start + median.numel()] = median
        return out
    return _median(torch.stack(list(rows)))


def centered_clip(
    xs: Contributions,
    center: Tensor | None = None,
    tau: float | None = None,
    iters: int = 1,
    tau_scale: float = 1.0,
) -> Tensor:
    """Centered clipping (Karimireddy, He & Jaggi 2021, "Learning from history for Byzantine robust
    optimization", ICML): v ← v + mean_i (xᵢ − v)·min(1, τ / ‖xᵢ − v‖), ``iters`` times from ``center``.

    The paper carries the center across rounds (the previous aggregate / momentum); the caller
    does that. ``center=None`` starts from the coordinate median; ``tau=None`` uses ``tau_scale``
    × the median of the distances ‖xᵢ − center‖ — an honest-majority scale, so with a scale of 1
    at most half the rows are clipped, and a far-away attacker moves v by at most τ·f/n per
    iteration (when that median is 0, at least half the rows sit on the center, and the center is
    returned). Later iterations keep the first one's τ. Rows with NaN or inf are left out (a
    clipped pull from infinitely far has no defined direction). A network's choice of the two
    knobs is a ``Clipping``.

    Cost: each iteration reads every row twice (the distances to v, then the new v), O(iters·n·d)
    with no n × n matrix; with ``center=None`` the coordinate median comes first (a sorting
    network, O(n·log²n·d)), as for the trimmed mean. A part's owner in a round of n replicas
    (parts of d/n) does O(d·log²n) per round: logarithmic in n, where the Gram matrix grew as n·d.

    Bits across hardware: the distances are float64 sums, whose last bit can depend on the CPU's
    vector width; each weight is rounded to float32 before it multiplies a row, so two replicas on
    different CPUs disagree only when such a difference straddles a float32 rounding boundary
    (of the order of 1e-9 per clipped row, not measured), the same class of risk as the
    screening's float64 statistics at its thresholds. A replica that disagrees is out-voted and
    re-syncs (node/p2p/quorum.py).
    """
    rows = canonical_rows(xs, finite_only=True)
    v = _median_of_rows(rows) if center is None else center.to(rows[0].dtype)
    if v.shape != rows[0].shape:
        raise ValueError(
            f"centered_clip: center has shape {tuple(v.shape)}, contributions ({rows[0].numel()},)"
        )
    if center is not None and not bool(torch.isfinite(v).all()):
        raise ValueError("centered_clip: the center has NaN or inf values")
    if iters < 1:
        raise ValueError(f"centered_clip needs iters >= 1, got {iters}")
    if tau is not None and not tau > 0:
        raise ValueError(f"centered_clip needs tau > 0, got {tau}")
    if not (math.isfinite(tau_scale) and tau_scale > 0):
        raise ValueError(f"centered_clip needs a finite tau_scale > 0, got {tau_scale}")
    n = len(rows)
    for _ in range(iters):
        norms = _distances_to_point(rows, v)  # (n,) float64 ‖x_i − v‖
        if tau is None:
            tau = tau_scale * float(norms.median())
            if not tau > 0:
                return v.clone() if center is not None else v
        weight = torch.clamp(tau / norms, max=1.0)  # (n,); τ/0 = inf → 1
        # v + Σ_i w_i (x_i − v) / n, formed as one combination of the rows and v, rows in canonical order.
        c = torch.cat([weight / n, (1.0 - weight.sum() / n).reshape(1)])
        v = _combine(c, [*rows, v])
    return v


def _distances_to_point(rows: Sequence[Tensor], point: Tensor) -> Tensor:
    """‖row − point‖ for each row, (n,) float64, accumulated block by block in column order (the
    fp32 differences are exact in float64; what is left is float64 rounding of the sums)."""
    d = point.numel()
    sq = torch.zeros(len(rows), dtype=torch.float64)
    width = max(1, min(GRAM_BLOCK, d))
    for start in range(0, d, width):
        at = point[start : start + width].to(torch.float64)
        for i, row in enumerate(rows):
            # Out of place: `.to` returns a float64 row itself, which an in-place sub would change.
            diff = row[start : start + width].to(torch.float64) - at
            sq[i] += torch.dot(diff, diff)
    return sq.sqrt()


def nnm(xs: Contributions, f: int) -> Tensor:
    """Nearest-neighbour mixing (Allouah et al. 2023, "Fixing by mixing", AISTATS): replace each
    contribution by the average of its n − f nearest contributions (itself included).

    Returns the mixed (n, d) stack, row i mixing input row i, to feed any rule. Needs n > 2f.
    Computed in canonical order, so each mixed row is bit-identical under input permutation.
    """
    stack = as_stack(xs)
    n = stack.shape[0]
    _check_f("nnm", n, f, 2 * f + 1, "n > 2f")
    order = canonical_order(stack)
    ordered = stack[torch.tensor(order, dtype=torch.long)]
    dist = pairwise_sq_distances(ordered)  # (n, n)
    neighbours = torch.argsort(dist, dim=1, stable=True)[:, : n - f]  # (n, n−f), ties by canonical index
    if bool(torch.isfinite(dist).all()):
        # All rows finite: one (n, n) @ (n, d) product of 0/1 weights, then ÷ (n − f).
        weights = torch.zeros(n, n, dtype=stack.dtype)
        weights.scatter_(1, neighbours, 1.0)
        mixed = (weights @ ordered).div_(n - f)  # (n, d), canonical order
    else:  # a row-by-row mean: a 0 weight times a NaN row would still be NaN
        groups = torch.sort(neighbours, dim=1).values  # sum each group in canonical order
        mixed = torch.stack([ordered[group].mean(dim=0) for group in groups])
    # Map back: input row i sits at canonical position position_of[i] (equal rows mix equally).
    position_of = torch.empty(n, dtype=torch.long)
    position_of[torch.tensor(order, dtype=torch.long)] = torch.arange(n)
    return mixed[position_of]


def default_rule(n: int) -> tuple[str, int]:
    """The network's default (rule name, f) for n contributions.

    Centered clipping from the coordinate median (``centered_clip``; τ and the iterations are the
    network's ``Clipping``, applied by ``network_rule``: called bare, one iteration with τ = the
    median distance) for n ≥ SMALL_N (= 5); below that the coordinate median,
    the best there is for n ≤ 2 (no f ≥ 1 is tolerable). The returned f is what the default
    claims to tolerate: ⌈0.2·n⌉ capped by the bound n > 2f (centered clipping's τ is a median, so
    it holds while honest rows are the majority; the attack searches use f to size themselves).
    Until 2026-11-27 the default for n ≥ 5 was the trimmed mean with that f (module docstring).
    """
    if n < 1:
        raise ValueError(f"default_rule needs n >= 1 contributions, got n={n}")
    if n < SMALL_N:
        return "median", (n - 1) // 2
    f = min(math.ceil(DEFAULT_F_FRACTION * n), (n - 1) // 2)
    return "centered_clip", f


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


@dataclasses.dataclass(frozen=True)
class Clipping:
    """Centered clipping's two knobs as a network names them (``[aggregation] clip_scale`` and
    ``clip_iterations``): τ = `scale` × the median distance to the coordinate median, and
    `iterations` passes with that τ (``centered_clip``)."""

    scale: float = 1.0
    iterations: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, int | float):
            raise ValueError(f"clip scale must be a number, got {self.scale!r}")
        if not (math.isfinite(self.scale) and 0 < self.scale <= MAX_CLIP_SCALE):
            raise ValueError(f"clip scale must be in (0, {MAX_CLIP_SCALE}], got {self.scale}")
        if type(self.iterations) is not int or not 1 <= self.iterations <= MAX_CLIP_ITERATIONS:
            raise ValueError(
                f"clip iterations must be an integer in 1..{MAX_CLIP_ITERATIONS}, got {self.iterations!r}"
            )

    def keywords(self) -> dict[str, Any]:
        """``centered_clip``'s keywords for these knobs."""
        return {"tau_scale": float(self.scale), "iters": self.iterations}


MAX_CLIP_SCALE = 100.0
MAX_CLIP_ITERATIONS = 10
"""Bounds on a network's clipping knobs: each iteration reads every row twice, so a definition
cannot make a part's owner do unbounded work."""

LEGACY_CLIPPING = Clipping(1.0, 1)
"""What a network that names no clipping meant until 2026-12-06 (a served definition without the
keys, one built in code): τ = the median distance, one iteration."""

DEFAULT_CLIPPING = Clipping(1.25, 3)
"""What a network.toml that names no clipping gets since 2026-12-06 (module docstring; bench/RESULTS.md,
"The clipping's τ and iterations in the anchored round")."""


def network_rule(name: str, f: int, clipping: Clipping = LEGACY_CLIPPING) -> Callable[[Tensor], Tensor]:
    """The stage's aggregation as a network definition names it ([aggregation] rule, f, and the
    clipping knobs, used wherever the rule is or falls back to centered clipping).

    A round where fewer contributions arrived than the rule needs for f (replicas left, or were
    refused) falls back to ``default_rule(n)`` rather than ending the round: with so few inputs
    f attackers cannot be tolerated anyway, and the median is the best there is.
    """
    need = min_contributions(name, f)

    def rule(xs: Tensor) -> Tensor:
        resolved, rf = default_rule(xs.shape[0]) if name == "default" or xs.shape[0] < need else (name, f)
        extra = clipping.keywords() if resolved.removeprefix("nnm+") == "centered_clip" else {}
        return aggregate(resolved, xs, rf, **extra)

    return rule
