"""The pure maths of a partitioned round: cut Δ into parts, reduce one part, re-check a claim.

Nothing here does I/O. An owner calls `reduce_part` on the parts it gathered; a checker calls the
same function on the same signed inputs and must get the same bytes (`recompute`), so a claim that
differs is a fraud proof anyone can verify (`check_fraud`).

Per-part rules. The aggregation rule and the content screening run on each part alone:

- coordinate-wise rules (mean, trimmed mean, median) decompose: the aggregate of part j is
  coordinates [a_j, b_j) of the whole-vector aggregate of the same inputs, bit for bit at every
  n (each column is sorted and summed row by row on its own: ``aggregation``);
- whole-vector rules (Krum, multi-Krum, geometric median, centered clipping — the default rule
  from 5 rows — and NNM) and the screening statistics (norm ratio, cosine, variance ratio
  against the coordinate median, near-copies) become per-part variants: a contribution is
  judged, selected or weighted on each part by that part's statistics, and one refused on part j
  is dropped from part j only. Each part then sees at least as many honest rows as the whole
  vector would, and an attacker must pass every part's checks to reach every part. What is lost:
  a distortion spread thinly over all parts, each slice inside its part's limits, is judged
  slice by slice rather than whole (bench/robustness.py measures the default rule both ways).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.refusal import Refused, malformed
from neuroshard.protocol.round import FraudProof, InputList, RoundCommitment

from ..codec import decode_delta, encode_delta
from ..validation import ValidationConfig, screen_round
from .partition import merkle_proofs, merkle_root, merkle_verify, proof_depth

AggregationRule = Callable[[Tensor], Tensor]
"""(n, L) float32 rows in wallet order -> (L,) aggregate."""

MIN_SCREENED = 3
"""Fewest rows the content checks run on (the median of two is their mean: one sign-flipped row
would drag the reference to ~0 and get the honest one refused too)."""


@functools.lru_cache(maxsize=64)
def encoded_size(encoding: str, numel: int) -> int:
    """Bytes of an encoded part of `numel` values (0 for an empty part); the safetensors header
    depends on the shapes only, so a zero vector of the same length has the same size."""
    return 0 if numel == 0 else len(encode_delta(torch.zeros(numel), encoding))


def encode_part(values: Tensor, encoding: str) -> bytes:
    return b"" if values.numel() == 0 else encode_delta(values, encoding)


def decode_part(data: bytes, encoding: str, numel: int) -> Tensor:
    """Raises Refused (codec) when `data` is not exactly an encoded part of `numel` values."""
    if numel == 0:
        if data:
            raise malformed("an empty part must be empty")
        return torch.zeros(0)
    return decode_delta(data, encoding, numel)


def part_spans(bounds: Sequence[tuple[int, int]], encoding: str) -> list[tuple[int, int]]:
    """Byte range [start, end) of each part *with its proof* in the Δ object."""
    slot = 32 * proof_depth(len(bounds))
    spans, at = [], 0
    for a, b in bounds:
        end = at + slot + encoded_size(encoding, b - a)
        spans.append((at, end))
        at = end
    return spans


def delta_object(delta: Tensor, bounds: Sequence[tuple[int, int]], encoding: str) -> tuple[bytes, str]:
    """The Δ object a contributor publishes, and the Merkle root its commitment signs: per part, its
    proof slot then its encoded bytes (`part_spans` gives the offsets)."""
    parts = [encode_part(delta[a:b], encoding) for a, b in bounds]
    hashes = [sha256_hex(p) for p in parts]
    proofs = merkle_proofs(hashes)
    return b"".join(proof + part for proof, part in zip(proofs, parts, strict=True)), merkle_root(hashes)


def split_slot(data: bytes, count: int) -> tuple[bytes, bytes]:
    """(proof, part bytes) of one ranged read of the Δ object."""
    slot = 32 * proof_depth(count)
    return data[:slot], data[slot:]


def part_matches(commitment: RoundCommitment, part: int, count: int, proof: bytes, data: bytes) -> bool:
    """Whether `data` is part `part` of the Δ `commitment` signed."""
    return merkle_verify(commitment.parts_root, sha256_hex(data), part, count, proof)


def reduce_part(
    rows: Mapping[str, Tensor],
    rule: AggregationRule,
    validation: ValidationConfig | None,
    length: int | None = None,
) -> tuple[Tensor, dict[str, str]]:
    """Screen the part's rows (wallet -> (L,) float32) and aggregate the kept ones in wallet order.

    Returns (aggregate, refused wallet -> reason). With fewer than MIN_SCREENED rows, or when the
    part's median is all zeros, nothing is screened (every replica holding these rows does the same).
    With every row refused the aggregate is zeros."""
    wallets = sorted(rows)
    if length is None:  # the part's length, when there are rows to tell it
        length = next(iter(rows.values())).numel() if rows else 0
    refused: dict[str, str] = {}
    if validation is not None and len(wallets) >= MIN_SCREENED and length > 0:
        try:
            verdicts = screen_round({w: rows[w] for w in wallets}, (length,), validation)
            refused = {w: v.reason for w, v in verdicts.items() if not v.ok}
        except ValueError:
            refused = {}
    kept = [w for w in wallets if w not in refused]
    if not kept or length == 0:
        return torch.zeros(length), refused
    stack = torch.stack([rows[w] for w in kept])
    return rule(stack).to(torch.float32).contiguous(), refused


def recompute(
    inputs: InputList,
    parts: Mapping[str, bytes],
    length: int,
    encoding: str,
    rule: AggregationRule,
    validation: ValidationConfig | None,
) -> tuple[bytes, int, dict[str, str]]:
    """The encoded aggregate, accepted count and refusals that `inputs` give: what an honest owner signs.
    `parts` maps each considered wallet to its part bytes (already matched to its commitment)."""
    rows = {c.wallet: decode_part(parts[c.wallet], c.encoding, length) for c in inputs.considered}
    aggregate, refused = reduce_part(rows, rule, validation, length)
    return encode_part(aggregate, encoding), len(rows) - len(refused), refused


class FraudCheck:
    """The verdict on a fraud proof: `fraud` True only when every signature and hash in it checks
    out and the recomputed aggregate differs from the claim's; `reason` says which check decided."""

    def __init__(self, fraud: bool, reason: str, aggregate: bytes | None = None) -> None:
        self.fraud = fraud
        self.reason = reason
        self.aggregate = aggregate
        """The correct encoded aggregate of the part (when the proof holds): what replaces it."""


def check_fraud(
    proof: FraudProof,
    *,
    owner: str,
    members: Sequence[str],
    bounds: Sequence[tuple[int, int]],
    stage: int,
    round_: int,
    base_hash: str,
    members_sha256: str,
    rule: AggregationRule,
    validation: ValidationConfig | None,
) -> FraudCheck:
    """Check a fraud proof alone (module docstring): any third party can run this."""
    claim, inputs = proof.claim, proof.inputs
    where = (claim.stage, claim.round, claim.base_hash, claim.members_sha256)
    if where != (stage, round_, base_hash, members_sha256) or claim.wallet != owner:
        return FraudCheck(False, "the claim is not this round's claim of that owner")
    if not claim.signature_valid():
        return FraudCheck(False, "the claim's signature does not verify")
    if inputs.sha256() != claim.inputs_sha256 or inputs.part != claim.part:
        return FraudCheck(False, "the input list is not the one the claim signs")
    if not 0 <= claim.part < len(bounds) or len(proof.parts) != len(inputs.considered):
        return FraudCheck(False, "the proof's parts do not match its input list")
    a, b = bounds[claim.part]
    parts: dict[str, bytes] = {}
    for commitment, (merkle, data) in zip(inputs.considered, proof.parts, strict=True):
        # The input list is the owner's signed statement: only the owner can have put a commitment
        # there that an honest owner refuses (`round._commitment_problem`), so it convicts the owner.
        if not commitment.signature_valid() or commitment.wallet not in members:
            return FraudCheck(
                True, f"the owner took input {commitment.wallet[:12]}: not a member's signed commitment"
            )
        if (commitment.stage, commitment.round, commitment.base_hash, commitment.members_sha256) != where:
            return FraudCheck(
                True, f"the owner took input {commitment.wallet[:12]}: a commitment of another round"
            )
        if not part_matches(commitment, claim.part, len(members), merkle, data):
            return FraudCheck(False, f"input {commitment.wallet[:12]}: part does not match its commitment")
        parts[commitment.wallet] = data
    try:
        aggregate, accepted, _ = recompute(inputs, parts, b - a, claim.encoding, rule, validation)
    except (Refused, ValueError) as exc:
        return FraudCheck(True, f"an input the owner took does not decode ({exc})")
    if sha256_hex(aggregate) != claim.aggregate_sha256 or accepted != claim.accepted:
        return FraudCheck(True, "the signed aggregate is not what its signed inputs give", aggregate)
    return FraudCheck(False, "the claim is correct", aggregate)
