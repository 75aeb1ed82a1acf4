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
from collections.abc import Callable, Iterable
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
    candidates = [w for w in wallets if w in roster.probation]
    taken = _first_probationers(candidates, round_, roster.cap.of(len(members)))
    return Split(members, taken, waiting=len(candidates) - len(taken), listed=roster.listed(me))


def _first_probationers(candidates: Iterable[str], round_: int, slots: int) -> tuple[str, ...]:
    """The `slots` probationers `probation_rank` puts first for `round_`, sorted."""
    return tuple(sorted(sorted(candidates, key=lambda w: probation_rank(round_, w))[:slots]))


class Neighbours:
    """Which replicas of a neighbouring pipeline stage this replica works with: the stage before
    (whose micro-batches it takes) or the stage after (where it sends its own). Thread-safe: the
    tracker sets the roster, the event loop asks.

    The same membership as the round's, so that a flood of fresh wallets in the next stage cannot
    answer a driver with gradients it must refuse one by one (each costs it a step's compute, and a
    driver gives up after `pipeline.DRIVER_MAX_BLAMED`), nor one in the stage before hand a middle
    replica enough failing micro-batches to cost it its round's log
    (`protocol.segments.max_failed_in_segment`). Without a roster (an ``open`` stage, a run without
    a verifier) everyone is taken, as before. With one, the admitted wallets are, and of the
    probationers the `ProbationCap` of them that `probation_rank` puts first for this replica's
    round (`round_of`: its own, which no neighbour chooses). They are drawn from every listed
    probationer, not from the live ones a round counts, since a replica does not see the
    neighbour stage's live set; so listed wallets that never run dilute an honest probationer's
    turns, as they cannot in its own stage's rounds. Everyone else is refused."""

    def __init__(self, stage: int, round_of: Callable[[], int]) -> None:
        self.stage = stage
        self.round_of = round_of
        self._lock = threading.Lock()
        self._roster: StageRoster | None = None
        self._picked: tuple[int, frozenset[str]] | None = None
        """(round, the probationers taken in it) for the roster in force."""

    @property
    def roster(self) -> StageRoster | None:
        return self._roster

    def set(self, roster: StageRoster | None) -> None:
        """The neighbour stage's member list in force from now on (None: its stage is ``open``)."""
        if roster is not None and roster.stage != self.stage:
            raise ValueError(f"a roster of stage {roster.stage} given for stage {self.stage}'s neighbours")
        with self._lock:
            self._roster, self._picked = roster, None

    def refusal(self, wallet: str) -> str | None:
        """Why this replica does not work with `wallet` of the neighbour stage now; None: it does."""
        with self._lock:
            roster = self._roster
            if roster is None or wallet in roster.admitted:
                return None
            if wallet not in roster.probation:
                return (
                    f"{wallet[:12]} is not on stage {self.stage}'s member list ({roster.source or 'roster'})"
                )
            round_ = self.round_of()
            if self._picked is None or self._picked[0] != round_:
                slots = roster.cap.of(len(roster.admitted))
                self._picked = (round_, frozenset(_first_probationers(roster.probation, round_, slots)))
            if wallet in self._picked[1]:
                return None
            return (
                f"{wallet[:12]} is on probation in stage {self.stage} and not among the "
                f"{len(self._picked[1])} probationer(s) this replica takes in its round {round_}"
            )

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
