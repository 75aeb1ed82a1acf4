import math
import time
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from neuroshard.node import aggregation as agg

ALL_RULES = [
    "mean",
    "trimmed_mean",
    "median",
    "krum",
    "multi_krum",
    "geometric_median",
    "centered_clip",
    "nnm+trimmed_mean",
    "nnm+median",
    "default",
]

# Five 1-D points with hand-computed answers: 0, 1, 2, 4 and an outlier at 100.
LINE = torch.tensor([[0.0], [1.0], [2.0], [4.0], [100.0]])


def col(*values: float) -> Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_mean_trimmed_mean_and_median_by_hand() -> None:
    xs = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [100.0, -100.0]])
    assert torch.equal(agg.mean(xs), col(22.0, 0.0))
    # Per coordinate sorted: [1, 2, 3, 4, 100] and [-100, 10, 20, 30, 40]; drop one each side.
    assert torch.equal(agg.trimmed_mean(xs, 1), col(3.0, 20.0))
    assert torch.equal(agg.trimmed_mean(xs, 0), agg.mean(xs))
    assert torch.equal(agg.coordinate_median(xs), col(3.0, 20.0))
    # Even n: the midpoint of the two middle values.
    assert torch.equal(agg.coordinate_median(torch.tensor([[1.0], [2.0], [3.0], [10.0]])), col(2.5))


def test_median_midpoint_does_not_overflow_float32() -> None:
    big = torch.tensor([[3e38], [3e38]])
    assert torch.equal(agg.coordinate_median(big), col(3e38))


def test_krum_and_multi_krum_by_hand() -> None:
    # f=1, n=5: score = sum of squared distances to the n−f−2 = 2 nearest others.
    # 0: 1+4=5, 1: 1+1=2, 2: 1+4=5, 4: 4+9=13, 100: 96²+98².
    rows, scores = agg.krum_scores(LINE, 1)
    by_value = {float(r[0]): float(s) for r, s in zip(rows, scores, strict=True)}
    assert by_value == {0.0: 5.0, 1.0: 2.0, 2.0: 5.0, 4.0: 13.0, 100.0: 96.0**2 + 98.0**2}
    assert torch.equal(agg.krum(LINE, 1), col(1.0))
    assert torch.equal(agg.multi_krum(LINE, 1), col(1.75))  # default m = n − f = 4: mean of 0, 1, 2, 4
    assert torch.equal(agg.multi_krum(LINE, 1, m=1), col(1.0))


def test_geometric_median_by_hand() -> None:
    # In one dimension the geometric median is the median.
    assert agg.geometric_median(LINE).item() == pytest.approx(2.0, abs=1e-4)
    # Equilateral triangle: the Fermat point is the centroid (1, 1/√3).
    tri = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, math.sqrt(3.0)]])
    assert agg.geometric_median(tri).tolist() == pytest.approx([1.0, 1 / math.sqrt(3.0)], abs=1e-4)


def test_centered_clip_by_hand() -> None:
    xs = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [100.0, 100.0]])
    # τ = 1 around 0: [0,0] stays, [2,0] → [1,0], [0,2] → [0,1], [100,100] → [1/√2, 1/√2]; then the mean.
    out = agg.centered_clip(xs, torch.zeros(2), 1.0)
    expected = (1 + 1 / math.sqrt(2.0)) / 4
    assert out.tolist() == pytest.approx([expected, expected], abs=1e-6)
    # Defaults: center = coordinate median [1, 1], τ = median distance to it.
    assert agg.centered_clip(xs).shape == (2,)


def test_centered_clip_iterates_as_the_formula_says() -> None:
    gen = torch.Generator().manual_seed(3)
    xs = torch.randn(9, 50, generator=gen)
    xs[7:] *= 40.0  # two far rows: clipped
    center, tau = torch.randn(50, generator=gen), 2.0
    v = center.double()
    for _ in range(3):  # the paper's update, in float64, the plain way
        diffs = xs.double() - v
        scale = torch.clamp(tau / diffs.norm(dim=1), max=1.0)
        v = v + (diffs * scale[:, None]).mean(dim=0)
    out = agg.centered_clip(xs, center, tau, iters=3)
    assert torch.allclose(out.double(), v, atol=1e-5)
    assert torch.equal(out, agg.centered_clip(xs[torch.randperm(9, generator=gen)], center, tau, iters=3))


def test_centered_clip_with_half_the_rows_on_the_median_returns_the_median() -> None:
    # A part whose Δs are mostly zero (a frozen slice): τ = median distance = 0 is not a failed round.
    xs = torch.zeros(5, 4)
    xs[0] = 1.0
    xs[1] = -3.0
    assert torch.equal(agg.centered_clip(xs), torch.zeros(4))
    assert torch.equal(agg.network_rule("centered_clip", 1)(xs), torch.zeros(4))


def test_nnm_by_hand_and_keeps_input_order() -> None:
    xs = torch.tensor([[0.0], [1.0], [2.0], [10.0]])
    # f=1: each row becomes the mean of its n−f = 3 nearest (itself included).
    assert torch.allclose(agg.nnm(xs, 1), torch.tensor([[1.0], [1.0], [1.0], [13 / 3]]))
    perm = torch.tensor([3, 1, 0, 2])
    assert torch.equal(agg.nnm(xs[perm], 1), agg.nnm(xs, 1)[perm])


@pytest.mark.parametrize(
    ("n", "expected"),
    [(1, ("median", 0)), (2, ("median", 0)), (3, ("median", 1)), (4, ("median", 1)),
     (5, ("centered_clip", 1)), (10, ("centered_clip", 2)), (11, ("centered_clip", 3)),
     (13, ("centered_clip", 3)), (100, ("centered_clip", 20))],
)  # fmt: skip
def test_default_rule(n: int, expected: tuple[str, int]) -> None:
    assert agg.default_rule(n) == expected
    assert n > 2 * expected[1] or n <= 2


def test_default_rule_is_the_median_below_five_and_centered_clipping_from_it_above() -> None:
    xs = torch.randn(4, 50)
    assert torch.equal(agg.aggregate("default", xs), agg.coordinate_median(xs))
    assert torch.equal(agg.aggregate("default", xs), agg.trimmed_mean(xs, 1))  # n = 3, 4: the same thing
    xs = torch.randn(9, 50)
    assert torch.equal(
        agg.aggregate("default", xs), agg.centered_clip(xs, agg.coordinate_median(xs), iters=1)
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda xs: agg.trimmed_mean(xs[:4], 2), "n > 2f; got n=4, f=2"),
        (lambda xs: agg.krum(xs[:6], 2), "n >= 2f \\+ 3; got n=6, f=2 \\(so n must be >= 7\\)"),
        (lambda xs: agg.multi_krum(xs[:6], 2), "n=6, f=2"),
        (lambda xs: agg.multi_krum(xs, 2, m=0), "1 <= m <= n; got m=0"),
        (lambda xs: agg.nnm(xs[:4], 2), "nnm needs n > 2f; got n=4, f=2"),
        (lambda xs: agg.aggregate("median", xs[:4], 2), "median needs n > 2f; got n=4, f=2"),
        (lambda xs: agg.aggregate("geometric_median", xs[:6], 3), "n=6, f=3"),
        (lambda xs: agg.trimmed_mean(xs, -1), "f must be an int >= 0, got -1"),
        (lambda xs: agg.aggregate("bogus", xs), "unknown aggregation rule 'bogus'"),
        (lambda xs: agg.centered_clip(xs, torch.zeros(3)), "center has shape \\(3,\\)"),
        (lambda xs: agg.centered_clip(xs, tau=0.0), "tau > 0"),
    ],
)
def test_breakdown_bounds_and_bad_arguments_raise(call: Callable[[Tensor], Tensor], message: str) -> None:
    xs = torch.randn(8, 5)
    with pytest.raises(ValueError, match=message):
        call(xs)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="empty sequence"):
        agg.mean([])
    with pytest.raises(ValueError, match="one length"):
        agg.mean([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError, match="floating point"):
        agg.mean(torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="n >= 1"):
        agg.mean(torch.zeros(0, 4))


def test_sequence_input_equals_stack_input() -> None:
    xs = torch.randn(7, 30)
    for name in ALL_RULES:
        assert torch.equal(agg.aggregate(name, list(xs), 2), agg.aggregate(name, xs, 2)), name


@settings(max_examples=25, deadline=None)
@given(n=st.integers(7, 16), d=st.integers(1, 64), seed=st.integers(0, 2**32 - 1))
def test_bit_identical_under_permutation(n: int, d: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, d, generator=gen) * torch.rand(n, 1, generator=gen) * 10
    xs[0] = xs[1]  # an exact duplicate
    xs[2, 0], xs[3, 0] = 0.0, -0.0  # equal values with different bits
    f = (n - 3) // 2
    expected = {name: agg.aggregate(name, xs, f) for name in ALL_RULES}
    for _ in range(3):
        shuffled = xs[torch.randperm(n, generator=gen)]
        for name in ALL_RULES:
            assert torch.equal(agg.aggregate(name, shuffled, f), expected[name]), name


@pytest.mark.parametrize(("dtype", "bits"), [(torch.float32, torch.int32), (torch.float64, torch.int64)])
def test_inputs_are_not_modified(dtype: torch.dtype, bits: torch.dtype) -> None:
    xs = torch.randn(9, 40, dtype=dtype)
    xs[4, 3] = float("nan")
    before = xs.clone()
    rows = list(xs.clone())
    rows_before = [r.clone() for r in rows]
    center = torch.ones(40, dtype=dtype)
    for name in ALL_RULES:
        agg.aggregate(name, xs, 2)
        agg.aggregate(name, rows, 2)
    agg.nnm(xs, 2)
    agg.centered_clip(xs, center, 0.5, iters=3)
    agg.centered_clip(rows, iters=2)
    assert torch.equal(xs, before) is False  # NaN != NaN: compare bytes instead
    assert xs.view(bits).equal(before.view(bits))
    assert all(r.view(bits).equal(b.view(bits)) for r, b in zip(rows, rows_before, strict=True))
    assert torch.equal(center, torch.ones(40, dtype=dtype))


def test_centered_clip_gives_the_same_answer_in_float64() -> None:
    xs = torch.randn(9, 30, generator=torch.Generator().manual_seed(2))
    xs[8] *= 50.0
    assert torch.allclose(
        agg.centered_clip(xs.double(), iters=3), agg.centered_clip(xs, iters=3).double(), atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_is_preserved(dtype: torch.dtype) -> None:
    xs = torch.randn(9, 20, dtype=dtype)
    for name in ALL_RULES:
        out = agg.aggregate(name, xs, 2)
        assert out.dtype == dtype and out.shape == (20,), name
    assert agg.nnm(xs, 2).dtype == dtype


def honest_and_attackers(seed: int, honest: int, f: int, d: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    good = torch.randn(honest, d, generator=gen) + 1.0
    bad = torch.randn(f, d, generator=gen) * 1e6 - 5e5  # arbitrary and far
    bad[0, : d // 2] = float("nan") if f > 0 else 0.0
    return good, bad


@pytest.mark.parametrize("seed", range(5))
def test_trimmed_mean_and_median_stay_in_the_honest_range(seed: int) -> None:
    honest, bad = honest_and_attackers(seed, honest=7, f=3, d=200)
    xs = torch.cat([honest, bad])
    lo, hi = honest.min(dim=0).values, honest.max(dim=0).values
    for out in (agg.trimmed_mean(xs, 3), agg.coordinate_median(xs)):
        assert bool(((out >= lo) & (out <= hi)).all())


@pytest.mark.parametrize("seed", range(5))
def test_the_default_lands_within_tau_of_the_median(seed: int) -> None:
    """Centered clipping: every row, honest or not, pulls the median by at most τ/n (τ = the median
    distance), so the default lands within τ of the median however far the attackers are."""
    honest, bad = honest_and_attackers(seed, honest=7, f=3, d=200)
    bad[0] = bad[1]  # finite: a NaN row would be left out, not clipped
    xs = torch.cat([honest, bad])
    center = agg.coordinate_median(xs)
    tau = float((xs - center).norm(dim=1).median())
    moved = float((agg.aggregate("default", xs) - center).norm())
    assert moved <= tau * (1 + 1e-5)
    assert float((agg.mean(xs) - center).norm()) > 1000 * tau  # the mean, for contrast
    spread = float((honest - honest.mean(dim=0)).norm(dim=1).max())
    assert float((agg.aggregate("default", xs) - honest.mean(dim=0)).norm()) < spread


@pytest.mark.parametrize("seed", range(5))
def test_krum_picks_an_honest_vector_when_attackers_are_far(seed: int) -> None:
    honest, bad = honest_and_attackers(seed, honest=7, f=2, d=200)
    xs = torch.cat([bad, honest])
    chosen = agg.krum(xs, 2)
    assert any(torch.equal(chosen, h) for h in honest)
    # Multi-Krum's m = n − f lowest scores are exactly the honest rows here.
    assert torch.allclose(agg.multi_krum(xs, 2), honest.mean(dim=0), atol=1e-5)


@pytest.mark.parametrize("rule", ["geometric_median", "centered_clip", "nnm+trimmed_mean"])
def test_distance_rules_stay_near_the_honest_mean(rule: str) -> None:
    honest, bad = honest_and_attackers(0, honest=7, f=2, d=200)
    out = agg.aggregate(rule, torch.cat([honest, bad]), 2)
    spread = float((honest - honest.mean(dim=0)).norm(dim=1).max())
    assert float((out - honest.mean(dim=0)).norm()) < spread


def test_mean_is_not_robust_the_control() -> None:
    honest, bad = honest_and_attackers(0, honest=7, f=1, d=10)
    bad[0] = 1e6
    assert float(agg.mean(torch.cat([honest, bad])).abs().min()) > 1e4


def test_krum_is_fast_on_100_contributions_of_1e5() -> None:
    xs = torch.randn(100, 100_000)
    start = time.perf_counter()
    out = agg.krum(xs, 20)
    elapsed = time.perf_counter() - start
    assert out.shape == (100_000,)
    # ~1.2 s on one idle core (hashing, the centring median's sort, one 100×1e5 Gram matrix);
    # the bound leaves room for a loaded CI machine.
    assert elapsed < 10.0, f"krum on (100, 1e5) took {elapsed:.2f}s"


def test_network_rule_applies_the_definitions_rule_and_f() -> None:
    xs = torch.randn(7, 40, generator=torch.Generator().manual_seed(3))
    krum = agg.network_rule("krum", 2)
    assert torch.equal(krum(xs), agg.krum(xs, 2))
    assert not torch.equal(krum(xs), agg.aggregate("default", xs))
    assert torch.equal(agg.network_rule("nnm+trimmed_mean", 1)(xs), agg.aggregate("nnm+trimmed_mean", xs, 1))


def test_a_networks_clipping_knobs_scale_tau_and_iterate_with_it() -> None:
    """Clipping(scale, iterations): τ = scale × the median distance to the coordinate median, kept
    for every iteration, wherever the network's rule is or falls back to centered clipping."""
    gen = torch.Generator().manual_seed(5)
    xs = torch.randn(10, 60, generator=gen)
    xs[8:] *= 30.0  # two far rows, clipped at any of these scales
    median = agg.coordinate_median(xs)
    tau = float((xs.double() - median.double()).norm(dim=1).median())
    v = median.double()
    for _ in range(3):  # the update by hand with τ = 1.25 × the median distance
        diffs = xs.double() - v
        v = v + (diffs * torch.clamp(1.25 * tau / diffs.norm(dim=1), max=1.0)[:, None]).mean(dim=0)
    clipped = agg.network_rule("default", 2, agg.Clipping(1.25, 3))(xs)
    assert torch.allclose(clipped.double(), v, atol=1e-5)
    assert torch.equal(clipped, agg.centered_clip(xs, tau_scale=1.25, iters=3))
    assert torch.equal(clipped, agg.network_rule("centered_clip", 2, agg.Clipping(1.25, 3))(xs))
    assert torch.equal(agg.network_rule("default", 2)(xs), agg.centered_clip(xs))  # no knobs: (1, 1)
    # A wider τ lets the far rows pull further from the median.
    assert float((clipped - median).norm()) > float((agg.centered_clip(xs, iters=3) - median).norm())
    # Krum below its bound falls back to the default, clipped with the network's knobs; the median
    # (n < 5) takes none.
    assert torch.equal(
        agg.network_rule("krum", 3, agg.Clipping(1.25, 3))(xs[:8]),
        agg.centered_clip(xs[:8], tau_scale=1.25, iters=3),
    )
    assert torch.equal(
        agg.network_rule("default", 0, agg.Clipping(2.0, 2))(xs[:4]), agg.coordinate_median(xs[:4])
    )
    with pytest.raises(ValueError, match="tau_scale > 0"):
        agg.centered_clip(xs, tau_scale=0.0)


def test_network_rule_falls_back_to_the_default_below_its_bound() -> None:
    xs = torch.randn(4, 40, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="n >= 2f \\+ 3"):
        agg.aggregate("krum", xs, 1)  # 4 < 2·1 + 3
    assert torch.equal(agg.network_rule("krum", 1)(xs), agg.aggregate("default", xs))
    assert [agg.min_contributions(name, 2) for name in ("mean", "trimmed_mean", "multi_krum")] == [1, 5, 7]
    assert agg.min_contributions("nnm+krum", 1) == 5


@pytest.mark.parametrize("n", range(1, agg.NETWORK_MEDIAN_MAX_N + 1))
def test_blocked_median_equals_the_sorted_median(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small blocks, so the 103 columns span several full blocks and a short last one.
    monkeypatch.setattr(agg, "MEDIAN_BLOCK", 16)
    gen = torch.Generator().manual_seed(n)
    xs = torch.randn(n, 103, generator=gen)
    xs[:, 40:50] = -0.0
    xs[0, 60], xs[-1, 61] = math.inf, -math.inf
    xs[0, 90] = math.nan  # its block is sorted instead: NaN sorts last, as in torch.sort
    ordered = torch.sort(xs, dim=0).values
    mid = (
        ordered[n // 2] if n % 2 else ((ordered[n // 2 - 1].double() + ordered[n // 2].double()) / 2).float()
    )
    out = agg.coordinate_median(xs)
    torch.testing.assert_close(out, mid, rtol=0, atol=0, equal_nan=True)
    zeros = out[40:50]
    assert torch.equal(zeros, torch.zeros(10)) and not torch.signbit(zeros).any()  # +0.0 whatever the order
    assert torch.equal(agg.coordinate_median(xs.flip(0)).view(torch.int32), out.view(torch.int32))


@pytest.mark.parametrize("n", range(3, agg.NETWORK_MEDIAN_MAX_N + 1))
def test_blocked_trimmed_mean_equals_the_sorted_one(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agg, "MEDIAN_BLOCK", 16)
    gen = torch.Generator().manual_seed(n)
    xs = torch.randn(n, 103, generator=gen)
    xs[0, 60] = math.inf
    xs[0, 90] = math.nan  # its block is sorted: NaN sorts last and is trimmed
    f = (n - 1) // 2
    expected = torch.sort(xs, dim=0).values[f : n - f].mean(dim=0)
    out = agg.trimmed_mean(xs, f)
    torch.testing.assert_close(out, expected, equal_nan=True)
    assert torch.equal(agg.trimmed_mean(xs.flip(0), f).view(torch.int32), out.view(torch.int32))
