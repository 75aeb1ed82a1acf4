"""The outer round's messages: the signed objects of a partitioned round (``node.outer``).

| object (name)              | signed by   | what it binds                                                  |
|----------------------------|-------------|----------------------------------------------------------------|
| ``commit``  RoundCommitment | contributor | its Δ for (stage, round, h_r, members): Merkle root of n parts (with an anchor: a sum tree's root and totals) |
| ``delta``   bytes           | —           | per part: ⌈log2 n⌉ proof hashes (with an anchor: the leaf's sums and 48-byte siblings), then the part's safetensors |
| ``inputs/j`` InputList      | —           | what part j's owner reduced (sha256 in the claim)              |
| ``agg-{sha}/j`` bytes       | —           | the aggregated part j, encoded, named by its sha256 (in the claim) |
| ``claim/j`` AggregateClaim  | owner       | part j's inputs and aggregate, by hash                          |
| ``echo/j``  Echo            | witness     | the claim of part j it gathered, or none (a backup of part j)   |
| ``digest``  RoundDigest     | replica     | the claims it holds (one hash), the frauds and equivocations it proved |
| ``fraud/j`` bytes           | —           | FraudProof: a claim, its inputs and their parts: checkable alone |
| ``lie-{wallet}`` bytes      | —           | SumLie: an anchored commitment and a part whose sums are false: checkable with the anchor |
| ``equivocation/j`` EquivocationProof | — | two claims of one signer for part j: checkable alone    |

Every message is small and of fixed size in n except ``InputList`` and fraud proofs, which a
replica reads only for the parts it checks or when something went wrong.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

from .identity import sha256_hex
from .refusal import invalid, malformed
from .schema import (
    MAX_COUNT,
    MAX_NUMEL,
    MAX_STAGE,
    Message,
    PublicKeyHex,
    Signed,
    choice,
    hex_bytes,
    integer,
    list_of,
    message,
    number,
    optional,
    split_header,
    text,
)

MAX_MEMBERS = 4096
"""Replicas per stage a round takes (the partition has one part per member)."""
MAX_REASON_CHARS = 300
MAX_ANCHOR_SUM = 1.0e300
"""Bound on a commitment's anchor sums (finite; a real Δ's are many orders below)."""
ENCODINGS = ("fp16", "int8")
"""How a contribution's Δ is encoded on the wire (``node.codec``)."""

Stage = Annotated[int, integer(0, MAX_STAGE)]
Round = Annotated[int, integer(0, MAX_COUNT)]
Sha256 = Annotated[str, hex_bytes(32)]
Part = Annotated[int, integer(0, MAX_MEMBERS - 1)]
Encoding = Annotated[str, choice(ENCODINGS)]


@dataclass(frozen=True, kw_only=True)
class RoundCommitment(Signed):
    """A contributor's Δ for one round, bound before any part of it can be read: the Merkle root over
    the sha256 of its n encoded parts (``partition.merkle_root``)."""

    NAME = "round commitment"
    DOMAIN = b"neuroshard/round-commitment/v1"
    stage: Stage
    round: Round
    base_hash: Sha256
    """sha256 of θ_round the Δ was computed from (h_r)."""
    members_sha256: Sha256
    """sha256 of the round's sorted member list: the partition the parts follow."""
    tokens: Annotated[int, integer(0, MAX_COUNT)]
    encoding: Encoding
    numel: Annotated[int, integer(1, MAX_NUMEL)]
    parts_root: Sha256
    """The Merkle root over the parts; in a round with an anchor, the root of the sum tree whose
    totals are the two fields below (``node.outer.partition.sum_tree_root``)."""
    anchor_dot: Annotated[float | None, optional(number(-MAX_ANCHOR_SUM, MAX_ANCHOR_SUM))] = None
    """Rounds with an anchor only (``node.outer.reduce.AnchorCheck``): ⟨Δ, anchor⟩ over the decoded
    parts, the sum tree's first total. Every replica judges the whole Δ's cosine to the anchor from
    it before any part is read; each part's owner checks its leaf against the part."""
    sq_norm: Annotated[float | None, optional(number(0.0, MAX_ANCHOR_SUM))] = None
    """Rounds with an anchor only: ‖Δ‖² over the decoded parts, the sum tree's second total."""

    @property
    def anchored(self) -> bool:
        """Whether this commitment is over a sum tree (a round with an anchor)."""
        return self.anchor_dot is not None and self.sq_norm is not None

    def sha256(self) -> str:
        return sha256_hex(self.to_json())


@dataclass(frozen=True, kw_only=True)
class Dropped(Message):
    NAME = "dropped input"
    wallet: PublicKeyHex
    reason: Annotated[str, text(MAX_REASON_CHARS)]


@dataclass(frozen=True, kw_only=True)
class InputList(Message):
    """What an owner reduced for one part: the commitments of the parts it screened and aggregated
    (wallet order), and the members it left out with why (no commitment, no part, hash mismatch,
    banned). Its sha256 is in the owner's signed claim, so the list is the owner's statement."""

    NAME = "input list"
    part: Part
    considered: Annotated[tuple[RoundCommitment, ...], list_of(message(RoundCommitment), MAX_MEMBERS)]
    dropped: Annotated[tuple[Dropped, ...], list_of(message(Dropped), MAX_MEMBERS)]

    def check(self) -> None:
        wallets = [c.wallet for c in self.considered]
        if wallets != sorted(set(wallets)):
            raise invalid("input list: considered commitments must be in wallet order, one per wallet")

    def sha256(self) -> str:
        return sha256_hex(self.to_json())


@dataclass(frozen=True, kw_only=True)
class AggregateClaim(Signed):
    """An owner's statement about part j: it reduced the inputs whose list hashes to `inputs_sha256`
    into the encoded aggregate whose sha256 is `aggregate_sha256`. Two different claims of one signer
    for one part are equivocation; a claim whose recomputation differs is fraud."""

    NAME = "aggregate claim"
    DOMAIN = b"neuroshard/aggregate-claim/v1"
    stage: Stage
    round: Round
    base_hash: Sha256
    members_sha256: Sha256
    part: Part
    encoding: Encoding
    replaces: Annotated[str, hex_bytes(32, empty_ok=True)]
    """The wallet whose part this backup took over ("" when the signer is the part's first owner)."""
    inputs_sha256: Sha256
    accepted: Annotated[int, integer(0, MAX_MEMBERS)]
    """How many inputs the screening kept (a count, so the claim stays small)."""
    aggregate_sha256: Sha256

    def sha256(self) -> str:
        return sha256_hex(self.to_json())


@dataclass(frozen=True, kw_only=True)
class Echo(Signed):
    """A witness of part j (a member of its backup chain after the owner) shows every replica the
    claim of part j it gathered, or that it gathered none. Replicas decide part j from the echoes,
    which honest witnesses show alike to everyone, rather than each from what the owner showed it:
    an owner that shows readers different claims (or some readers none) cannot split them, and a
    reader whose own claim differs from an echo holds two signatures of the owner (equivocation)."""

    NAME = "echo"
    DOMAIN = b"neuroshard/echo/v1"
    stage: Stage
    round: Round
    base_hash: Sha256
    members_sha256: Sha256
    part: Part
    claims: Annotated[tuple[AggregateClaim, ...], list_of(message(AggregateClaim), 1)]
    """The claim the witness gathered for the part, or () when it gathered none."""


@dataclass(frozen=True, kw_only=True)
class RoundDigest(Signed):
    """After the gather, the echoes and the checks: one hash over the claims this replica holds, the
    parts where it holds a fraud proof and those where it holds an equivocation proof. Every replica
    reads every member's digest (O(1) each) and checks the proofs it lacks, so one honest replica's
    proof settles the part alike everywhere."""

    NAME = "round digest"
    DOMAIN = b"neuroshard/round-digest/v2"
    stage: Stage
    round: Round
    base_hash: Sha256
    members_sha256: Sha256
    claims_sha256: Sha256
    frauds: Annotated[tuple[int, ...], list_of(integer(0, MAX_MEMBERS - 1), 64)]
    equivocations: Annotated[tuple[int, ...], list_of(integer(0, MAX_MEMBERS - 1), 64)]
    lies: Annotated[tuple[str, ...] | None, optional(list_of(hex_bytes(32), 64))] = None
    """Rounds with an anchor: the contributors this replica holds a ``SumLie`` against (a sum tree
    stating sums its part does not have), sorted. Left out when none: digests of rounds without an
    anchor keep their bytes."""


@dataclass(frozen=True)
class SumLie:
    """Evidence that a contributor's anchored Δ object states, for one part, sums the part does not
    have: its signed commitment, the part's index and the slot it published (the sum-tree proof,
    then the part's bytes). Anyone holding the round's anchor checks it alone
    (``node.outer.reduce.check_sum_lie``). A finder publishes one per liar, as ``lie-{wallet}``,
    and names the liar in its digest. Encoded as an 8-byte length, a JSON header, then the bytes."""

    commitment: RoundCommitment
    part: int
    proof: bytes
    data: bytes

    def encode(self) -> bytes:
        header = {
            "commitment": self.commitment.to_obj(),
            "part": self.part,
            "sizes": [len(self.proof), len(self.data)],
        }
        return framed(header, self.proof + self.data)

    @classmethod
    def decode(cls, data: bytes, max_header: int = 64 << 10) -> SumLie:
        header, at = split_header(data, "sum lie", max_header)
        if not isinstance(header, dict) or set(header) != {"commitment", "part", "sizes"}:
            raise malformed("sum lie header must hold exactly commitment, part and sizes")
        commitment = RoundCommitment.from_obj(header["commitment"], "sum lie commitment")
        part = integer(0, MAX_MEMBERS - 1)(header["part"], "sum lie part")
        sizes = header["sizes"]
        if not (
            isinstance(sizes, list) and len(sizes) == 2 and all(type(v) is int and v >= 0 for v in sizes)
        ):
            raise malformed("sum lie sizes must be a pair of non-negative integers")
        if at + sizes[0] + sizes[1] != len(data):
            raise malformed("sum lie is not as long as its sizes say")
        return cls(commitment, part, data[at : at + sizes[0]], data[at + sizes[0] :])


@dataclass(frozen=True, kw_only=True)
class EquivocationProof(Message):
    """Two different claims signed by one wallet for one part of one round: checkable alone (the
    round module checks that both are valid claims of the same chain position)."""

    NAME = "equivocation proof"
    claims: Annotated[tuple[AggregateClaim, ...], list_of(message(AggregateClaim), 2)]


def claims_sha256(claims: dict[int, AggregateClaim]) -> str:
    """The digest's hash: sha256 over "part:claim sha256" lines in part order."""
    return sha256_hex("\n".join(f"{j}:{claims[j].sha256()}" for j in sorted(claims)).encode())


def framed(header: Mapping[str, object], body: bytes) -> bytes:
    """An 8-byte little-endian length, the JSON header, then the body (``schema.split_header`` reads it back)."""
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw)) + raw + body


@dataclass(frozen=True)
class FraudProof:
    """Evidence that an owner's signed aggregate is not what its signed inputs give.

    Holds the claim, the input list the claim hashes, and for every considered input its part bytes
    and Merkle proof. Anyone re-checks it alone (``reduce.check_fraud``): signatures, hashes, the
    recomputed aggregate. Encoded as an 8-byte length, a JSON header, then the parts' bytes."""

    claim: AggregateClaim
    inputs: InputList
    parts: tuple[tuple[bytes, bytes], ...]
    """(proof, part bytes) per considered input, in the input list's order."""

    def encode(self) -> bytes:
        header = {
            "claim": self.claim.to_obj(),
            "inputs": self.inputs.to_obj(),
            "sizes": [[len(proof), len(part)] for proof, part in self.parts],
        }
        return framed(header, b"".join(p + b for p, b in self.parts))

    @classmethod
    def decode(cls, data: bytes, max_header: int = 16 << 20) -> FraudProof:
        header, at = split_header(data, "fraud proof", max_header)
        if not isinstance(header, dict) or set(header) != {"claim", "inputs", "sizes"}:
            raise malformed("fraud proof header must hold exactly claim, inputs and sizes")
        claim = AggregateClaim.from_obj(header["claim"], "fraud proof claim")
        inputs = InputList.from_obj(header["inputs"], "fraud proof inputs")
        sizes = header["sizes"]
        if not isinstance(sizes, list) or len(sizes) != len(inputs.considered):
            raise malformed("fraud proof sizes must list one (proof, part) size per considered input")
        parts = []
        for entry in sizes:
            if not (
                isinstance(entry, list) and len(entry) == 2 and all(type(v) is int and v >= 0 for v in entry)
            ):
                raise malformed("fraud proof sizes must be pairs of non-negative integers")
            proof_len, part_len = entry
            end = at + proof_len + part_len
            if end > len(data):
                raise malformed("fraud proof is shorter than its sizes say")
            parts.append((data[at : at + proof_len], data[at + proof_len : end]))
            at = end
        if at != len(data):
            raise malformed("fraud proof has trailing bytes")
        return cls(claim, inputs, tuple(parts))
