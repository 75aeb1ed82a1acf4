import math

import pytest
import torch

from neuroshard.node import attacks


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
    assert len(set(attacks.ATTACKS)) == 11
    assert all(callable(getattr(attacks, name)) for name in attacks.ATTACKS)
    assert not math.isnan(attacks.alie_z(13, 3))
