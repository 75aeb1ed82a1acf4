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

from neuroshard.node.diloco import (
    DiLoCo,
    DiLoCoConfig,
    InnerOptimizerFactory,
    copy_into_parameters,
    flat_parameters,
)
from neuroshard.node.model import ModelConfig, Transformer, cross_entropy_loss

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
    delayed_outer: bool = False,
    proxy: str = "own",
) -> SimulationResult:
    """Run ``rounds`` DiLoCo rounds of ``replicas`` replicas that all start from θ₀(init_seed).

    ``delayed_outer``: the round overlaps the next round's inner steps (the one-round-delayed
    outer update of eager updates, Kale et al. 2025, and streaming DiLoCo's overlap, Douillard
    et al. 2025). A replica contributes its own progress over the round and trains on at once;
    the aggregate lands one round later on θ_round, and the replica goes on from the new θ_round
    plus its own progress over the round as a stand-in for the aggregate still in flight
    (``proxy="own"``, ``_run_delayed``). ``proxy="eager"``: eager updates (Kale et al. 2025,
    ``_run_eager``): each replica takes its own outer step at once, on 1/M of its own progress
    plus 1/M of each other replica's progress over the round before (the freshest of theirs it
    holds), so replicas' θ_round differ by their own latest progress; eager uses the plain mean
    (its step is a mean by construction) and ignores ``aggregate``. Same number of outer steps:
    the last aggregate is applied after the last round.
    """
    if proxy not in ("own", "eager"):
        raise ValueError(f"proxy must be 'own' or 'eager', got {proxy!r}")
    if replicas < 1 or rounds < 0:
        raise ValueError(f"need replicas >= 1 and rounds >= 0, got replicas={replicas} rounds={rounds}")
    if eval_batches is not None and len(eval_batches) == 0:
        raise ValueError("eval_batches is empty; pass None to skip evaluation")
    engines = [
        DiLoCo(Transformer(model_config), diloco_config, inner_optimizer=inner_optimizer)
        for _ in range(replicas)
    ]
    if delayed_outer:
        if diloco_config.outer_warmup_rounds:
            # The delayed schedules spend outer-step indices on empty or late steps, so a ramp
            # keyed on the engine's round would scale the wrong aggregates.
            raise ValueError("simulate(delayed_outer=True) does not support an outer warm-up")
        if proxy == "eager":
            return _run_eager(engines, model_config, rounds, batches, eval_batches, log)
        return _run_delayed(engines, model_config, rounds, batches, aggregate, eval_batches, log)
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


def _run_delayed(
    engines: list[DiLoCo],
    model_config: ModelConfig,
    rounds: int,
    batches: BatchFn,
    aggregate: AggregateFn,
    eval_batches: Sequence[Batch] | None,
    log: Callable[[str], None] | None,
) -> SimulationResult:
    """simulate(delayed_outer=True). Replica i's round r runs from s_i to e_i and contributes
    Δ_i = s_i − e_i; at the round's end θ_round takes the previous round's aggregate (none after
    round 0: a zero step, which leaves θ and the momentum's first step as they were) and the
    next round starts at s_i = θ_round − Δ_i. θ_round, evaluated on a model of its own, lags
    the replicas by the round whose aggregate is in flight."""
    scorer = Transformer(model_config)
    initial_eval = evaluate(scorer, eval_batches) if eval_batches else None
    starts = [flat_parameters(engine.params) for engine in engines]
    pending = torch.zeros_like(starts[0])
    inner_losses: list[float] = []
    eval_losses: list[float] = []
    for r in range(rounds + 1):
        if r < rounds:
            inner_losses.append(_run_inner_steps(engines, batches))
            progress = [start - flat_parameters(e.params) for start, e in zip(starts, engines, strict=True)]
        else:  # the last aggregate lands after training: the same outer steps as without overlap
            progress = [torch.zeros_like(pending) for _ in engines]
        for i, engine in enumerate(engines):
            engine.outer_step(pending)
            starts[i] = engine.theta_round.detach() - progress[i]
            copy_into_parameters(starts[i], engine.params)
        if r < rounds:
            pending = aggregate(torch.stack(progress))  # (M, d) → (d,), applied next round
        if eval_batches and r > 0:
            eval_losses.append(_score_theta(scorer, engines[0], eval_batches))
        if log is not None and r < rounds:
            log(f"round {r}: inner loss {inner_losses[-1]:.4f} (outer step one round behind)")
    return SimulationResult(
        inner_loss=inner_losses,
        eval_loss=eval_losses,
        initial_eval_loss=initial_eval,
        theta=engines[0].theta_round.detach().clone(),
    )


def _run_eager(
    engines: list[DiLoCo],
    model_config: ModelConfig,
    rounds: int,
    batches: BatchFn,
    eval_batches: Sequence[Batch] | None,
    log: Callable[[str], None] | None,
) -> SimulationResult:
    """simulate(delayed_outer=True, proxy="eager"). At the end of round r replica i steps its own
    θ_round on Δ̃_i = (Δ_i(r) + Σ_{j≠i} Δ_j(r−1)) / M — its fresh progress and the others' of the
    round before, each replica's progress passing through every outer optimizer exactly once —
    and trains on from there. After the last round each applies the others' last progress. Replica
    0's θ_round is evaluated (its model, which goes on training, is left alone)."""
    scorer = Transformer(model_config)
    initial_eval = evaluate(scorer, eval_batches) if eval_batches else None
    m = len(engines)
    before = [torch.zeros_like(engines[0].theta_round.detach()) for _ in engines]
    inner_losses: list[float] = []
    eval_losses: list[float] = []
    for r in range(rounds + 1):
        if r < rounds:
            inner_losses.append(_run_inner_steps(engines, batches))
            progress = [engine.pseudo_gradient() for engine in engines]
        else:  # the others' last progress lands after training
            progress = [torch.zeros_like(b) for b in before]
        others = torch.stack(before).sum(dim=0)
        for i, engine in enumerate(engines):
            engine.outer_step((progress[i] + (others - before[i])) / m)
        before = progress
        # One evaluation per round: after rounds 0 … R−2 (the others' latest still to come), and
        # the last once every progress has landed.
        if eval_batches and rounds > 0 and r != rounds - 1:
            eval_losses.append(_score_theta(scorer, engines[0], eval_batches))
        if log is not None and r < rounds:
            log(f"round {r}: inner loss {inner_losses[-1]:.4f} (eager: others' progress one round behind)")
    return SimulationResult(
        inner_loss=inner_losses,
        eval_loss=eval_losses,
        initial_eval_loss=initial_eval,
        theta=engines[0].theta_round.detach().clone(),
    )


def _score_theta(scorer: Transformer, engine: DiLoCo, eval_batches: Sequence[Batch]) -> float:
    """Held-out loss of `engine`'s θ_round, on a model of its own (the engine's model trains on)."""
    copy_into_parameters(engine.theta_round.detach(), scorer.parameters())
    return evaluate(scorer, eval_batches)


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
