"""Membership with a price (issue 19): who counts in a stage, and the signed member list.

A wallet costs nothing to make, so the verifier does not let new wallets count. Policies
(`MembershipConfig.policy`, protocol.roster.POLICIES):

- ``open``: every registered wallet is an admitted member at once (no Sybil defence; the
  behaviour before issue 19, and the default until the run definition names a policy);
- ``probation``: a new wallet joins its stage as a probationer. Its receipts are recorded and
  judged, but its hash vote does not count toward the stage's majority or the settlement
  quorum (verifier.ledger). It is admitted once it has agreed with the stage's majority in
  `admission_rounds` settled rounds and passed `spot_checks_required` replay spot checks since
  its probation began; a minority vote or a failed spot check restarts its probation, and a
  failed spot check sends an admitted member back to probation. The operator's roster admits
  its wallets directly; while a stage has fewer than `genesis_members` admitted members and
  the roster names none, a registering wallet is admitted at once (a run must start somewhere);
- ``allowlist``: only the wallets on the operator's signed roster (protocol.roster.Roster) may
  register for the stage, and only they count.

Every change of a stage's membership, or of its vocabulary schedule (verifier.vocab), bumps its
epoch (stage_epochs); GET /api/stages/{stage}/members serves the stage's
`protocol.roster.MemberList` at its current epoch, signed with the verifier's key. A refused
wallet (reputation) is on no list. A list names at most `max_probation_listed` probationers:
those with recent progress first, and a share of the places for the rest, who take them in turns
(`listed_probation`, `next_turn`: the lead's housekeeping sweep starts each turn).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.refusal import BUSY, Refused
from neuroshard.protocol.roster import MAX_LISTED, POLICIES, MemberList, Roster, RosterError

from . import models as m


@dataclass(kw_only=True)
class MembershipConfig:
    policy: str = "open"
    """protocol.roster.POLICIES: 'open', 'probation' or 'allowlist'."""
    admission_rounds: int = 3
    """Settled rounds a probationer must agree with its stage's majority. With H=500 inner steps a
    round is minutes to hours of real training: each admitted wallet costs that much verified work."""
    spot_checks_required: int = 1
    """Replay spot checks a probationer must pass before admission (set 0 when replays are off:
    verifier.replaycheck never runs and nobody would be admitted)."""
    genesis_members: int = 1
    """Probation policy: wallets admitted at registration while the stage has fewer admitted
    members (and the roster names none for it): the first replica of a run."""
    list_ttl_s: float = 600.0
    """A member list expires this long (at most twice this) after it is signed; nodes refetch."""
    lead_rounds: int = 2
    """Rounds between the newest round reported when a stage's membership changes and the round its
    new member list takes effect from: time for every replica to read it (nodes read it every 5 s,
    3 s while not admitted; rounds are minutes at production H). Raise it for very short rounds."""
    max_probation_listed: int = 256
    """Probationers a member list names: a node takes at most 16 a round, and a flood of idle keys
    must not grow every node's list download. Those with recent progress are named furthest along
    first; `probation_turns` of the places go to the rest in turns (`listed_probation`)."""
    probation_turns: float = 0.25
    """Share of `max_probation_listed` kept for probationers without recent progress, who take it
    in turns (`next_turn`): without it, idle keys registered first (a flood, or honest churn:
    people who tried once and left) would hold every place, and a newcomer in a pipeline, whose
    rounds need the list (its neighbours work only with listed wallets), could never start."""
    probation_turn_s: float = 3600.0
    """The shortest turn: the housekeeping sweep starts the next one (a new epoch) once this much
    time has passed since the turn started, the stage has settled rounds past the turn's list
    taking effect (`TURN_ROUNDS`), whatever the length of a round, and someone without recent
    progress waits off the list. Other changes of the stage's membership keep the turn."""
    probation_idle_rounds: int = 8
    """Progress (a round with the majority, a spot check) holds a place by progress only while the
    probationer's latest counted round is at most this many rounds before the turn's start: one
    that did a round and went idle goes back to taking turns."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"MembershipConfig: policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.admission_rounds < 0 or self.spot_checks_required < 0 or self.genesis_members < 0:
            raise ValueError(
                f"MembershipConfig: admission_rounds ({self.admission_rounds}), spot_checks_required "
                f"({self.spot_checks_required}) and genesis_members ({self.genesis_members}) must be ≥ 0"
            )
        if not self.list_ttl_s > 0:
            raise ValueError(f"MembershipConfig: list_ttl_s must be > 0, got {self.list_ttl_s}")
        if self.lead_rounds < 1:
            raise ValueError(f"MembershipConfig: lead_rounds must be ≥ 1, got {self.lead_rounds}")
        if not 0 <= self.max_probation_listed <= MAX_LISTED:
            raise ValueError(
                f"MembershipConfig: max_probation_listed must be in [0, {MAX_LISTED}], got {self.max_probation_listed}"
            )
        if not 0.0 <= self.probation_turns <= 1.0:
            raise ValueError(
                f"MembershipConfig: probation_turns must be in [0, 1], got {self.probation_turns}"
            )
        if not self.probation_turn_s > 0:
            raise ValueError(f"MembershipConfig: probation_turn_s must be > 0, got {self.probation_turn_s}")
        if self.probation_idle_rounds < 0:
            raise ValueError(
                f"MembershipConfig: probation_idle_rounds must be ≥ 0, got {self.probation_idle_rounds}"
            )


# --- the operator's roster --------------------------------------------------------------------


def current_roster(session: Session, *, now: float) -> Roster | None:
    """The roster in force: the highest version accepted that has not expired."""
    body = session.scalar(
        select(m.RosterRow.body)
        .where(m.RosterRow.expires_at > now)
        .order_by(m.RosterRow.version.desc())
        .limit(1)
    )
    return None if body is None else Roster.from_json(body)


def roster_of_epoch(session: Session, stage: int, *, now: float) -> Roster | None:
    """The roster a member list of the stage's current epoch names: the one in force when the
    epoch last changed (`now` before any change). A roster that expires therefore leaves the lists
    only with a new epoch (`roster_expired`, moved by the housekeeping sweep), so one epoch is
    served with one list; accepting a roster moves every stage's epoch (`accept_roster`)."""
    changed_at = session.scalar(select(m.StageEpoch.changed_at).where(m.StageEpoch.stage == stage))
    return current_roster(session, now=now if changed_at is None else changed_at)


def roster_expired(session: Session, stage: int, *, now: float) -> bool:
    """Whether the stage's lists still name a roster that is no longer in force at `now` (it
    expired): the sweep then moves the stage's epoch, and the next list leaves its wallets out."""
    listed = roster_of_epoch(session, stage, now=now)
    if listed is None:
        return False
    held = current_roster(session, now=now)
    return held is None or held.version != listed.version


def accept_roster(
    session: Session, roster: Roster, *, operator_key: str, network: str, num_stages: int, now: float
) -> str:
    """Store an operator-signed roster: 'accepted', or 'duplicate' when this exact version is held.
    Refused: another signer or network, expired, a stage that does not exist
    (bad_roster), or a version not newer than the one held (conflict)."""
    try:
        roster.verify(operator_key, network=network, now=now)
    except RosterError as exc:
        raise Refused("bad_roster", str(exc)) from None
    for entry in roster.stages:
        if entry.stage >= num_stages:
            raise Refused("bad_roster", f"roster names stage {entry.stage}; this network has {num_stages}")
    body = roster.to_json().decode()
    held = session.get(m.RosterRow, roster.version)
    if held is not None:
        if held.body == body:
            return "duplicate"
        raise Refused("conflict", f"a different roster version {roster.version} is already held")
    newest = session.scalar(select(func.max(m.RosterRow.version)))
    if newest is not None and roster.version < newest:
        raise Refused("conflict", f"roster version {roster.version} is older than the held version {newest}")
    session.add(m.RosterRow(version=roster.version, body=body, expires_at=roster.expires_at, received_at=now))
    for stage in range(num_stages):
        bump_epoch(session, stage, now=now)
    return "accepted"


# --- epochs -----------------------------------------------------------------------------------


REPORT_SLACK = 4
"""Rounds past the one after the stage's newest settled round that `stage_round` believes a report of."""


def settled_next(session: Session, stage: int) -> int:
    """The round after the stage's newest settled round (0 before any settled). Rounds settle in
    order once most of the stage's counted replicas moved past them (ledger.settle_rounds), so a
    wallet reporting a far-off round does not move it."""
    newest = session.scalar(select(func.max(m.Round.round)).where(m.Round.stage == stage))
    return 0 if newest is None else newest + 1


def stage_round(session: Session, stage: int) -> int:
    """The stage's newest reported round, but at most `REPORT_SLACK` rounds past `settled_next`:
    any registered wallet's receipt counts as a report, and one for round 2²⁹ set every later
    list's `effective_round` beyond any round the stage would reach, so its membership never
    changed again (until 2026-12-07). A far-off report now delays a list by `REPORT_SLACK` rounds
    at most. The price: when most of a stage's replicas lag its leaders by more than
    `REPORT_SLACK` + `lead_rounds` rounds, a new list takes effect in the leaders' past, and they
    take it at once (node.p2p.plane.set_roster)."""
    reported = session.scalar(select(func.max(m.Receipt.round)).where(m.Receipt.stage == stage)) or 0
    return min(reported, settled_next(session, stage) + REPORT_SLACK)


def bump_epoch(session: Session, stage: int, *, now: float) -> None:
    """+1 on the stage's membership epoch, in the caller's transaction, noting the stage's round
    (`stage_round`; the list of this epoch takes effect a few rounds after it: `member_list`)."""
    reported = stage_round(session, stage)
    moved = session.execute(
        update(m.StageEpoch)
        .where(m.StageEpoch.stage == stage)
        .values(epoch=m.StageEpoch.epoch + 1, changed_at=now, changed_round=reported)
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount:  # type: ignore[attr-defined]
        return
    try:
        with session.begin_nested():  # a concurrent first change of this stage may insert first
            session.add(
                m.StageEpoch(
                    stage=stage,
                    epoch=1,
                    changed_at=now,
                    changed_round=reported,
                    turn=0,
                    turn_started_at=now,
                    turn_round=reported,
                )
            )
    except IntegrityError:
        bump_epoch(session, stage, now=now)


def epoch(session: Session, stage: int) -> int:
    return session.scalar(select(m.StageEpoch.epoch).where(m.StageEpoch.stage == stage)) or 0


def vocab_schedule(session: Session, stage: int) -> tuple[int, int]:
    """The stage's (vocab_size, vocab_from_round) (verifier.vocab); (0, 0): the network
    definition's vocabulary, never grown."""
    row = session.execute(
        select(m.StageEpoch.vocab_size, m.StageEpoch.vocab_from_round).where(m.StageEpoch.stage == stage)
    ).one_or_none()
    return (0, 0) if row is None else (row.vocab_size, row.vocab_from_round)


def effective_round(session: Session, stage: int, cfg: MembershipConfig) -> int:
    """The round the stage's current member list takes effect from: `lead_rounds` after the newest
    round reported when it changed, so every replica has read it before it applies, and they all
    switch lists at one round boundary (a replica holding another list than the others signs
    another member hash, and its round fails)."""
    changed = session.scalar(select(m.StageEpoch.changed_round).where(m.StageEpoch.stage == stage)) or 0
    return changed + cfg.lead_rounds


# --- standing ---------------------------------------------------------------------------------


def _roster_ids(session: Session, roster: Roster | None, stage: int) -> set[str]:
    """Wallet ids of the roster's wallets of `stage` that registered (the rest are not known yet)."""
    keys = roster.wallets(stage) if roster is not None else frozenset()
    if not keys:
        return set()
    return set(session.scalars(select(m.Wallet.wallet_id).where(m.Wallet.public_key.in_(sorted(keys)))))


def counted(session: Session, stage: int, cfg: MembershipConfig, *, now: float) -> set[str] | None:
    """Wallet ids whose hash votes count in the stage's majority and settlement quorum; None: all."""
    if cfg.policy == "open":
        return None
    roster_ids = _roster_ids(session, current_roster(session, now=now), stage)
    if cfg.policy == "allowlist":
        return roster_ids
    admitted = session.scalars(
        select(m.Membership.wallet_id).where(
            m.Membership.stage == stage, m.Membership.status == m.MEMBER_ADMITTED
        )
    )
    return roster_ids | set(admitted)


def on_register(session: Session, wallet: m.Wallet, stage: int, cfg: MembershipConfig, *, now: float) -> None:
    """A wallet registered for `stage`: refuse it (allowlist, not listed), or give it a standing."""
    roster = current_roster(session, now=now)
    listed = roster is not None and wallet.public_key in roster.wallets(stage)
    if cfg.policy == "allowlist" and not listed:
        version = f"version {roster.version}" if roster is not None else "none accepted yet"
        raise Refused(
            "not_on_roster",
            f"wallet {wallet.wallet_id} is not on the operator's roster for stage {stage} ({version})",
        )
    if session.get(m.Membership, (stage, wallet.wallet_id)) is not None:
        return
    status, reason = m.MEMBER_PROBATION, "registered: on probation"
    if cfg.policy != "probation":
        status, reason = m.MEMBER_ADMITTED, f"registered ({cfg.policy} policy)"
    elif listed:
        status, reason = (
            m.MEMBER_ADMITTED,
            f"on the operator's roster version {roster.version if roster else '?'}",
        )
    elif not (roster and roster.wallets(stage)):
        admitted = session.scalar(
            select(func.count())
            .select_from(m.Membership)
            .where(m.Membership.stage == stage, m.Membership.status == m.MEMBER_ADMITTED)
        )
        if (admitted or 0) < cfg.genesis_members:
            status, reason = m.MEMBER_ADMITTED, f"genesis member {(admitted or 0) + 1} of stage {stage}"
    session.add(
        m.Membership(
            stage=stage,
            wallet_id=wallet.wallet_id,
            status=status,
            streak=0,
            checks_passed=0,
            since=now,
            reason=reason,
        )
    )
    bump_epoch(session, stage, now=now)


def _restart(row: m.Membership, reason: str, *, now: float) -> None:
    """Back to the start of probation (an admitted member too)."""
    row.status, row.streak, row.checks_passed, row.since, row.reason = m.MEMBER_PROBATION, 0, 0, now, reason


def awaiting_checks(session: Session, cfg: MembershipConfig) -> set[tuple[int, str]]:
    """(stage, wallet) of the probationers that did their rounds (all but the last) and still need
    a passed spot check, at every stage (segment checks replay later pipeline stages from the
    inputs their senders signed: verifier.segmentcheck): the replay checker draws their receipts
    first. Bounded by verified work, not by registrations: a fresh wallet gets here only with
    `admission_rounds` − 1 rounds voting the majority's hash. That hash is public, so keys that
    vote it without working get here too, and each holds a place in the checker's queue
    for its answer window before it fails unanswered (its probation restarts, its reputation
    falls): enough of them delay their stage's other probationers' checks (each stage's hold at
    most replaycheck.MAX_ADMISSION_CHECKS places)."""
    if cfg.policy != "probation" or cfg.spot_checks_required == 0:
        return set()
    rows = session.execute(
        select(m.Membership.stage, m.Membership.wallet_id).where(
            m.Membership.status == m.MEMBER_PROBATION,
            m.Membership.streak >= max(0, cfg.admission_rounds - 1),
            m.Membership.checks_passed < cfg.spot_checks_required,
        )
    )
    return {(stage, wallet_id) for stage, wallet_id in rows}


def _maybe_admit(session: Session, row: m.Membership, cfg: MembershipConfig, *, now: float) -> None:
    if row.status != m.MEMBER_PROBATION:
        return
    if row.streak >= cfg.admission_rounds and row.checks_passed >= cfg.spot_checks_required:
        row.status, row.since = m.MEMBER_ADMITTED, now
        row.reason = f"admitted after {row.streak} rounds with the majority and {row.checks_passed} spot check(s) passed"
        bump_epoch(session, row.stage, now=now)


def record_round(
    session: Session,
    stage: int,
    round_: int,
    majority_hash: str | None,
    votes: list[tuple[str, str]],
    cfg: MembershipConfig,
    *,
    now: float,
) -> None:
    """Probationers' votes of a settled round: with the majority, +1 on their streak (each round
    once, and only after the last counted); against it, probation restarts, whenever the vote
    is learned (a receipt sent after its round settled may come after later rounds were
    counted). No majority: nobody moves."""
    if cfg.policy != "probation" or majority_hash is None:
        return
    hashes = dict(votes)
    rows = session.scalars(  # one query for the round: a flood of probationers is thousands of votes
        select(m.Membership)
        .where(m.Membership.stage == stage, m.Membership.status == m.MEMBER_PROBATION)
        .where(m.Membership.wallet_id.in_(sorted(hashes)))
        .order_by(m.Membership.wallet_id)
    ).all()
    moved = False
    for row in rows:
        result_hash = hashes[row.wallet_id]
        counted = row.last_round is not None and round_ <= row.last_round
        if result_hash == majority_hash and counted:
            continue
        row.last_round = round_ if row.last_round is None else max(round_, row.last_round)
        if result_hash == majority_hash:
            row.streak += 1
            moved = True
            _maybe_admit(session, row, cfg, now=now)
        else:
            moved = True  # a restart moves it down the list's turns (`since`) if not off its progress
            _restart(row, f"minority hash in round {round_}: probation restarts", now=now)
    if moved:  # the listed probationers' order changed: one signed list per epoch
        bump_epoch(session, stage, now=now)


def record_spot_check(
    session: Session,
    wallet_id: str,
    stage: int,
    ok: bool,
    cfg: MembershipConfig | None,
    *,
    now: float,
    round_: int,
) -> None:
    """A spot-check verdict: a replay's pass (`cfg` given) counts toward admission; any failure
    restarts probation, and sends an admitted member back to probation."""
    row = session.get(m.Membership, (stage, wallet_id))
    if row is None:
        return
    if not ok:
        was = (row.status, row.streak, row.checks_passed, row.since)
        _restart(row, f"spot check failed in round {round_}: probation restarts", now=now)
        if (row.status, row.streak, row.checks_passed, row.since) != was:
            bump_epoch(session, stage, now=now)
        return
    if row.status == m.MEMBER_PROBATION and cfg is not None:  # None: not a replay (a data check)
        row.checks_passed += 1
        bump_epoch(session, stage, now=now)  # it moves up the listed probationers
        if cfg.policy == "probation":
            _maybe_admit(session, row, cfg, now=now)


# --- the published list -----------------------------------------------------------------------


@dataclass(frozen=True)
class Standing:
    wallet_id: str
    public_key: str
    status: str
    streak: int
    checks_passed: int
    since: float
    reason: str | None
    last_round: int | None = None
    """The latest round counted toward its probation (None: none)."""
    last_named_turn: int | None = None
    """The last turn a member list named it in to take its turn (None: never)."""
    alive_turn: int | None = None
    """The last turn at whose start its replica of the stage was alive (a recent heartbeat)."""


def standings(session: Session, stage: int) -> list[Standing]:
    """Every active wallet's membership row of `stage`, by wallet id."""
    rows = session.execute(
        select(m.Membership, m.Wallet.public_key)
        .join(m.Wallet, m.Wallet.wallet_id == m.Membership.wallet_id)
        .where(m.Membership.stage == stage, m.Wallet.status == m.STATUS_ACTIVE)
        .order_by(m.Membership.wallet_id)
    ).all()
    return [
        Standing(
            r.wallet_id,
            key,
            r.status,
            r.streak,
            r.checks_passed,
            r.since,
            r.reason,
            r.last_round,
            r.last_named_turn,
            r.alive_turn,
        )
        for r, key in rows
    ]


def expiry(now: float, ttl_s: float) -> int:
    """Quantised, so every rendering within one window signs identical bytes (same ETag)."""
    return int((math.floor(now / ttl_s) + 2) * ttl_s)


@dataclass(frozen=True)
class Listing:
    listed: list[str]
    """Public keys of the probationers a member list names."""
    unlisted_turns: int
    """Probationers who take turns that it leaves out: they wait for a later turn."""


@dataclass(frozen=True)
class Turn:
    """The stage's turn of listed probationers (models.StageEpoch.turn, turn_started_at, turn_round)."""

    number: int = 0
    started_at: float = 0.0
    round: int = 0


def turn_of(session: Session, stage: int) -> Turn | None:
    """The stage's turn; None before its membership ever changed (no registration yet)."""
    row = session.execute(
        select(m.StageEpoch.turn, m.StageEpoch.turn_started_at, m.StageEpoch.turn_round).where(
            m.StageEpoch.stage == stage
        )
    ).one_or_none()
    return None if row is None else Turn(row.turn, row.turn_started_at, row.turn_round)


def listed_probation(waiting: list[Standing], cfg: MembershipConfig, *, turn: Turn) -> Listing:
    """Which of the waiting probationers a list names in `turn`, at most `cfg.max_probation_listed`.

    Those with recent progress (a round with the majority or a spot check since their probation
    began, and a round counted at most `probation_idle_rounds` before the turn's round) are named
    furthest along first, in the places the `cfg.probation_turns` share kept for turns leaves.
    Everyone else takes the rest in turns, round-robin: those whose replica was alive when the
    turn began (a heartbeat within the ledger's `peer_ttl_s`, `next_turn`) before those that were
    not, then the least recently named first (never named before all), then the longest waiting;
    those who registered or restarted after the turn began rank last (a place left free still goes
    to them), so nobody named in a turn is pushed out by a newer key. A probationer whose progress
    finds no place beyond that share takes turns too, from where it was, so doing a round never
    costs one its place. With N alive and waiting for P places, each is named within about N / P
    turns, however many idle keys wait: keys that registered and went away (a flood, or people who
    tried once and left) take only the places nobody alive wants. Ranking by progress and then by
    age alone let idle keys registered first hold every place for ever, and progress that never
    decayed let keys that did one round and left hold them."""
    slots = cfg.max_probation_listed
    oldest = turn.round - cfg.probation_idle_rounds

    def recent(r: Standing) -> bool:
        return (r.streak > 0 or r.checks_passed > 0) and r.last_round is not None and r.last_round >= oldest

    working = sorted(
        (r for r in waiting if recent(r)), key=lambda r: (-r.streak, -r.checks_passed, r.since, r.public_key)
    )
    by_progress = slots - min(slots, math.ceil(cfg.probation_turns * slots))  # places progress may hold
    named = working[:by_progress]
    taking_turns = sorted(
        [*working[by_progress:], *(r for r in waiting if not recent(r))],
        key=lambda r: (
            r.since > turn.started_at,
            r.alive_turn != turn.number,
            -1 if r.last_named_turn is None else r.last_named_turn,
            r.since,
            r.public_key,
        ),
    )
    in_turns = taking_turns[: slots - len(named)]
    return Listing([r.public_key for r in named + in_turns], len(taking_turns) - len(in_turns))


TURN_ROUNDS = 2
"""Rounds the stage settles after a turn's list took effect before the next turn may start: one
to work in and one for its receipt (a receipt counts only once its round settles)."""


def turn_due(session: Session, stage: int, cfg: MembershipConfig, *, now: float) -> Turn | None:
    """The stage's turn if it has lasted its time (`probation_turn_s`) and its rounds (the list that
    started it took effect, and `TURN_ROUNDS` more settled); None if not (or no turns: a policy
    other than probation, no place kept for them, no membership yet). Reads only."""
    if cfg.policy != "probation" or math.ceil(cfg.probation_turns * cfg.max_probation_listed) == 0:
        return None
    turn = turn_of(session, stage)
    if turn is None or now - turn.started_at < cfg.probation_turn_s:
        return None
    if settled_next(session, stage) < turn.round + cfg.lead_rounds + TURN_ROUNDS:  # its list's rounds
        return None
    return turn


def next_turn(session: Session, stage: int, cfg: MembershipConfig, *, now: float, alive_s: float) -> str:
    """Start the stage's next turn of listed probationers (a new epoch) when it is due and someone
    waits off the list for a turn; those named in the turn that ends are marked so
    (`last_named_turn`) and go to the back, and those whose replica of the stage sent a heartbeat
    within `alive_s` (the ledger's `peer_ttl_s`) are marked alive in the new turn (`alive_turn`):
    they go ahead of the idle ones for all of it, whatever heartbeats come or stop meanwhile (a
    list changes only with its epoch). Returns "started", "not due" (too early in time or in
    rounds: ask again), "raced" (another process moved the turn, or the epoch, first) or "nobody
    waits": then the turn's clock starts again and the alive are marked again, with no new epoch:
    a list that names everyone waiting keeps its names whatever the order, so that write is made
    only if the epoch did not move since the standings were read (a registration committed
    meanwhile by another process, under READ COMMITTED, would otherwise get its rank from marks
    its own epoch's list did not have). The stage's standings are read again only after another
    `probation_turn_s`."""
    turn = turn_due(session, stage, cfg, now=now)
    if turn is None:
        return "not due"
    read_at = epoch(session, stage)  # before the standings: a change committed after moves it
    current = stage_round(session, stage)  # what bump_epoch notes: the new list takes effect lead_rounds on
    roster = roster_of_epoch(session, stage, now=now)  # as the ending turn's lists named it
    _, waiting = _split(standings(session, stage), set(roster.wallets(stage) if roster is not None else ()))
    ending = listed_probation(waiting, cfg, turn=turn)
    if ending.unlisted_turns == 0:  # everyone waiting is named, whatever the order
        moved = session.execute(
            update(m.StageEpoch)
            .where(
                m.StageEpoch.stage == stage, m.StageEpoch.turn == turn.number, m.StageEpoch.epoch == read_at
            )
            .values(turn_started_at=now)
            .execution_options(synchronize_session=False)
        )
        if not moved.rowcount:  # type: ignore[attr-defined]
            return "raced"
        _mark_alive(session, stage, turn.number, now=now, alive_s=alive_s)
        return "nobody waits"
    moved = session.execute(
        update(m.StageEpoch)
        .where(m.StageEpoch.stage == stage, m.StageEpoch.turn == turn.number)
        .values(turn=turn.number + 1, turn_started_at=now, turn_round=current)
        .execution_options(synchronize_session=False)
    )
    if not moved.rowcount:  # type: ignore[attr-defined]
        return "raced"
    # Everyone the ending turn's list named goes behind those it did not, when next taking turns
    # (named by progress too: when that progress grows old, it has had its places).
    listed = set(ending.listed)
    named = {r.wallet_id for r in waiting if r.public_key in listed}
    if named:
        session.execute(
            update(m.Membership)
            .where(m.Membership.stage == stage, m.Membership.wallet_id.in_(sorted(named)))
            .values(last_named_turn=turn.number)
            .execution_options(synchronize_session=False)
        )
    _mark_alive(session, stage, turn.number + 1, now=now, alive_s=alive_s)
    bump_epoch(session, stage, now=now)
    return "started"


def _mark_alive(session: Session, stage: int, turn: int, *, now: float, alive_s: float) -> None:
    """Mark `turn` on the stage's probationers whose replica of the stage was heard from within
    `alive_s`: one UPDATE, however many are waiting."""
    heard = select(m.Peer.wallet_id).where(m.Peer.stage == stage, m.Peer.last_heartbeat >= now - alive_s)
    session.execute(
        update(m.Membership)
        .where(
            m.Membership.stage == stage,
            m.Membership.status == m.MEMBER_PROBATION,
            m.Membership.wallet_id.in_(heard),
        )
        .values(alive_turn=turn)
        .execution_options(synchronize_session=False)
    )


def _split(rows: list[Standing], roster_keys: set[str]) -> tuple[set[str], list[Standing]]:
    """(admitted keys: the roster's and those admitted by their rounds, the other rows)."""
    admitted = roster_keys | {r.public_key for r in rows if r.status == m.MEMBER_ADMITTED}
    return admitted, [r for r in rows if r.public_key not in admitted]


RENDER_TRIES = 5
"""Renderings of a member list before the verifier gives up (503) because its epoch kept moving
while it was read."""


def member_list(
    session: Session, stage: int, cfg: MembershipConfig, *, network: str, signer: Wallet, now: float
) -> MemberList:
    """The stage's signed member list at its current epoch. Its statements may each see another
    committed state (PostgreSQL's READ COMMITTED), so the epoch is read before and after: a change
    committed in between moved it, and the list is read again. Every change a list shows is a new
    epoch (bump_epoch), so one epoch is served with one list: the roster it names is the one in
    force when the epoch began (`roster_of_epoch`)."""
    for _ in range(RENDER_TRIES):
        before = epoch(session, stage)
        doc = _render(session, stage, cfg, network=network, signer=signer, now=now, at_epoch=before)
        if epoch(session, stage) == before:
            return doc
    raise Refused(BUSY, f"stage {stage}'s membership changed during each of {RENDER_TRIES} reads of its list")


def _render(
    session: Session,
    stage: int,
    cfg: MembershipConfig,
    *,
    network: str,
    signer: Wallet,
    now: float,
    at_epoch: int,
) -> MemberList:
    roster = roster_of_epoch(session, stage, now=now)
    refused = set(session.scalars(select(m.Wallet.public_key).where(m.Wallet.status == m.STATUS_REFUSED)))
    roster_keys = set(roster.wallets(stage) if roster is not None else ()) - refused
    rows = standings(session, stage)
    probation: list[str]
    if cfg.policy == "allowlist":
        admitted, probation = roster_keys, []
    elif cfg.policy == "open":
        admitted, probation = roster_keys | {r.public_key for r in rows}, []
    else:
        admitted, waiting = _split(rows, roster_keys)
        probation = listed_probation(waiting, cfg, turn=turn_of(session, stage) or Turn()).listed
    vocab_size, vocab_from_round = vocab_schedule(session, stage)
    try:
        return MemberList.create(
            signer,
            network=network,
            expires_at=expiry(now, cfg.list_ttl_s),
            stage=stage,
            epoch=at_epoch,
            effective_round=effective_round(session, stage, cfg),
            policy=cfg.policy,
            admitted=tuple(sorted(admitted)[:MAX_LISTED]),
            probation=tuple(sorted(probation)),
            admission_rounds=cfg.admission_rounds,
            vocab_size=vocab_size or None,
            vocab_from_round=vocab_from_round if vocab_size else None,
        )
    except Refused as exc:  # a roster or table that cannot be listed is the verifier's bug, said plainly
        raise RuntimeError(f"stage {stage}'s member list does not build: {exc}") from exc
