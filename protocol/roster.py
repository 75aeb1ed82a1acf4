"""Signed membership documents (issue 19), shared by the verifier that signs them and the node
that checks them, and the registration proof of work. No HTTP, no database.

- `Roster`: the operator's allowlist, signed by the operator key: a version (a newer one
  replaces an older), an expiry, and the admitted wallets of each stage. The verifier accepts
  it at POST /api/admin/roster and serves it at GET /api/roster; a run without a verifier can
  hand it to its nodes directly.
- `MemberList`: what the verifier publishes per stage and epoch at GET /api/stages/{stage}/members,
  signed with its signing key (the operator key): the admitted wallets and the probationers.
  The epoch grows with every change of the stage's membership, so a node keeps the list with
  the highest epoch it has seen and refuses an older one replayed to it; a list past its
  expiry is refused too.
- Registration proof of work (hashcash): `solve_pow` finds a nonce whose sha256 over
  (network, public key, nonce) starts with `bits` zero bits; `pow_ok` checks it in one hash.
  Minting a wallet at the verifier then costs about 2^bits hashes (2^20: ~1 s of one core).

Wallets are named by their Ed25519 public key (64 hex characters), as on the peer plane.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from neuroshard.protocol.refusal import invalid
from neuroshard.protocol.schema import (
    MAX_COUNT,
    MAX_STAGE,
    Message,
    Signed,
    choice,
    hex_bytes,
    integer,
    list_of,
    message,
    optional,
    text,
)

MAX_LISTED = 4096
"""Wallets per list of one stage (admitted, or probationers): beyond any stage's replica count."""
MAX_NETWORK_CHARS = 128
MAX_VOCAB = 1 << 24
"""Largest vocabulary a member list may name (16.7M ids: far beyond any BPE a run publishes)."""
POLICIES = ("open", "probation", "allowlist")
"""How a stage admits: ``open`` (every registered wallet counts: no Sybil defence), ``probation``
(new wallets earn admission by verified rounds), ``allowlist`` (only the operator's roster)."""
_WALLETS = list_of(hex_bytes(32), MAX_LISTED)


class RosterError(ValueError):
    """A roster or member list that is not signed by the expected key, expired, or inconsistent."""


def _sorted_unique(wallets: tuple[str, ...], where: str) -> None:
    if list(wallets) != sorted(set(wallets)):
        raise invalid(f"{where} must be sorted and without repeats")


@dataclass(frozen=True, kw_only=True)
class RosterStage(Message):
    """The operator's admitted wallets of one stage."""

    NAME = "roster stage"
    stage: Annotated[int, integer(0, MAX_STAGE)]
    wallets: Annotated[tuple[str, ...], _WALLETS]

    def check(self) -> None:
        _sorted_unique(self.wallets, f"roster stage {self.stage} wallets")


@dataclass(frozen=True, kw_only=True)
class _Expiring(Signed):
    network: Annotated[str, text(MAX_NETWORK_CHARS)]
    expires_at: Annotated[int, integer(0, MAX_COUNT)]
    """Unix seconds after which the document is refused."""

    def verify(self, signer: str, *, network: str, now: float) -> None:
        """Raise RosterError unless `signer` signed this for `network` and it has not expired."""
        if self.wallet != signer:
            raise RosterError(f"{self.NAME} is signed by {self.wallet[:16]}…, expected {signer[:16]}…")
        if not self.signature_valid():
            raise RosterError(f"{self.NAME} signature does not verify")
        if self.network != network:
            raise RosterError(f"{self.NAME} is for network {self.network[:40]!r}, not {network[:40]!r}")
        if self.expires_at <= now:
            raise RosterError(f"{self.NAME} expired at {self.expires_at} (now {now:.0f})")


@dataclass(frozen=True, kw_only=True)
class Roster(_Expiring):
    """The operator's signed allowlist. `version` orders rosters: a newer one replaces an older."""

    NAME = "roster"
    DOMAIN: ClassVar[bytes] = b"neuroshard/roster/v1"
    version: Annotated[int, integer(1, MAX_COUNT)]
    stages: Annotated[tuple[RosterStage, ...], list_of(message(RosterStage), MAX_STAGE + 1)]

    def check(self) -> None:
        stages = [s.stage for s in self.stages]
        if stages != sorted(set(stages)):
            raise invalid("roster stages must be sorted by stage and without repeats")

    def wallets(self, stage: int) -> frozenset[str]:
        for entry in self.stages:
            if entry.stage == stage:
                return frozenset(entry.wallets)
        return frozenset()

    @classmethod
    def build(
        cls,
        operator: Any,
        *,
        network: str,
        version: int,
        expires_at: int,
        stages: Mapping[int, list[str] | tuple[str, ...] | frozenset[str]],
    ) -> Roster:
        """Signed by `operator` (a node.wallet.Wallet); wallet lists are sorted here."""
        entries = tuple(
            RosterStage(stage=s, wallets=tuple(sorted(set(w)))) for s, w in sorted(stages.items())
        )
        return cls.create(operator, network=network, version=version, expires_at=expires_at, stages=entries)


@dataclass(frozen=True, kw_only=True)
class MemberList(_Expiring):
    """One stage's members at one epoch, signed by the verifier."""

    NAME = "member list"
    DOMAIN: ClassVar[bytes] = b"neuroshard/member-list/v1"
    stage: Annotated[int, integer(0, MAX_STAGE)]
    epoch: Annotated[int, integer(0, MAX_COUNT)]
    """Grows with every change of this stage's membership (verifier.members)."""
    effective_round: Annotated[int, integer(0, MAX_COUNT)]
    """The round this list applies from: a replica keeps using the list it held before until its
    round reaches this, so the whole stage switches member lists at one round boundary."""
    policy: Annotated[str, choice(POLICIES)]
    admitted: Annotated[tuple[str, ...], _WALLETS]
    """Wallets that count in rounds, majorities and quorums; sorted."""
    probation: Annotated[tuple[str, ...], _WALLETS]
    """Wallets earning admission: exchanged and screened, never counted; sorted."""
    admission_rounds: Annotated[int, integer(0, MAX_COUNT)]
    """Rounds a probationer must agree with the stage's majority (and pass spot checks) to be admitted."""
    vocab_size: Annotated[int | None, optional(integer(1, MAX_VOCAB))] = None
    """The vocabulary the stage's embedding or head has from `vocab_from_round` on, after the
    publisher grew the tokenizer (node.vocab); None (left out of the JSON, so a node that predates
    the field still reads lists without a growth): the network definition's, never grown. The
    verifier schedules the last stage (the head) first and stage 0 (the embedding) after the head
    has grown, so a label is never beyond the head that scores it (verifier.vocab)."""
    vocab_from_round: Annotated[int | None, optional(integer(0, MAX_COUNT))] = None
    """The first round of this stage trained at `vocab_size`: every replica grows at the same round
    boundary, so the stage's replicas stay bit-identical. Given exactly when `vocab_size` is."""

    def check(self) -> None:
        _sorted_unique(self.admitted, "member list admitted")
        _sorted_unique(self.probation, "member list probation")
        if set(self.admitted) & set(self.probation):
            raise invalid("a wallet cannot be both admitted and on probation")
        if self.policy != "probation" and self.probation:
            raise invalid(f"a {self.policy} member list has no probationers")
        if (self.vocab_size is None) != (self.vocab_from_round is None):
            raise invalid("a member list names vocab_size and vocab_from_round together or neither")

    def newer_than(self, other: MemberList | None) -> bool:
        """Whether this list should replace `other` (same stage): a higher epoch, or the same epoch
        re-signed with a later expiry (identical membership)."""
        if other is None:
            return True
        if (self.stage, self.network) != (other.stage, other.network):
            raise RosterError("member lists of different stages or networks do not compare")
        if self.epoch != other.epoch:
            return self.epoch > other.epoch
        return self.expires_at > other.expires_at


# --- registration proof of work (hashcash) -----------------------------------------------------

POW_DOMAIN = b"neuroshard/register-pow/v1"
MAX_POW_BITS = 40
MAX_POW_NONCE = 2**63 - 1


def _pow_prefix(network: str, public_key_hex: str) -> bytes:
    return POW_DOMAIN + b"\n" + network.encode("utf-8") + b"\n" + public_key_hex.encode("ascii") + b"\n"


def _zero_bits(digest: bytes) -> int:
    value = int.from_bytes(digest, "big")
    return len(digest) * 8 - value.bit_length()


def pow_ok(network: str, public_key_hex: str, nonce: int, bits: int) -> bool:
    """Whether sha256(domain, network, public key, nonce) starts with `bits` zero bits (0: always)."""
    if bits <= 0:
        return True
    if not 0 <= nonce <= MAX_POW_NONCE:
        return False
    digest = hashlib.sha256(_pow_prefix(network, public_key_hex) + str(nonce).encode()).digest()
    return _zero_bits(digest) >= bits


def solve_pow(network: str, public_key_hex: str, bits: int, *, start: int = 0) -> int:
    """The first nonce from `start` that `pow_ok` accepts: about 2^bits hashes on average."""
    if not 0 <= bits <= MAX_POW_BITS:
        raise ValueError(f"proof-of-work bits must be in [0, {MAX_POW_BITS}], got {bits}")
    prefix = hashlib.sha256(_pow_prefix(network, public_key_hex))
    nonce = start
    while True:
        h = prefix.copy()
        h.update(str(nonce).encode())
        if _zero_bits(h.digest()) >= bits:
            return nonce
        nonce += 1
