"""M DiLoCo replicas of the whole model in one process, for convergence and robustness benchmarks.

Each round every replica runs H inner steps on its own batches, hands in its
pseudo-gradient (optionally transformed by ``contribution_hook``, e.g. to make a
replica Byzantine), the ``aggregate`` rule combines the (M, d) stack into one Δ,
and every replica applies the same outer step. No network, no threads: the
numbers are what the real protocol would compute if every message arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .diloco import DiLoCo, DiLoCoConfig, InnerOptimizerFactory, flat_parameters
from .model import ModelConfig, Transformer, cross_entropy_loss

Batch = tuple[Tensor, Tensor]
BatchFn = Callable[[int, int], Batch]
"""(replica index, inner step) → (input_ids (B, T), labels (B, T))."""
AggregateFn = Callable[[Tensor], Tensor]
"""(M, d) stack of contributions → (d,) aggregated pseudo-gradient."""
ContributionHook = Callable[[int, int, Tensor], Tensor]
"""(replica index, round, Δ (d,)) → the Δ that replica contributes."""


def mean_aggregate(stack: Tensor) -> Tensor:
    """Plain DiLoCo averaging: (M, d) → (d,)."""
    return stack.mean(dim=0)


@dataclass(kw_only=True)
class SimulationResult:
    """What a simulated run measured."""

    inner_loss: list[float]
    """Per round: mean inner-step loss over all replicas and inner steps of that round."""
    eval_loss: list[float]
    """Per round: mean loss of θ_round after that round's outer step on the eval batches (empty if none)."""
    initial_eval_loss: float | None
    """Eval loss of θ₀ before any training (None without eval batches)."""
    theta: Tensor
    """Final θ_round, flat float32 (d,)."""


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[Batch]) -> float:
    """Mean cross-entropy of the model over the batches (each batch weighs the same)."""
    losses = [cross_entropy_loss(model(x), y).item() for x, y in batches]
    return sum(losses) / len(losses)


def simulate(
    model_config: ModelConfig,
    diloco_config: DiLoCoConfig,
    *,
    replicas: int,
    rounds: int,
    batches: BatchFn,
    aggregate: AggregateFn = mean_aggregate,
    eval_batches: Sequence[Batch] | None = None,
    contribution_hook: ContributionHook | None = None,
    inner_optimizer: InnerOptimizerFactory | None = None,
    log: Callable[[str], None] | None = None,
) -> SimulationResult:
    """Run ``rounds`` DiLoCo rounds of ``replicas`` replicas that all start from θ₀(init_seed)."""
    if replicas < 1 or rounds < 0:
        raise ValueError(f"need replicas >= 1 and rounds >= 0, got replicas={replicas} rounds={rounds}")
    if eval_batches is not None and len(eval_batches) == 0:
        raise ValueError("eval_batches is empty; pass None to skip evaluation")
    engines = [
        DiLoCo(Transformer(model_config), diloco_config, inner_optimizer=inner_optimizer)
        for _ in range(replicas)
    ]
    initial_eval = evaluate(engines[0].model, eval_batches) if eval_batches else None
    inner_losses: list[float] = []
    eval_losses: list[float] = []
    for r in range(rounds):
        inner_losses.append(_run_inner_steps(engines, batches))
        contributions = [engine.pseudo_gradient() for engine in engines]
        if contribution_hook is not None:
            contributions = [contribution_hook(i, r, delta) for i, delta in enumerate(contributions)]
        delta = aggregate(torch.stack(contributions))  # (M, d) → (d,)
        for engine in engines:
            engine.outer_step(delta)
        _check_in_sync(engines, r)
        message = f"round {r}: inner loss {inner_losses[-1]:.4f}"
        if eval_batches:
            eval_losses.append(evaluate(engines[0].model, eval_batches))
            message += f", eval loss {eval_losses[-1]:.4f}"
        if log is not None:
            log(message)
    return SimulationResult(
        inner_loss=inner_losses,
        eval_loss=eval_losses,
        initial_eval_loss=initial_eval,
        theta=engines[0].theta_round.detach().clone(),
    )


def _run_inner_steps(engines: list[DiLoCo], batches: BatchFn) -> float:
    """H inner steps on every replica; returns the mean loss over all of them."""
    total, count = 0.0, 0
    for i, engine in enumerate(engines):
        for _ in range(engine.config.inner_steps):
            total += engine.inner_step(*batches(i, engine.step))
            count += 1
    return total / count


def _check_in_sync(engines: list[DiLoCo], round_index: int) -> None:
    """After an outer step every replica must hold the same θ_round, and its model must equal it."""
    reference = engines[0].theta_round.detach()
    for i, engine in enumerate(engines):
        if not torch.equal(engine.theta_round.detach(), reference):
            raise RuntimeError(f"round {round_index}: replica {i}'s θ_round differs from replica 0's")
        if not torch.equal(flat_parameters(engine.params), reference):
            raise RuntimeError(f"round {round_index}: replica {i}'s model weights differ from θ_round")
