"""Who counts in a stage's rounds: admitted members, probationers, and everyone else (issue #19).

A wallet costs nothing to make, so a stage whose rounds, majorities and quorums count every live
wallet belongs to whoever makes the most keys. With a roster (an operator's allowlist, or the
verifier's signed member list), a replica splits the live stage peers it sees into three:

- **admitted members** own and witness parts, enter aggregates, and count in the θ-hash vote,
  state-sync quorums and digest agreement: ``RoundInput.members``;
- **probationers** commit and send their parts like members; each owner reads and screens them
  (``RoundResult.probation`` holds the verdicts), but they own nothing, witness nothing, never
  enter an aggregate and never count toward a majority: ``RoundInput.probationers``. At most
  ``ProbationCap.of(admitted)`` of them take part in a round, picked by a hash of (round,
  wallet), so a flood of registered keys costs each owner a bounded number of extra part reads;
- **anyone else** is never read: their commitments, parts, echoes, digests and statuses are not
  fetched, so they change nothing.

A replica that is itself on no list yet (it just registered; or refused), or a probationer the
cap leaves out of a round, observes the round: it publishes nothing, reads the decided
aggregates like everyone and steps with them, so its θ stays the stage's while it waits.

In a pipeline the same lists say whom a replica works with in the stages before and after its
own (`Neighbours`): the wallets on them, admitted or on probation.

A probationer earns admission at the verifier by rounds of verified work (it agreed with the
stage's majority and passed replay spot checks); the verifier then lists it as admitted in its
next signed member list. Without a roster (a run with no definition and no verifier: direct
``--peers``), every live wallet is a member, as before: such a run has no Sybil defence and the
node says so when it starts.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from neuroshard.protocol.roster import MemberList

POLICIES = ("allowlist", "probation")


@dataclass(frozen=True, kw_only=True)
class ProbationCap:
    """How many probationers one round takes: at most `count`, and at most `fraction` of the
    admitted members (at least one, so a stage of one admitted replica can still admit a second)."""

    fraction: float = 0.25
    count: int = 16

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0 or self.count < 0:
            raise ValueError(f"probation cap needs 0 <= fraction <= 1 and count >= 0, got {self}")

    def of(self, admitted: int) -> int:
        if self.count == 0 or self.fraction == 0.0:
            return 0
        return min(self.count, max(1, math.floor(self.fraction * admitted)))


@dataclass(frozen=True, kw_only=True)
class StageRoster:
    """One stage's member list as a replica holds it (from the operator's definition or the
    verifier's signed list; the carrier checked the signature before building this)."""

    stage: int
    policy: str
    """``allowlist``: only `admitted` take part. ``probation``: `probation` wallets may too."""
    admitted: frozenset[str]
    probation: frozenset[str] = frozenset()
    cap: ProbationCap = ProbationCap()
    source: str = ""
    """Where it came from, for logs ("network definition", "verifier epoch 12")."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown admission policy {self.policy!r}; expected one of {POLICIES}")
        if self.admitted & self.probation:
            raise ValueError("a wallet cannot be both admitted and on probation")
        if self.policy == "allowlist" and self.probation:
            raise ValueError("an allowlist roster has no probationers")

    def counts(self, wallet: str) -> bool:
        """Whether `wallet` counts toward majorities and quorums (votes, state sync)."""
        return wallet in self.admitted

    def listed(self, wallet: str) -> bool:
        return wallet in self.admitted or wallet in self.probation


@dataclass(frozen=True)
class Split:
    members: tuple[str, ...]
    """Admitted wallets of the round, sorted (this replica among them unless it is on probation)."""
    probationers: tuple[str, ...]
    """Probationers taking part this round, sorted (at most the cap; this replica may be one)."""
    waiting: int = 0
    """Live probationers left out of this round by the cap."""
    listed: bool = True
    """Whether this replica is on the roster at all (False: it observes, and says why)."""


def probation_rank(round_: int, wallet: str) -> bytes:
    """The order probationers take a round's slots in: a hash no wallet chooses for every round."""
    return hashlib.sha256(f"neuroshard/probation/v1\n{round_}\n{wallet}".encode()).digest()


def split_members(live: Iterable[str], me: str, roster: StageRoster | None, round_: int) -> Split:
    """The round's members and probationers from the live stage wallets this replica sees.

    Without a roster every live wallet is a member. With one, unlisted wallets are dropped, and
    probationers beyond the cap wait for a later round. This replica, when it is a probationer the
    cap leaves out or on no list at all (`Split.listed` False: just registered, or refused), is in
    neither list: it observes the round, stepping with the stage's aggregate, so it stays on the
    stage's θ (and its hash reports agree) until it may take part."""
    wallets = set(live) | {me}
    if roster is None:
        return Split(tuple(sorted(wallets)), ())
    members = tuple(sorted(w for w in wallets if w in roster.admitted))
    candidates = sorted(
        (w for w in wallets if w in roster.probation), key=lambda w: probation_rank(round_, w)
    )
    taken = candidates[: roster.cap.of(len(members))]
    return Split(
        members, tuple(sorted(taken)), waiting=len(candidates) - len(taken), listed=roster.listed(me)
    )


class Neighbours:
    """Which replicas of a neighbouring pipeline stage this replica works with: the stage before
    (whose micro-batches it takes) or the stage after (where it sends its own). Thread-safe: the
    tracker sets the roster, the event loop asks.

    Without a roster (an ``open`` stage, a run without a verifier) everyone, as before. With one,
    the wallets on it: admitted ones, each bought with verified rounds, and the probationers it
    names, who must work to be admitted (at most `verifier.members.MembershipConfig.max_probation_listed`,
    each a registration). Nobody else: keys that cost nothing to make get no micro-batch from this
    replica and none of theirs is stepped on, so they cannot answer a driver with gradients it must
    refuse one by one (a step's compute each; a driver gives up after `pipeline.DRIVER_MAX_BLAMED`)
    or hand a middle replica failing micro-batches (a segment holds only so many:
    `protocol.segments.max_failed_in_segment`). A listed wallet that does either is banned on its
    own, for longer each time (the router's blame, the service's strike).

    A neighbour's list is taken as soon as it is read, not at its `effective_round`: that round is
    the neighbour stage's, and whom this replica works with needs no agreement with its own stage."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self._lock = threading.Lock()
        self._roster: StageRoster | None = None

    @property
    def roster(self) -> StageRoster | None:
        return self._roster

    def set(self, roster: StageRoster | None) -> None:
        """The neighbour stage's member list in force from now on (None: its stage is ``open``)."""
        if roster is not None and roster.stage != self.stage:
            raise ValueError(f"a roster of stage {roster.stage} given for stage {self.stage}'s neighbours")
        with self._lock:
            self._roster = roster

    def refusal(self, wallet: str) -> str | None:
        """Why this replica does not work with `wallet` of the neighbour stage now; None: it does."""
        with self._lock:
            roster = self._roster
        if roster is None or roster.listed(wallet):
            return None
        return f"{wallet[:12]} is not on stage {self.stage}'s member list ({roster.source or 'roster'})"

    def takes(self, wallet: str) -> bool:
        return self.refusal(wallet) is None


def roster_of(members: MemberList, cap: ProbationCap | None = None) -> StageRoster | None:
    """A replica's roster from the verifier's signed member list (its signature, network, stage,
    expiry and epoch order checked by the caller: ``node.verifier_client``); None for an ``open`` stage."""
    if members.policy == "open":
        return None
    return StageRoster(
        stage=members.stage,
        policy=members.policy,
        admitted=frozenset(members.admitted),
        probation=frozenset(members.probation),
        cap=cap or ProbationCap(),
        source=f"verifier epoch {members.epoch}",
    )
