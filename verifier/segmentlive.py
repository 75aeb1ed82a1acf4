"""The segment check's side of the live replay checker (verifier.replaycheck): what a receipt
commits to, how its drawn segments are judged, and the batches a stage-0 segment re-reads.

Kept apart from the checker's loop (sampling, fetching, waiting for the round to settle), which
is the same for whole-round replays and segment checks.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from torch import Tensor

from neuroshard.data import Dataset
from neuroshard.node.segment_store import SegmentMaterial
from neuroshard.protocol.identity import wallet_id_of
from neuroshard.protocol.reports import DataSpan
from neuroshard.protocol.segments import segment_boundaries

from . import models as m
from .network import LEGACY_SEGMENTS_PER_ROUND, NetworkDefinition
from .segmentcheck import BatchReader, SegmentClaim, SegmentFraudProof, check_segment, commitment_problems
from .spotcheck import SpotCheckConfig, SpotCheckError, claimed_batches


def segment_root(receipt: m.Receipt) -> tuple[str, int] | None:
    """(segment_root, segments) of a receipt, when it commits to one (and the database keeps it)."""
    root, count = getattr(receipt, "segment_root", None), getattr(receipt, "segments", None)
    return None if root is None or count is None else (root, count)


def allowed_segment_steps(network: NetworkDefinition) -> tuple[int, ...]:
    """The segment lengths a receipt may commit with: the run's k and the H/10 of nodes that hold a
    served definition signed before H/40 became a network.toml's default (they keep it until they
    rejoin). A replica may therefore pick between the two: a check of H/10 segments costs the run's
    budgeted price times (H/10)/k (4x at k = H/40; more where an operator names a shorter k), and is
    held to the run's tolerance all the same (verifier.replaycheck)."""
    legacy = max(1, network.diloco.inner_steps // LEGACY_SEGMENTS_PER_ROUND)
    return tuple(dict.fromkeys((network.segment_k, legacy)))


def segment_count_problem(receipt: m.Receipt, allowed: Collection[int]) -> str | None:
    """Why a receipt's committed segment count follows none of the `allowed` segment lengths (None
    when it follows one). A replica that chose its own k would choose the verifier's cost: one
    segment of H steps makes every check a whole-round replay, which the budget does not pay for."""
    committed = segment_root(receipt)
    if committed is None:
        return None
    counts = {len(segment_boundaries(receipt.inner_steps, k)) - 1: k for k in allowed}
    if committed[1] in counts:
        return None
    wanted = " or ".join(f"{c} (k = {k})" for c, k in counts.items())
    return f"commits to {committed[1]} segments; the run's segment length gives {wanted} for {receipt.inner_steps} inner steps"


def max_segment_steps(inner_steps: int, segments: int) -> int:
    """The most inner steps one segment of a round can hold: k·(segments − 1) < H ≤ k·segments."""
    return inner_steps if segments <= 1 else math.ceil(inner_steps / (segments - 1))


def batch_reader(dataset: Dataset, network: NetworkDefinition, wallet_id: str) -> BatchReader:
    """A stage-0 step's batch, re-read from the wallet's assigned data as the node read it."""

    def read(span: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
        batches = claimed_batches(
            source=dataset.source, manifest=dataset.manifest, wallet_id=wallet_id,
            spans=[DataSpan(shard_id=span[0], offset_start=span[1], offset_end=span[2])],
            batch_size=network.batch_size, seq_len=network.seq_len,
        )  # fmt: skip
        if len(batches) != 1:
            raise SpotCheckError(f"a step's span {span} holds {len(batches)} batches, not one")
        return batches[0]

    return read


@dataclass
class SegmentsJudged:
    ok: bool
    detail: str
    proofs: list[tuple[int, bytes]] = field(default_factory=list)
    """(segment, SegmentFraudProof bytes) of segments that failed their replay on committed material."""
    credit: bool = True
    """False for a pass of a log that carries offers from a crashed run of the round
    (protocol.segments.SegmentLog.carries): those are listed, not replayed, so the pass proves less
    than a round's check should; it earns the wallet no reputation and no admission, as a receipt
    with no segment root earns none (verifier.replaycheck)."""


def judge_segments(
    network: NetworkDefinition,
    receipt: m.Receipt,
    pieces: Mapping[int, SegmentMaterial],
    tolerance: SpotCheckConfig,
    dataset: Dataset | None,
    *,
    replay: Collection[int] | None = None,
) -> SegmentsJudged:
    """Check the segments of a receipt in order; the first that fails decides. Those in `replay`
    (default: all) are replayed; the others are checked against the commitments only (the round's
    last segment, fetched for its end checkpoint: the receipt's Δ must come from it)."""
    root = segment_root(receipt)
    if root is None:
        raise ValueError(f"receipt of {receipt.wallet_id} round {receipt.round} commits to no segment root")
    spans = [(s, a, b) for s, a, b in receipt.data_spans]
    allowed = allowed_segment_steps(network)
    cosines = []
    for j, material in sorted(pieces.items()):
        if material.log.segment_steps not in allowed:
            return SegmentsJudged(
                False,
                f"segment {j}: the log's segments are of {material.log.segment_steps} steps, not {allowed}",
            )
        signer = material.commitment.wallet
        if wallet_id_of(bytes.fromhex(signer)) != receipt.wallet_id:
            return SegmentsJudged(False, f"segment {j}: the commitment is signed by another wallet")
        claim = SegmentClaim(
            model=network.model, diloco=network.diloco, num_stages=network.num_stages,
            stage=receipt.stage, round=receipt.round, wallet=signer, root=root[0], spans=spans,
            base_hash=receipt.base_hash, delta_digest=receipt.delta_digest,
            trained_precision=getattr(receipt, "precision", None), network=network.digest(),
        )  # fmt: skip
        read = None
        if receipt.stage == 0:
            assert dataset is not None, "stage-0 segments re-read the wallet's data"
            read = batch_reader(dataset, network, receipt.wallet_id)
        if replay is not None and j not in replay:
            problems = commitment_problems(material, claim)
            if problems:
                return SegmentsJudged(
                    False, f"segment {j} of {root[1]} (not replayed): {'; '.join(problems)}"
                )
            continue
        try:
            verdict = check_segment(claim, material, tolerance, read_batch=read)
        except SpotCheckError as exc:
            return SegmentsJudged(False, f"segment {j} cannot be replayed: {exc}")
        if not verdict.ok:
            proofs = [(j, SegmentFraudProof(material).encode())] if verdict.replayed else []
            return SegmentsJudged(False, f"segment {j} of {root[1]}: {verdict.reason}", proofs)
        if verdict.cosine is not None:
            cosines.append(verdict.cosine)
    replayed = sorted(pieces) if replay is None else sorted(set(pieces) & set(replay))
    also = sorted(set(pieces) - set(replayed))
    checked = f"; segment {also[0]} checked against its commitments" if also else ""
    carried = any(material.log.carries for material in pieces.values())
    return SegmentsJudged(
        True,
        f"segments {replayed} of {root[1]} replayed, cosine ≥ {min(cosines):.6f}{checked}"
        + ("; its log carries offers of a crashed run (listed, not replayed)" if carried else ""),
        credit=not carried,
    )
