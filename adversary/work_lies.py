"""`neuroshard-adversary --work-lie NAME`: a node that misreports its work, to test the replay spot checks.

TESTING ONLY. Unlike the contribution attacks (adversary.contributions), these replicas are
consistent with themselves: the Δ they push to peers, commit to in their receipt and serve
to the verifier is the same. What is false is the claim that this Δ is what H inner steps on
the assigned data give, which only a replay (verifier.replaycheck) can tell:

- ``delta``: trains honestly, then claims DELTA_FACTOR × its Δ (moves its local weights to
  match). The direction is right, so peers' validation lets it through; the norm is not.
- ``data``: reads windows of its assigned shards in an order seeded by something other than
  its wallet id (data it was not assigned), and reports the spans its assigned order names.
  Its receipt's data claim looks exactly like an honest one.
"""

from __future__ import annotations

from typing import Any

import torch

from neuroshard.data import BatchStream, assign_shards
from neuroshard.node.diloco import copy_into_parameters
from neuroshard.node.trainer import Trainer

WORK_LIES = ("delta", "data")
DELTA_FACTOR = 1.25
"""Large against the spot check's 5% norm tolerance, small against the peers' norm-ratio bounds."""


def warning(name: str) -> str:
    return (
        f"WARNING: WORK LIE {name}: this node misreports its work for testing; "
        "the verifier's replay spot checks should catch it"
    )


class ScaledDeltaTrainer(Trainer):
    """Trains honestly, then before handing each round in moves its local weights so that its Δ
    becomes DELTA_FACTOR × Δ: the peers, the receipt and the replay material all see the scaled Δ."""

    factor = DELTA_FACTOR

    def _finish_round(self, seconds: dict[str, float]) -> None:
        diloco = self.diloco
        with torch.no_grad():
            claimed = diloco.theta_round.detach() - self.factor * diloco.pseudo_gradient()
        copy_into_parameters(claimed, diloco.params)
        super()._finish_round(seconds)


class UnassignedDataTrainer(Trainer):
    """Reads the windows of its assigned shards in an order seeded by another string than its
    wallet id, at the same shards and positions: the spans it records stay those of the assigned
    order, the tokens it trains on do not."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        manifest = self.dataset.manifest
        assigned: BatchStream = self.batches  # type: ignore[has-type]  # mypy cannot infer it from Trainer.__init__ here
        self.batches = BatchStream(
            source=self.dataset.source,
            manifest=manifest,
            order=assign_shards(self.wallet_id, manifest, exclude=self.config.held_out_shards),
            seed=f"{self.wallet_id}:not-assigned",
            batch_size=self.config.batch_size,
            seq_len=self.config.seq_len,
            position=assigned.position,
        )


TRAINERS: dict[str, type[Trainer]] = {"delta": ScaledDeltaTrainer, "data": UnassignedDataTrainer}
