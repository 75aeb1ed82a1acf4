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

The anchor check (`AnchorCheck`, issue 13) judges the one thing a part cannot show: the *whole*
Δ's direction. In a round with an anchor — a public (d,) vector every member holds bit for bit,
the outer optimizer's momentum buffer — each contributor commits to ⟨Δ, anchor⟩ and ‖Δ‖² over its
decoded parts as the totals of a Merkle sum tree (``partition.sum_tree_root``), and a contributor
whose whole-Δ cosine to the anchor is below the floor is refused on every part before the part's
screening, by every owner alike, from its signed commitment alone. Each owner checks its part's
leaf against the part it reads (`share_problem`), and every checker does the same for the parts it
re-reads: a contributor that states totals its parts do not have has a false leaf (or inner sum)
on some part's path, which that part's reader sees and proves to every member (``SumLie``). A
liar knows the owner map when it commits, so it can lie on a part it or a colluder owns, where
only that part's checkers see it; its row counts in the round it lies and it is banned after.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.refusal import Refused, malformed
from neuroshard.protocol.round import FraudProof, InputList, RoundCommitment, SumLie

from ..codec import decode_delta, encode_delta
from ..validation import ValidationConfig, screen_round
from .partition import (
    SUMS_BYTES,
    Sums,
    merkle_proofs,
    merkle_root,
    merkle_verify,
    padding_lie,
    proof_depth,
    sum_proof_bytes,
    sum_tree_proofs,
    sum_tree_root,
    sum_tree_verify,
    unpack_sums,
)

AggregationRule = Callable[[Tensor], Tensor]
"""(n, L) float32 rows in wallet order -> (L,) aggregate."""

MIN_SCREENED = 3
"""Fewest rows the content checks run on (the median of two is their mean: one sign-flipped row
would drag the reference to ~0 and get the honest one refused too)."""

ANCHOR_FLOOR = 0.1
"""The whole-Δ cosine to the anchor below which a contributor is refused. bench/robustness.py's
"prev+" measured honest non-IID Δs at 0.21–0.75 against the previous aggregate in clean runs
(per part as low as −0.29, which is why the check is whole-Δ); a sign-flipped Δ sits at minus
its own."""
SHARE_TOLERANCE = 1e-6
"""Relative slack when an owner checks a leaf's sums against its part: the contributor's float64
sums and the owner's may be taken in different orders (≈1e-16 relative); a liar gains at most this."""


@dataclass(frozen=True)
class AnchorCheck:
    """The round's whole-Δ check: refuse a contributor whose committed ⟨Δ, anchor⟩ and ‖Δ‖² put its
    cosine to the anchor below `floor`. The verdict is computed from the signed commitment and
    ``norm_sq`` alone, with exact float comparisons, so every replica, owner and fraud checker
    reaches it alike; ``norm_sq`` is ‖anchor‖² rounded to float32, so the last bits of a float64
    sum taken in another order cannot split replicas either (only a value within 1e-16 of a float32
    rounding boundary could, and no contributor chooses the anchor)."""

    floor: float
    norm_sq: float

    @classmethod
    def of(cls, anchor: Tensor, floor: float = ANCHOR_FLOOR) -> AnchorCheck:
        if not -1.0 <= floor <= 1.0:
            raise ValueError(f"AnchorCheck: the floor is a cosine in [-1, 1], got {floor}")
        norm_sq = float(torch.dot(anchor.double(), anchor.double()))
        return cls(floor=floor, norm_sq=float(torch.tensor(norm_sq, dtype=torch.float32)))

    def problem(self, c: RoundCommitment) -> str | None:
        """Why `c` is refused by the anchor check, or None when it passes."""
        if not c.anchored:
            return "anchor: the commitment states no anchor sums in a round with an anchor"
        dot, sq = c.anchor_dot, c.sq_norm
        assert dot is not None and sq is not None
        if sq <= 0.0 or self.norm_sq <= 0.0:
            return None  # a zero Δ is the screening's (a free rider); a zero anchor judges nothing
        # cos = dot / √(sq·a²) ≥ floor, without a square root: exact comparisons of exact inputs.
        bound = self.floor * self.floor * sq * self.norm_sq
        passes = (
            (dot >= 0.0 and dot * dot >= bound) if self.floor >= 0.0 else (dot >= 0.0 or dot * dot <= bound)
        )
        if passes:
            return None
        cosine = dot / (math.sqrt(sq) * math.sqrt(self.norm_sq))  # each root > 0: no underflow to 0
        return f"anchor: cos(Δ, anchor) = {cosine:.3g} below {self.floor}"

    def refusals(self, commitments: Sequence[RoundCommitment]) -> dict[str, str]:
        """Wallet -> reason for the commitments the check refuses; none if it would refuse more than
        half of them: attackers are a minority, so a majority below the floor has honest rows in it
        (a stale anchor), and refusing them would leave the minority to decide. Colluders that sit
        below the floor on purpose count toward that majority: with f of n, they switch the check
        off once ⌊n/2⌋ + 1 − f honest rows are below it too (not measured)."""
        low = {c.wallet: r for c in commitments if (r := self.problem(c)) is not None}
        return low if 2 * len(low) <= len(commitments) else {}


def part_sums(values: Tensor, anchor_part: Tensor) -> Sums:
    """(⟨values, anchor_part⟩, ‖values‖²) in float64 (float32 products are exact in float64)."""
    v = values.double()
    return float(torch.dot(v, anchor_part.double())), float(torch.dot(v, v))


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


def proof_bytes(count: int, anchored: bool) -> int:
    """Bytes of the proof before each part in a Δ object (a sum-tree proof when `anchored`)."""
    return sum_proof_bytes(count) if anchored else 32 * proof_depth(count)


def part_spans(
    bounds: Sequence[tuple[int, int]], encoding: str, anchored: bool = False
) -> list[tuple[int, int]]:
    """Byte range [start, end) of each part *with its proof* in the Δ object."""
    slot = proof_bytes(len(bounds), anchored)
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


def anchored_delta_object(
    delta: Tensor, bounds: Sequence[tuple[int, int]], encoding: str, anchor: Tensor
) -> tuple[bytes, str, Sums]:
    """`delta_object` for a round with an anchor: the proofs are sum-tree proofs whose leaves carry
    each part's (⟨part, anchor part⟩, ‖part‖²) over the part as it decodes, which is what owners
    read. Returns (object bytes, root, totals): the commitment signs the root and states the totals."""
    parts = [encode_part(delta[a:b], encoding) for a, b in bounds]
    sums = [
        part_sums(decode_part(p, encoding, b - a), anchor[a:b])
        for p, (a, b) in zip(parts, bounds, strict=True)
    ]
    hashes = [sha256_hex(p) for p in parts]
    proofs = sum_tree_proofs(hashes, sums)
    root, totals = sum_tree_root(hashes, sums)
    return b"".join(proof + part for proof, part in zip(proofs, parts, strict=True)), root, totals


def split_slot(data: bytes, count: int, anchored: bool = False) -> tuple[bytes, bytes]:
    """(proof, part bytes) of one ranged read of the Δ object."""
    slot = proof_bytes(count, anchored)
    return data[:slot], data[slot:]


def part_matches(commitment: RoundCommitment, part: int, count: int, proof: bytes, data: bytes) -> bool:
    """Whether `data` is part `part` of the Δ `commitment` signed (with an anchor: and whether the
    path's sums add up to the totals it states)."""
    if commitment.anchored:
        total = (commitment.anchor_dot, commitment.sq_norm)
        got = sum_tree_verify(commitment.parts_root, total, sha256_hex(data), part, count, proof)
        return got is not None
    return merkle_verify(commitment.parts_root, sha256_hex(data), part, count, proof)


def padding_problem(
    commitment: RoundCommitment, part: int, count: int, proof: bytes, data: bytes
) -> str | None:
    """For a part that does not match its anchored commitment: why it is the author's signed lie
    (sums hung on the sum tree's padding, which no owner reads), or None."""
    if not commitment.anchored:
        return None
    total = (commitment.anchor_dot, commitment.sq_norm)
    if padding_lie(commitment.parts_root, total, sha256_hex(data), part, count, proof):
        return "anchor sums: its signed sum tree carries sums on padding leaves"
    return None


def share_problem(
    commitment: RoundCommitment, length: int, proof: bytes, data: bytes, anchor_part: Tensor
) -> str | None:
    """Why the sums a matched part's leaf states are not the part's own, or None. Call it only on a
    part that `part_matches` its commitment: a false leaf is then the contributor's signed lie (the
    commitment, the proof and the part are the evidence)."""
    if not commitment.anchored:
        return None
    stated = unpack_sums(proof[:SUMS_BYTES])
    try:
        dot, sq = part_sums(decode_part(data, commitment.encoding, length), anchor_part)
    except (Refused, ValueError):
        return None  # an undecodable part is refused as such; its sums judge nothing
    scale = math.sqrt(max(sq, 0.0) * float(torch.dot(anchor_part.double(), anchor_part.double())))
    tiny = 1e-300
    if not (
        abs(stated[0] - dot) <= SHARE_TOLERANCE * scale + tiny
        and abs(stated[1] - sq) <= SHARE_TOLERANCE * sq + tiny
    ):
        return (
            f"anchor sums: its leaf states ⟨part, anchor⟩ = {stated[0]:.6g}, ‖part‖² = {stated[1]:.6g}; "
            f"the part has {dot:.6g}, {sq:.6g}"
        )
    return None


def check_sum_lie(
    lie: SumLie,
    *,
    members: Sequence[str],
    bounds: Sequence[tuple[int, int]],
    scope: tuple[int, int, str, str],
    anchor: Tensor,
) -> str | None:
    """Why `lie` convicts its signer, or None when it does not: the commitment must be a member's,
    signed, of this round (`scope`: stage, round, base hash, member list) and anchored, and its
    slot of the part it names must either match the signed root with a leaf whose sums are not the part's
    (`share_problem`) or reach the root only through sums on padding (`padding_problem`)."""
    c, part = lie.commitment, lie.part
    if c.wallet not in members or not c.signature_valid() or not c.anchored or not 0 <= part < len(bounds):
        return None
    if (c.stage, c.round, c.base_hash, c.members_sha256) != scope:
        return None
    a, b = bounds[part]
    if part_matches(c, part, len(members), lie.proof, lie.data):
        return share_problem(c, b - a, lie.proof, lie.data, anchor[a:b])
    return padding_problem(c, part, len(members), lie.proof, lie.data)


def reduce_part(
    rows: Mapping[str, Tensor],
    rule: AggregationRule,
    validation: ValidationConfig | None,
    length: int | None = None,
    refused_first: Mapping[str, str] | None = None,
) -> tuple[Tensor, dict[str, str]]:
    """Screen the part's rows (wallet -> (L,) float32) and aggregate the kept ones in wallet order.

    Returns (aggregate, refused wallet -> reason). Rows in `refused_first` (the anchor check's) are
    out before the screening, so they move no reference. With fewer than MIN_SCREENED rows left, or
    when the part's median is all zeros, nothing is screened (every replica holding these rows does
    the same). With every row refused the aggregate is zeros."""
    if length is None:  # the part's length, when there are rows to tell it
        length = next(iter(rows.values())).numel() if rows else 0
    early = {w: r for w, r in (refused_first or {}).items() if w in rows}
    wallets = sorted(w for w in rows if w not in early)
    refused: dict[str, str] = {}
    if validation is not None and len(wallets) >= MIN_SCREENED and length > 0:
        try:
            verdicts = screen_round({w: rows[w] for w in wallets}, (length,), validation)
            refused = {w: v.reason for w, v in verdicts.items() if not v.ok}
        except ValueError:
            refused = {}
    kept = [w for w in wallets if w not in refused]
    refused = {**early, **refused}
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
    anchor: AnchorCheck | None = None,
) -> tuple[bytes, int, dict[str, str]]:
    """The encoded aggregate, accepted count and refusals that `inputs` give: what an honest owner signs.
    `parts` maps each considered wallet to its part bytes (already matched to its commitment). With
    an `anchor`, the considered commitments it refuses are out of every part alike."""
    rows = {c.wallet: decode_part(parts[c.wallet], c.encoding, length) for c in inputs.considered}
    first = anchor.refusals(inputs.considered) if anchor is not None else None
    aggregate, refused = reduce_part(rows, rule, validation, length, first)
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
    anchor: AnchorCheck | None = None,
) -> FraudCheck:
    """Check a fraud proof alone (module docstring): any third party holding the round's screening
    (and, in a round with an anchor, its `AnchorCheck`) can run this."""
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
        if commitment.anchored != (anchor is not None):
            return FraudCheck(
                True, f"the owner took input {commitment.wallet[:12]}: its anchor sums do not fit the round"
            )
        if not part_matches(commitment, claim.part, len(members), merkle, data):
            return FraudCheck(False, f"input {commitment.wallet[:12]}: part does not match its commitment")
        parts[commitment.wallet] = data
    try:
        aggregate, accepted, _ = recompute(inputs, parts, b - a, claim.encoding, rule, validation, anchor)
    except (Refused, ValueError) as exc:
        return FraudCheck(True, f"an input the owner took does not decode ({exc})")
    if sha256_hex(aggregate) != claim.aggregate_sha256 or accepted != claim.accepted:
        return FraudCheck(True, "the signed aggregate is not what its signed inputs give", aggregate)
    return FraudCheck(False, "the claim is correct", aggregate)
