import math

import pytest
import torch

from neuroshard.adversary import attacks
from neuroshard.node import aggregation
from neuroshard.node.validation import ValidationConfig, contribution_stats, screen_round


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


DELTA = torch.tensor([1.0, -2.0, 3.0, 0.5])
HONEST = torch.tensor([[1.0, 2.0], [3.0, 2.0], [5.0, 2.0]])  # mean [3, 2], sample std [2, 0]


def test_deterministic_transforms() -> None:
    assert torch.equal(attacks.sign_flip(DELTA), -DELTA)
    assert torch.equal(attacks.scale(DELTA, 10.0), DELTA * 10)
    assert torch.equal(attacks.zero(DELTA), torch.zeros(4))
    assert torch.equal(attacks.ipm(HONEST, 0.1), torch.tensor([-0.3, -0.2]))
    assert torch.equal(attacks.wrong_base(DELTA, torch.ones(4), torch.zeros(4)), DELTA + 1)


def test_gaussian_is_seeded_noise_of_the_given_sigma() -> None:
    like = torch.zeros(100_000)
    a = attacks.gaussian(like, 0.5, gen(1))
    assert torch.equal(a, attacks.gaussian(like, 0.5, gen(1)))
    assert not torch.equal(a, attacks.gaussian(like, 0.5, gen(2)))
    assert a.dtype == torch.float32 and float(a.std()) == pytest.approx(0.5, rel=0.02)


def test_copy_exact_and_with_relative_noise() -> None:
    source = torch.randn(1000, generator=gen())
    exact = attacks.copy(source)
    assert torch.equal(exact, source) and exact.data_ptr() != source.data_ptr()
    noisy = attacks.copy(source, 0.01, gen())
    assert float((noisy - source).norm() / source.norm()) == pytest.approx(0.01, rel=1e-4)
    with pytest.raises(ValueError, match="needs a generator"):
        attacks.copy(source, 0.01)


def test_alie_z_follows_baruch_et_al() -> None:
    # n=10, f=2: s = ⌊10/2 + 1⌋ − 2 = 4, z = Φ⁻¹(6/10) ≈ 0.2533.
    assert attacks.alie_z(10, 2) == pytest.approx(0.2533, abs=1e-4)
    # n=13, f=3: s = 7 − 3 = 4, z = Φ⁻¹(9/13) ≈ 0.5024.
    assert attacks.alie_z(13, 3) == pytest.approx(0.5024, abs=1e-4)
    with pytest.raises(ValueError, match="n=5, f=0"):
        attacks.alie_z(5, 0)


def test_alie_is_mean_plus_z_std() -> None:
    assert torch.allclose(attacks.alie(HONEST, 10, 2, z=1.5), torch.tensor([6.0, 2.0]))
    z = attacks.alie_z(5, 2)
    assert torch.allclose(attacks.alie(HONEST, 5, 2), torch.tensor([3.0 + 2 * z, 2.0]))


def test_stale_returns_the_delta_from_k_rounds_ago() -> None:
    past = [torch.full((2,), float(r)) for r in range(4)]  # rounds 0..3, 3 is current
    assert torch.equal(attacks.stale(past, 2), torch.ones(2))
    with pytest.raises(ValueError, match="k=4, 4 rounds"):
        attacks.stale(past, 4)


def test_nan_poisons_the_chosen_number_of_values() -> None:
    out = attacks.nan(torch.zeros(100), 3, gen())
    assert int(out.isnan().sum()) == 3
    assert bool(attacks.nan(torch.zeros(5), None).isnan().all())
    with pytest.raises(ValueError, match="count <= 5, got 6"):
        attacks.nan(torch.zeros(5), 6)


def test_equivocate_gives_two_different_plausible_payloads() -> None:
    a, b = attacks.equivocate(DELTA, gen(), spread=0.1)
    assert torch.equal(a, DELTA) and not torch.equal(a, b)
    assert float((a - b).norm() / a.norm()) == pytest.approx(0.1, rel=1e-4)


def test_wrong_base_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="θ_old \\(3,\\)"):
        attacks.wrong_base(DELTA, torch.zeros(4), torch.zeros(3))


def test_inputs_are_not_modified() -> None:
    delta, honest = DELTA.clone(), HONEST.clone()
    attacks.sign_flip(delta)
    attacks.scale(delta, 3)
    attacks.nan(delta, 2, gen())
    attacks.copy(delta, 0.5, gen())
    attacks.equivocate(delta, gen())
    attacks.alie(honest, 10, 2)
    attacks.ipm(honest, 2.0)
    attacks.wrong_base(delta, torch.ones(4), torch.zeros(4))
    assert torch.equal(delta, DELTA) and torch.equal(honest, HONEST)


def test_every_attack_mode_is_named() -> None:
    assert len(set(attacks.FIXED)) == 11 and len(set(attacks.ADAPTIVE)) == 11
    assert attacks.ATTACKS == attacks.FIXED + attacks.ADAPTIVE
    assert all(callable(getattr(attacks, name)) for name in attacks.FIXED)
    assert not math.isnan(attacks.alie_z(13, 3))


# Adaptive attacks. Synthetic honest rows shaped like DiLoCo Δs against their median (norm
# ratios ≈ 1.2, cosines ≈ 0.8: bench/robustness.py's honest ranges).
D, M, K = 20_000, 8, 2


def honest_rows(seed: int = 0, m: int = M) -> torch.Tensor:
    g = gen(seed)
    mu = torch.randn(D, generator=g)
    return mu + 0.8 * torch.randn(m, D, generator=g)


def passes_screen(
    honest: torch.Tensor, crafted: torch.Tensor, config: ValidationConfig | None = None
) -> bool:
    rows = {f"h{i}": r for i, r in enumerate(honest)} | {f"x{j}": r for j, r in enumerate(crafted)}
    verdicts = screen_round(rows, (D,), config)
    return all(verdicts[f"x{j}"].ok for j in range(crafted.shape[0])) and all(
        verdicts[f"h{i}"].ok for i in range(honest.shape[0])
    )


def damage(honest: torch.Tensor, vector: torch.Tensor) -> float:
    """How far the plain mean moves from the honest mean when K colluders send `vector`."""
    mu = honest.mean(dim=0)
    agg = torch.cat([honest, vector.expand(K, -1)]).mean(dim=0)
    return float((agg - mu).norm() / mu.norm())


@pytest.mark.parametrize("name", attacks.ADAPTIVE)
def test_omniscient_adaptive_attack_passes_the_real_screen_at_its_largest_parameter(name: str) -> None:
    honest = honest_rows()
    chosen = attacks.adapt(name, honest, K, gen(1))
    assert chosen.passed and chosen.gamma > 0
    assert passes_screen(honest, chosen.rows)  # the estimate is the truth: nothing is refused
    if not (name == "edge" and chosen.gamma == 1.0):  # edge's γ = 1 is the validator's corner
        beyond = attacks.craft(name, honest, chosen.gamma * 1.5)
        assert not (attacks.paper_bound(name, honest, beyond) and passes_screen(honest, beyond[None]))


@pytest.mark.parametrize("name", attacks.ADAPTIVE)
def test_adaptive_damage_grows_with_the_parameter(name: str) -> None:
    honest = honest_rows()
    gamma = attacks.adapt(name, honest, K, gen(1)).gamma
    values = [damage(honest, attacks.craft(name, honest, t * gamma)) for t in (0.25, 0.5, 1.0)]
    assert values[0] < values[1] < values[2], values


@pytest.mark.parametrize("name", ["alie_search", "ipm_search", "edge", "mimic"])
def test_the_search_adapts_to_the_thresholds(name: str) -> None:
    honest = honest_rows()
    loose = attacks.adapt(name, honest, K, gen(1))
    strict = ValidationConfig(min_norm_ratio=0.8, max_norm_ratio=2.0, min_cosine=0.5, max_variance_ratio=4.0)
    tight = attacks.adapt(name, honest, K, gen(1), config=strict)
    assert tight.passed and passes_screen(honest, tight.rows, strict)
    assert damage(honest, tight.rows[0]) < damage(honest, loose.rows[0])


def test_realistic_estimate_recentres_revealed_deviations_on_the_own_mean() -> None:
    honest = honest_rows()
    own, previous = honest[:K], honest_rows(seed=5)
    deviations = previous - previous.mean(dim=0)
    estimate = attacks.realistic_estimate(own, deviations)
    assert estimate.shape == (K + M, D)
    assert torch.allclose(estimate[K:].mean(dim=0), own.mean(dim=0), atol=1e-5)
    assert torch.equal(attacks.realistic_estimate(own), own)
    with pytest.raises(ValueError, match="deviations have shape"):
        attacks.realistic_estimate(own, deviations[:, :10])


@pytest.mark.parametrize("name", attacks.ADAPTIVE)
def test_realistic_attack_passes_its_own_test_with_a_margin(name: str) -> None:
    honest = honest_rows()
    previous = honest_rows(seed=5)
    estimate = attacks.realistic_estimate(honest[:K], previous - previous.mean(dim=0))
    config = attacks.tightened(ValidationConfig(), attacks.REALISTIC_MARGIN)
    chosen = attacks.adapt(name, estimate, K, gen(1), config=config)
    assert chosen.passed and chosen.gamma > 0
    assert passes_screen(estimate, chosen.rows, config)


def test_tightened_moves_each_threshold_towards_the_centre() -> None:
    config = attacks.tightened(ValidationConfig(min_norm_ratio=0.5, max_norm_ratio=4.0, min_cosine=0.2), 0.5)
    assert (config.min_norm_ratio, config.max_norm_ratio) == (0.75, 2.5)
    assert config.min_cosine == pytest.approx(0.6)
    assert attacks.tightened(ValidationConfig(), 0.0) == ValidationConfig()
    with pytest.raises(ValueError, match="margin < 1"):
        attacks.tightened(ValidationConfig(), 1.0)


def test_fang_sits_beyond_the_honest_extreme_against_the_mean() -> None:
    honest = honest_rows()
    mu = honest.mean(dim=0)
    v = attacks.craft("fang", honest, 0.5)
    below = v <= honest.min(dim=0).values
    above = v >= honest.max(dim=0).values
    assert bool(torch.where(mu > 0, below, above).all())


def test_edge_reaches_the_validator_corner_against_the_honest_median() -> None:
    honest = honest_rows()
    reference = aggregation.coordinate_median(honest)
    v = attacks.craft("edge", honest, 1.0)
    stats = contribution_stats(v, reference)
    assert stats["cosine"] == pytest.approx(ValidationConfig().min_cosine, abs=1e-4)
    assert stats["norm_ratio"] == pytest.approx(ValidationConfig().max_norm_ratio, rel=1e-4)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.double() @ b.double() / (a.double().norm() * b.double().norm()))


def test_edge_against_an_anchor_sits_at_its_floor_and_the_norm_limit() -> None:
    # The anchor (the previous aggregate) near the honest mean: the edge keeps its cosine to the
    # anchor at the floor, which holds its cosine to the median above the validator's limit.
    honest = honest_rows()
    reference = aggregation.coordinate_median(honest)
    anchor = attacks.Anchor(honest.mean(dim=0) + 0.5 * torch.randn(honest.shape[1], generator=gen(3)), 0.3)
    v = attacks.craft("edge", honest, 1.0, anchor=anchor)
    stats = contribution_stats(v, reference)
    assert _cos(v, anchor.direction) == pytest.approx(anchor.floor, abs=1e-4)
    assert stats["cosine"] > ValidationConfig().min_cosine
    assert stats["norm_ratio"] == pytest.approx(ValidationConfig().max_norm_ratio, rel=1e-4)
    # Without the anchor the edge sits at the validator's limit and below the anchor's floor.
    plain = attacks.craft("edge", honest, 1.0)
    assert _cos(plain, anchor.direction) < anchor.floor
    # An anchor the median points away from leaves the edge nothing: the median's direction.
    away = attacks.craft("edge", honest, 1.0, anchor=attacks.Anchor(-reference, 0.1))
    assert contribution_stats(away, reference)["cosine"] == pytest.approx(1.0, abs=1e-6)


def test_unknown_adaptive_attack_is_named() -> None:
    with pytest.raises(ValueError, match="unknown adaptive attack 'nope'"):
        attacks.craft("nope", honest_rows(), 1.0)


def test_a_family_that_cannot_pass_falls_back_to_the_estimated_mean() -> None:
    honest = honest_rows()
    strict = ValidationConfig(min_norm_ratio=0.8, max_norm_ratio=2.0, min_cosine=0.5, max_variance_ratio=4.0)
    chosen = attacks.adapt("fang", honest, K, gen(1), config=strict)  # the extremes sit below cosine 0.5
    assert not chosen.passed and chosen.gamma == 0.0
    assert passes_screen(honest, chosen.rows, strict)  # harmless: the colluders are not caught for it
