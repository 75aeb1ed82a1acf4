"""`neuroshard-node --work-lie NAME`: a node that misreports its work, to test the replay spot checks.

TESTING ONLY. Unlike the contribution attacks (node.p2p.byzantine), these replicas are
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

import argparse

import torch

from neuroshard.data import BatchStream, assign_shards

from .diloco import DiLoCo, copy_into_parameters
from .trainer import RoundFinisher, Trainer

WORK_LIES = ("delta", "data")
DELTA_FACTOR = 1.25
"""Large against the spot check's 5% norm tolerance, small against the peers' norm-ratio bounds."""


def add_work_lie_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--work-lie",
        choices=WORK_LIES,
        help="TESTING ONLY: misreport this node's work (node/work_lies.py) to exercise the replay spot checks",
    )


def warning(name: str) -> str:
    return (
        f"WARNING: WORK LIE {name}: this node misreports its work for testing; "
        "the verifier's replay spot checks should catch it"
    )


def claim_scaled_delta(finish: RoundFinisher, factor: float = DELTA_FACTOR) -> RoundFinisher:
    """A round hook that, before `finish`, moves the local weights so that Δ becomes factor × Δ."""

    def lying(diloco: DiLoCo) -> None:
        with torch.no_grad():
            claimed = diloco.theta_round.detach() - factor * diloco.pseudo_gradient()
        copy_into_parameters(claimed, diloco.params)
        finish(diloco)

    return lying


def read_unassigned_windows(trainer: Trainer) -> None:
    """Swap the trainer's batch stream for one over the same shards and positions whose window
    order is seeded by another string: the recorded spans stay those of the assigned order."""
    manifest = trainer.dataset.manifest
    trainer.batches = BatchStream(
        source=trainer.dataset.source,
        manifest=manifest,
        order=assign_shards(trainer.wallet_id, manifest, exclude=trainer.config.held_out_shards),
        seed=f"{trainer.wallet_id}:not-assigned",
        batch_size=trainer.config.batch_size,
        seq_len=trainer.config.seq_len,
        position=trainer.batches.position,
    )
