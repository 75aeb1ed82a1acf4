import pytest
import torch
from torch import Tensor

from neuroshard.adversary.simulate import SimulationResult, simulate
from neuroshard.node.diloco import DiLoCoConfig, flat_parameters
from neuroshard.node.model import ModelConfig, Transformer

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)
DILOCO = DiLoCoConfig(inner_steps=5, inner_lr=1e-2, warmup_steps=2, total_steps=100)


def counting_batch(seed: int) -> tuple[Tensor, Tensor]:
    """A learnable task: each sequence counts up by 3 (mod vocab) from a random start; (8, 16) each."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, MODEL.vocab_size, (8, 1), generator=gen)
    tokens = (starts + 3 * torch.arange(17)) % MODEL.vocab_size  # (8, 17)
    return tokens[:, :-1], tokens[:, 1:]


def replica_batches(replica: int, step: int) -> tuple[Tensor, Tensor]:
    return counting_batch(10_000 * (replica + 1) + step)


EVAL = [counting_batch(seed) for seed in range(3)]


@pytest.mark.parametrize("replicas", [2, 4])
def test_replicas_learn_a_counting_task(replicas: int) -> None:
    lines: list[str] = []
    result = simulate(
        MODEL,
        DILOCO,
        replicas=replicas,
        rounds=4,
        batches=replica_batches,
        eval_batches=EVAL,
        log=lines.append,
    )
    assert len(result.inner_loss) == len(result.eval_loss) == len(lines) == 4
    assert result.initial_eval_loss is not None
    assert result.initial_eval_loss == pytest.approx(4.16, abs=0.15)  # ≈ ln 64: uniform guessing
    assert result.eval_loss[-1] < 0.5 * result.initial_eval_loss
    assert result.inner_loss[-1] < result.inner_loss[0]
    assert lines[0].startswith("round 0: inner loss ") and "eval loss" in lines[0]


def test_identical_batches_on_every_replica_equal_one_replica() -> None:
    def same_batches(replica: int, step: int) -> tuple[Tensor, Tensor]:
        return replica_batches(0, step)

    one = simulate(MODEL, DILOCO, replicas=1, rounds=2, batches=same_batches)
    four = simulate(MODEL, DILOCO, replicas=4, rounds=2, batches=same_batches)
    # Every replica hands in the same Δ; the mean of four equal float32 vectors is that vector exactly.
    assert torch.equal(one.theta, four.theta)
    assert one.inner_loss == four.inner_loss
    assert one.eval_loss == four.eval_loss == [] and one.initial_eval_loss is None


def test_contribution_hook_is_applied_to_every_replica_every_round() -> None:
    calls: list[tuple[int, int]] = []

    def zero(replica: int, round_index: int, delta: Tensor) -> Tensor:
        calls.append((replica, round_index))
        return torch.zeros_like(delta)

    result = simulate(MODEL, DILOCO, replicas=3, rounds=2, batches=replica_batches, contribution_hook=zero)
    assert calls == [(i, r) for r in range(2) for i in range(3)]
    # Zero contributions everywhere: the outer step never moves θ from θ₀.
    assert torch.equal(result.theta, flat_parameters(Transformer(MODEL).parameters()))


def test_a_byzantine_replica_moves_the_mean_but_not_the_median() -> None:
    def flip(replica: int, round_index: int, delta: Tensor) -> Tensor:
        return -100.0 * delta if replica == 0 else delta

    def median(stack: Tensor) -> Tensor:
        return stack.median(dim=0).values

    def run(**kwargs: object) -> SimulationResult:
        return simulate(
            MODEL,
            DILOCO,
            replicas=3,
            rounds=1,
            batches=replica_batches,
            eval_batches=EVAL,
            **kwargs,  # type: ignore[arg-type]
        )

    honest = run(aggregate=median)
    attacked_mean = run(contribution_hook=flip)
    attacked_median = run(contribution_hook=flip, aggregate=median)
    assert attacked_mean.eval_loss[0] > honest.eval_loss[0] + 1.0
    assert attacked_median.eval_loss[0] < honest.initial_eval_loss  # type: ignore[operator]


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="replicas=0"):
        simulate(MODEL, DILOCO, replicas=0, rounds=1, batches=replica_batches)
    with pytest.raises(ValueError, match="eval_batches is empty"):
        simulate(MODEL, DILOCO, replicas=1, rounds=1, batches=replica_batches, eval_batches=[])


PLAIN = DiLoCoConfig(
    inner_steps=5,
    inner_lr=1e-2,
    warmup_steps=2,
    total_steps=100,
    outer_lr=1.0,
    outer_momentum=0.0,
    outer_nesterov=False,
)
"""Outer SGD lr 1 without momentum: a lone replica's outer step lands where it went."""


def test_delayed_outer_step_with_one_replica_and_plain_outer_sgd_is_local_training() -> None:
    # One replica, outer SGD lr 1 without momentum: θ_round − Δ is where the replica went, so a
    # one-round-late outer step plus the replica's own progress since lands on the same weights.
    now = simulate(MODEL, PLAIN, replicas=1, rounds=3, batches=replica_batches, eval_batches=EVAL)
    late = simulate(
        MODEL, PLAIN, replicas=1, rounds=3, batches=replica_batches, eval_batches=EVAL, delayed_outer=True
    )
    assert torch.allclose(now.theta, late.theta, atol=1e-5)
    assert late.inner_loss == pytest.approx(now.inner_loss, rel=1e-4)
    assert late.eval_loss == pytest.approx(now.eval_loss, rel=1e-4)


def test_delayed_outer_step_lags_a_round_and_still_learns() -> None:
    now = simulate(MODEL, DILOCO, replicas=2, rounds=4, batches=replica_batches, eval_batches=EVAL)
    lines: list[str] = []
    late = simulate(
        MODEL,
        DILOCO,
        replicas=2,
        rounds=4,
        batches=replica_batches,
        eval_batches=EVAL,
        delayed_outer=True,
        log=lines.append,
    )
    assert len(late.eval_loss) == len(late.inner_loss) == len(lines) == 4
    assert not torch.allclose(now.theta, late.theta)  # the overlap changes the maths
    assert late.initial_eval_loss == now.initial_eval_loss
    assert late.eval_loss[-1] < 0.5 * late.initial_eval_loss


def test_eager_updates_with_one_replica_and_plain_outer_sgd_are_local_training() -> None:
    # Alone, eager's step is the replica's own fresh progress: no lag at all.
    now = simulate(MODEL, PLAIN, replicas=1, rounds=3, batches=replica_batches, eval_batches=EVAL)
    eager = simulate(
        MODEL,
        PLAIN,
        replicas=1,
        rounds=3,
        batches=replica_batches,
        eval_batches=EVAL,
        delayed_outer=True,
        proxy="eager",
    )
    assert torch.equal(now.theta, eager.theta)
    assert eager.eval_loss == now.eval_loss


def test_eager_updates_stand_in_for_the_aggregate_in_flight_and_still_learn() -> None:
    """proxy="eager": each replica steps at once on 1/M of its own progress and 1/M of each other
    replica's from the round before; a different trajectory from the own-progress stand-in, and
    it learns. An unknown proxy is refused."""
    runs = {
        proxy: simulate(
            MODEL,
            DILOCO,
            replicas=2,
            rounds=4,
            batches=replica_batches,
            eval_batches=EVAL,
            delayed_outer=True,
            proxy=proxy,
        )
        for proxy in ("own", "eager")
    }
    assert not torch.allclose(runs["own"].theta, runs["eager"].theta)
    assert runs["eager"].eval_loss[-1] < 0.5 * runs["eager"].initial_eval_loss
    with pytest.raises(ValueError, match="proxy"):
        simulate(MODEL, DILOCO, replicas=1, rounds=1, batches=replica_batches, proxy="psychic")
