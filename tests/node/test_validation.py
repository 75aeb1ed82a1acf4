from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch
from torch import Tensor

from neuroshard.adversary import attacks
from neuroshard.adversary.simulate import simulate
from neuroshard.node import aggregation
from neuroshard.node.diloco import DiLoCoConfig, flat_parameters
from neuroshard.node.model import ModelConfig, Transformer
from neuroshard.node.validation import (
    ValidationConfig,
    ValidationResult,
    contribution_stats,
    find_copies,
    robust_reference,
    screen_round,
    validate_contribution,
)

if TYPE_CHECKING:  # the fixture's type only; importing conftest at run time would load it twice
    from conftest import PublishedData

REPLICAS = 6
# Plain outer SGD, so θ₁ − θ₀ = −outer_lr · (round 0's aggregate) exactly, for wrong_base. The lr is
# pinned (0.7, the old default): wrong_base's expected verdicts were calibrated on it.
DILOCO = DiLoCoConfig(
    inner_steps=5,
    inner_lr=1e-2,
    warmup_steps=2,
    total_steps=15,
    outer_lr=0.7,
    outer_momentum=0.0,
    outer_nesterov=False,
)


@dataclass(frozen=True)
class Run:
    """Contributions by round of a short real simulation, and θ at the start of each round."""

    rounds: list[list[Tensor]]
    thetas: list[Tensor]


@pytest.fixture(scope="module")
def run(published: "PublishedData") -> Run:
    """A tiny LM on real text (standard-library source), 6 replicas, 3 rounds of 5 inner steps."""
    dataset = published.dataset
    vocab = dataset.tokenizer.vocab_size
    tokens = torch.cat([dataset.source.fetch(info) for info in dataset.manifest.shards]).long()
    model = ModelConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)
    region = tokens.numel() // REPLICAS

    def batches(replica: int, step: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1000 * replica + step)
        starts = torch.randint(0, region - 33, (4,), generator=g) + replica * region
        w = tokens[starts[:, None] + torch.arange(33)]  # (4, 33)
        return w[:, :-1], w[:, 1:]

    rounds: list[list[Tensor]] = [[] for _ in range(3)]

    def record(replica: int, round_index: int, delta: Tensor) -> Tensor:
        rounds[round_index].append(delta.clone())
        return delta

    simulate(model, DILOCO, replicas=REPLICAS, rounds=3, batches=batches, contribution_hook=record)
    thetas = [flat_parameters(Transformer(model).parameters())]
    for contributions in rounds[:-1]:
        thetas.append(thetas[-1] - DILOCO.outer_lr * aggregation.mean(contributions))
    return Run(rounds=rounds, thetas=thetas)


def wallets(deltas: list[Tensor]) -> dict[str, Tensor]:
    return {f"w{i}": d for i, d in enumerate(deltas)}


def test_honest_contributions_of_a_real_simulation_pass(run: Run) -> None:
    for r, deltas in enumerate(run.rounds):
        verdicts = screen_round(wallets(deltas), tuple(deltas[0].shape))
        assert all(v.ok for v in verdicts.values()), (r, {w: v.reason for w, v in verdicts.items()})
        reference = robust_reference(deltas)
        for delta in deltas:
            assert validate_contribution(delta, reference).ok


def test_defaults_are_calibrated_for_the_median_not_for_a_single_delta(run: Run) -> None:
    # Two honest Δs agree far less than a Δ and the median (which averages the noise out):
    # a node validating against its own Δ needs a looser cosine threshold.
    deltas = run.rounds[2]
    reference = robust_reference(deltas)
    to_median = min(contribution_stats(d, reference)["cosine"] for d in deltas)
    to_one = min(contribution_stats(d, deltas[0])["cosine"] for d in deltas[1:])
    assert to_one < to_median
    assert validate_contribution(deltas[1], deltas[0], ValidationConfig(min_cosine=0.0)).ok


def attacked_round(run: Run, attack: str) -> dict[str, Tensor]:
    """Round 2's contributions with wallet w5's Δ replaced by the attack."""
    deltas = list(run.rounds[2])
    mine, g = deltas[5], torch.Generator().manual_seed(7)
    rms = float(torch.stack(deltas[:5]).norm() / 5**0.5)
    replace = {
        "sign_flip": lambda: attacks.sign_flip(mine),
        "scale": lambda: attacks.scale(mine, 10.0),
        "gaussian": lambda: attacks.gaussian(mine, 10 * rms / mine.numel() ** 0.5, g),
        "zero": lambda: attacks.zero(mine),
        "copy": lambda: attacks.copy(deltas[0], 0.01, g),
        "copy_exact": lambda: attacks.copy(deltas[0]),
        "nan": lambda: attacks.nan(mine, 1, g),
        "wrong_base": lambda: attacks.wrong_base(mine, run.thetas[2], run.thetas[0]),
    }
    deltas[5] = replace[attack]()
    return wallets(deltas)


@pytest.mark.parametrize(
    ("attack", "code"),
    [
        ("sign_flip", "cosine"),
        ("scale", "norm_ratio"),
        ("gaussian", "norm_ratio"),
        ("zero", "zero"),
        ("nan", "nonfinite"),
        ("wrong_base", "cosine"),
    ],
)
def test_attacks_are_caught(run: Run, attack: str, code: str) -> None:
    deltas = attacked_round(run, attack)
    verdicts = screen_round(deltas, tuple(deltas["w0"].shape))
    assert verdicts["w5"].code == code, verdicts["w5"]
    assert [w for w, v in verdicts.items() if not v.ok] == ["w5"]


@pytest.mark.parametrize("attack", ["copy", "copy_exact"])
def test_copies_flag_the_whole_group(run: Run, attack: str) -> None:
    deltas = attacked_round(run, attack)
    assert find_copies(deltas) == [frozenset({"w0", "w5"})]
    verdicts = screen_round(deltas, tuple(deltas["w0"].shape))
    # Content cannot tell the original from the copy: both are rejected.
    assert {w for w, v in verdicts.items() if not v.ok} == {"w0", "w5"}
    assert verdicts["w0"].reason == "duplicate: within 5% relative L2 of w5"


def test_find_copies_groups_transitively_and_skips_zeros() -> None:
    base = torch.randn(500, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    deltas = {
        "a": base,
        "b": attacks.copy(base, 0.03, g),
        "c": attacks.copy(base, 0.03, g),
        "d": torch.randn(500, generator=g),
        "z1": torch.zeros(500),
        "z2": torch.zeros(500),
    }
    assert find_copies(deltas) == [frozenset({"a", "b", "c"})]
    assert find_copies(deltas, tolerance=0.01) == []
    assert find_copies({"a": base}) == []


def test_structural_checks() -> None:
    reference = torch.ones(4)
    assert validate_contribution("nope", reference).code == "type"
    assert validate_contribution(torch.ones(4, dtype=torch.float64), reference).reason == (
        "dtype: got torch.float64, expected torch.float32"
    )
    assert validate_contribution(torch.ones(5), reference).reason == "shape: got (5,), expected (4,)"
    inf = torch.tensor([1.0, float("inf"), 1.0, 1.0])
    assert validate_contribution(inf, reference).reason == "nonfinite: 1 of 4 values are NaN or inf"


def test_statistics_and_thresholds_by_hand() -> None:
    reference = torch.tensor([1.0, 2.0, 3.0, 4.0])
    stats = contribution_stats(2 * reference, reference)
    assert stats["norm_ratio"] == pytest.approx(2.0)
    assert stats["cosine"] == pytest.approx(1.0)
    assert stats["variance_ratio"] == pytest.approx(4.0)
    assert validate_contribution(2 * reference, reference).ok
    strict = ValidationConfig(max_norm_ratio=1.5)
    verdict = validate_contribution(2 * reference, reference, strict)
    assert verdict == ValidationResult(
        ok=False, reason="norm_ratio: ‖Δ‖/‖reference‖ = 2 outside [0.5, 1.5]", stats=stats
    )
    # A constant vector of the right norm: its variance is 0.
    flat = torch.full((4,), float(reference.norm()) / 2)
    assert validate_contribution(flat, reference, ValidationConfig(min_cosine=-1.0)).code == "variance_ratio"


def test_bad_reference_and_config_raise() -> None:
    with pytest.raises(ValueError, match="all zeros"):
        validate_contribution(torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        validate_contribution(torch.ones(2), torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="min_norm_ratio < max_norm_ratio, got 2, 1"):
        ValidationConfig(min_norm_ratio=2, max_norm_ratio=1)
    with pytest.raises(ValueError, match="none of the 1 contributions"):
        screen_round({"a": torch.ones(3)}, (4,))


@pytest.mark.parametrize("n", range(1, 10))
def test_reference_median_equals_the_sorted_median_whatever_the_order(n: int) -> None:
    from neuroshard.node.aggregation import coordinate_median

    gen = torch.Generator().manual_seed(n)
    rows = [torch.randn(257, generator=gen) for _ in range(n)]
    rows[0][:5] = rows[-1][:5]  # ties
    expected = coordinate_median(rows)
    for perm in (list(range(n)), list(reversed(range(n)))):
        assert torch.equal(robust_reference([rows[i] for i in perm]), expected)
    assert torch.equal(robust_reference(torch.stack(rows)), expected)


def test_blocked_statistics_equal_the_float64_formulas(monkeypatch: pytest.MonkeyPatch) -> None:
    # Blocks of 64 columns over 1,000: the sums run across many blocks and a short last one.
    monkeypatch.setattr(aggregation, "MEDIAN_BLOCK", 64)
    gen = torch.Generator().manual_seed(0)
    common = torch.randn(1000, generator=gen) + 0.3
    deltas = {f"w{i}": common + 0.5 * torch.randn(1000, generator=gen) for i in range(4)}
    deltas["copy"] = deltas["w1"] * (1 + 0.03 * torch.randn(1000, generator=gen))
    verdicts = screen_round(deltas, (1000,))
    reference = robust_reference(list(deltas.values())).double()
    for wallet, delta in deltas.items():
        d = delta.double()
        stats = verdicts[wallet].stats
        assert stats["norm"] == pytest.approx(float(d.norm()), rel=1e-12)
        assert stats["reference_norm"] == pytest.approx(float(reference.norm()), rel=1e-12)
        assert stats["cosine"] == pytest.approx(
            float(d @ reference / (d.norm() * reference.norm())), rel=1e-12
        )
        expected_var = float(d.var(correction=0) / reference.var(correction=0))
        assert stats["variance_ratio"] == pytest.approx(expected_var, rel=1e-12)
    assert sorted(w for w, v in verdicts.items() if not v.ok) == ["copy", "w1"]
    shuffled = dict(reversed(list(deltas.items())))
    assert screen_round(shuffled, (1000,)) == verdicts  # the same stats, bit for bit


def test_copies_are_told_apart_at_the_tolerance() -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(10_000, generator=gen, dtype=torch.float64)
    noise = torch.randn(10_000, generator=gen, dtype=torch.float64)
    noise -= (noise @ base) / (base @ base) * base  # orthogonal to base
    noise *= base.norm() / noise.norm()  # and as long
    # ‖b − a‖ = s·‖a‖ and ‖b‖ = √(1 + s²)·‖a‖: within 5% of max(‖a‖, ‖b‖) iff s ≤ 0.05·√(1 + s²), s ≲ 0.05006.
    near, far = (base + 0.0500 * noise).float(), (base + 0.0501 * noise).float()
    assert find_copies({"a": base.float(), "b": near}) == [frozenset({"a", "b"})]
    assert find_copies({"a": base.float(), "b": far}) == []
