"""A replica's shareable state — θ_round, outer momentum, round — and adopting a peer's.

What a late, diverged or joining replica takes from a peer is exactly what all honest
replicas of a stage hold bit-identically after an outer step: θ_round (the outer SGD's
only parameter), the outer momentum buffer and the round number. The inner AdamW state
stays local: it is per-replica by construction in DiLoCo (each replica's inner optimizer
only ever saw its own data) and the next round starts from θ_round whatever it holds. The
inner lr schedule comes with the round number (DiLoCo.schedule_step = round × H + inner
steps), so an adopting replica continues it where the stage is rather than warming up again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..diloco import DiLoCo, copy_into_parameters, tensor_digest


@dataclass(frozen=True)
class Snapshot:
    """An immutable copy of the state a replica serves while it trains a round."""

    round: int
    theta: Tensor
    """θ_round (d,) float32, a private copy."""
    momentum: Tensor | None
    """Outer momentum buffer (d,) float32, None before the first outer step."""
    theta_hash: str
    momentum_hash: str
    """sha256 of the momentum buffer's float32 bytes, "" when there is none."""

    @property
    def numel(self) -> int:
        return self.theta.numel()


def momentum_of(diloco: DiLoCo) -> Tensor | None:
    buffer = diloco.outer_optimizer.state.get(diloco.theta_round, {}).get("momentum_buffer")
    return None if buffer is None else buffer.detach()


def snapshot_of(diloco: DiLoCo) -> Snapshot:
    theta = diloco.theta_round.detach().clone()
    momentum = momentum_of(diloco)
    momentum = None if momentum is None else momentum.clone()
    return Snapshot(
        round=diloco.round,
        theta=theta,
        momentum=momentum,
        theta_hash=diloco.weights_hash(),  # remembered: the round line and the next vote reuse it
        momentum_hash="" if momentum is None else tensor_digest(momentum),
    )


@torch.no_grad()
def adopt_state(diloco: DiLoCo, theta: Tensor, momentum: Tensor | None, round_: int) -> None:
    """Put the engine at the start of `round_` with a peer's θ_round and outer momentum.

    Afterwards the model holds θ_round, the round counter is `round_` and the round has no
    inner steps yet; `diloco.step` (inner steps this replica ran) and the inner AdamW state
    are kept (see the module docstring).
    """
    if theta.shape != diloco.theta_round.shape:
        raise ValueError(f"adopted θ has {theta.numel()} values, this replica {diloco.theta_round.numel()}")
    if momentum is not None and momentum.shape != theta.shape:
        raise ValueError(f"adopted momentum has {momentum.numel()} values, θ has {theta.numel()}")
    diloco.theta_round.copy_(theta)
    if momentum is None:
        diloco.outer_optimizer.state.pop(diloco.theta_round, None)
    else:
        diloco.outer_optimizer.state[diloco.theta_round] = {"momentum_buffer": momentum.clone()}
    copy_into_parameters(diloco.theta_round.detach(), diloco.params)
    diloco.round = round_
    diloco.steps_in_round = 0
