"""Everything the verifier writes: registrations, heartbeats, receipts, round settlement,
reputation, evaluations, reinstatements. Each function works inside a caller's transaction
(`Database.write()`), so a request's nonce, its write and its consequences commit together
or not at all.

A (stage, round) is *settled* — its majority hash fixed and reputations moved — once more
than half of the stage's live replicas (not refused, heartbeat within the peer TTL) have
sent a receipt for a round at least `settle_after_rounds` later: the stage has moved on,
so the round's votes are in. Counting distinct live replicas, not any later receipt, keeps
one wallet from settling a round early — say right after its own bogus vote, before the
honest replicas reported — and so making its hash the "majority". A receipt that arrives
after its round settled is judged alone against the settled majority (its claims about
others are not counted: the quorum for them was decided without it), and can only lose:
spot checks give it no verdict (verifier.replaycheck), so with the majority it earns no
reputation and counts toward no admission.

Under a membership policy (verifier.members, issue 19) only the stage's counted wallets —
admitted members, or the operator's roster — make the majority and the settlement quorum;
probationers' votes are judged against the members' majority, in bulk, and move their
probation on or restart it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

from sqlalchemy import ColumnElement, Table, bindparam, case, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from neuroshard.protocol import refusal
from neuroshard.protocol.refusal import Refused, invalid
from neuroshard.protocol.reports import HeartbeatRequest, Receipt, RegisterRequest
from neuroshard.protocol.roster import pow_ok
from neuroshard.protocol.signing import SignedBy

from . import members
from . import models as m
from .members import MembershipConfig
from .reputation import Adjustment, ReputationConfig, Vote, judge_round, judge_vote


@dataclass(kw_only=True)
class LedgerConfig:
    reputation: ReputationConfig
    num_stages: int
    """From the network definition: stages are 0..num_stages-1."""
    nonce_window_s: float
    """The freshness window: a nonce is remembered at least until its timestamp is twice this far
    in the past (verifier.housekeeping forgets it one window after it expired)."""
    peer_ttl_s: float = 90.0
    """A replica is live while its last heartbeat is younger than this."""
    settle_after_rounds: int = 1
    """A round settles once most live replicas of its stage reported a round this many rounds later."""
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    """Who counts in a stage's majority and settlement quorum (verifier.members; issue 19)."""
    network_name: str = ""
    """The run's name: a registration proof of work is bound to it."""
    registration_pow_bits: int = 0
    """Proof of work a new wallet's registration must carry (protocol.roster.pow_ok); 0: none."""


# The statements of the three writes a thousand nodes send all the time, built once: a statement
# made per request cost more Python (construction, values coercion, its cache key) than its round
# trip to PostgreSQL (issue 15's write profile). They run on the session's connection, in the
# caller's transaction, as Core statements on the tables (no ORM bulk-insert layer). Being Core,
# they do not autoflush the session: ORM changes a caller made before them and has not flushed are
# not seen (the API's group commit flushes and clears the session between two requests' writes,
# verifier.groupcommit; members.on_register flushes its own).
_NONCES, _RECEIPTS, _VOTES, _PEERS = (
    cast(Table, model.__table__) for model in (m.Nonce, m.Receipt, m.HashVote, m.Peer)
)
_INSERT_NONCE = insert(_NONCES)
_INSERT_RECEIPT = insert(_RECEIPTS)
_INSERT_VOTE = insert(_VOTES)
_ACTIVE_SIGNER = (
    select(m.Wallet.wallet_id)
    .where(
        m.Wallet.wallet_id == bindparam("signer_wallet"),
        m.Wallet.public_key == bindparam("signer_key"),
        m.Wallet.status != m.STATUS_REFUSED,
    )
    .exists()
)
_HEARTBEAT = (
    update(_PEERS)
    .where(
        _PEERS.c.wallet_id == bindparam("signer_wallet"),
        _PEERS.c.stage == bindparam("hb_stage"),
        _ACTIVE_SIGNER,
    )
    .values(
        last_heartbeat=bindparam("hb_now"),
        round=bindparam("hb_round"),
        steps_in_round=bindparam("hb_steps"),
    )
)
_RECEIPT_HELD = (
    select(m.Receipt.body_sha256)
    .where(
        m.Receipt.wallet_id == bindparam("signer_wallet"),
        m.Receipt.stage == bindparam("rc_stage"),
        m.Receipt.round == bindparam("rc_round"),
    )
    .scalar_subquery()
)
_ROUND_SETTLED = select(m.Round.majority_hash).where(
    m.Round.stage == bindparam("rc_stage"), m.Round.round == bindparam("rc_round")
)
_RECEIPT_STATE = (
    select(
        m.Wallet.public_key,
        m.Wallet.status,
        m.Wallet.status_reason,
        m.Peer.stage.label("registered_stage"),
        _RECEIPT_HELD.label("held_sha256"),
        _ROUND_SETTLED.exists().label("settled"),
        _ROUND_SETTLED.scalar_subquery().label("majority_hash"),
    )
    .select_from(m.Wallet)
    .outerjoin(m.Peer, m.Peer.wallet_id == m.Wallet.wallet_id)
    .where(m.Wallet.wallet_id == bindparam("signer_wallet"))
)
"""A receipt's checks in one SELECT: the signer's wallet, its registered stage, a receipt it
already sent for the round, and the round's settlement."""


def use_nonce(session: Session, signed: SignedBy, *, window_s: float) -> None:
    """Remember the request's nonce; a second use within the window is refused (replayed).

    One INSERT: the primary key (signer, nonce) refuses a reuse. Expired nonces are not purged
    here but by `purge_nonces`, which the lead process runs every few seconds, one window after
    they expired (verifier.housekeeping): a DELETE in every request cost a statement per write,
    most of them deleting nothing (issue 15's write load). A nonce forgotten cannot be reused:
    its request's timestamp is refused as stale before it gets here.
    """
    try:
        session.connection().execute(
            _INSERT_NONCE,
            {
                "public_key": signed.public_key_hex,
                "nonce": signed.nonce,
                "expires_at": signed.timestamp + window_s,
            },
        )
    except IntegrityError:
        raise Refused(
            refusal.REPLAYED, f"replayed request: nonce {signed.nonce} was already used by this signer"
        ) from None


def purge_nonces(session: Session, *, now: float) -> int:
    """Forget every expired nonce (at start-up, then every few seconds in the lead process)."""
    result = session.execute(delete(m.Nonce).where(m.Nonce.expires_at < now))
    return int(result.rowcount)  # type: ignore[attr-defined]


def _active_wallet(session: Session, signed: SignedBy) -> m.Wallet:
    wallet = session.get(m.Wallet, signed.wallet_id)
    _refuse_unless_active(signed, wallet)
    assert wallet is not None
    return wallet


class _WalletState(Protocol):
    public_key: str
    status: str
    status_reason: str | None


def _refuse_unless_active(signed: SignedBy, wallet: _WalletState | None) -> None:
    """Refused unless the signer's wallet is registered to its key and not refused."""
    if wallet is None:
        raise Refused(
            refusal.UNKNOWN_WALLET, f"wallet {signed.wallet_id} is not registered; POST /api/register first"
        )
    if wallet.public_key != signed.public_key_hex:
        raise Refused("key_mismatch", f"wallet id {signed.wallet_id} is registered to another public key")
    if wallet.status == m.STATUS_REFUSED:
        raise Refused(
            "wallet_refused",
            f"wallet {signed.wallet_id} is refused ({wallet.status_reason}); the operator can reinstate it",
        )


def _check_stage(stage: int, cfg: LedgerConfig) -> None:
    if stage >= cfg.num_stages:
        raise Refused(
            refusal.INVALID, f"stage {stage} does not exist: this network has stages 0..{cfg.num_stages - 1}"
        )


def register(
    session: Session, signed: SignedBy, req: RegisterRequest, *, now: float, cfg: LedgerConfig
) -> m.Wallet:
    """Create or update the wallet and its peer entry (address, stage); refused wallets are refused (wallet_refused)."""
    _check_stage(req.stage, cfg)
    wallet = session.get(m.Wallet, signed.wallet_id)
    if wallet is None:
        bits = cfg.registration_pow_bits
        if bits and (
            req.pow_nonce is None or not pow_ok(cfg.network_name, signed.public_key_hex, req.pow_nonce, bits)
        ):
            given = "no pow_nonce" if req.pow_nonce is None else f"pow_nonce {req.pow_nonce} does not do it"
            raise Refused(
                "pow_required",
                f"registering a new wallet needs a proof of work: a pow_nonce whose sha256 has {bits} leading "
                f"zero bits (protocol.roster.solve_pow; GET /api/admission); {given}",
            )
        wallet = m.Wallet(
            wallet_id=signed.wallet_id,
            public_key=signed.public_key_hex,
            reputation=cfg.reputation.initial,
            status=m.STATUS_ACTIVE,
            registered_at=now,
            software_version=req.software_version,
        )
        session.add(wallet)
        session.flush()
    else:
        wallet = _active_wallet(session, signed)
        wallet.software_version = req.software_version
    peer = session.get(m.Peer, signed.wallet_id)
    if peer is None:
        session.add(
            m.Peer(
                wallet_id=signed.wallet_id,
                address=req.address,
                stage=req.stage,
                registered_at=now,
                last_heartbeat=now,
            )
        )
    else:
        peer.address, peer.stage, peer.registered_at, peer.last_heartbeat = req.address, req.stage, now, now
    members.on_register(session, wallet, req.stage, cfg.membership, now=now)
    return wallet


def _registered_stage(session: Session, wallet_id: str, stage: int) -> m.Peer:
    peer = session.get(m.Peer, wallet_id)
    _refuse_unless_registered_for(wallet_id, None if peer is None else peer.stage, stage)
    assert peer is not None
    return peer


def _refuse_unless_registered_for(wallet_id: str, registered: int | None, stage: int) -> None:
    if registered != stage:
        where = "no stage" if registered is None else f"stage {registered}"
        raise Refused(
            "wrong_stage", f"wallet {wallet_id} is registered for {where}, not stage {stage}; register again"
        )


def heartbeat(
    session: Session, signed: SignedBy, req: HeartbeatRequest, *, now: float, cfg: LedgerConfig
) -> None:
    """Note the replica alive at `now` and its progress. One UPDATE when the wallet is active and
    registered for the stage (a thousand nodes send one every few seconds); otherwise the
    checks below say why it is refused."""
    if req.stage < cfg.num_stages:
        moved = session.connection().execute(
            _HEARTBEAT,
            {
                "signer_wallet": signed.wallet_id,
                "signer_key": signed.public_key_hex,
                "hb_stage": req.stage,
                "hb_now": now,
                "hb_round": req.round,
                "hb_steps": req.steps_in_round,
            },
        )
        if moved.rowcount == 1:
            return
    _active_wallet(session, signed)
    _check_stage(req.stage, cfg)
    peer = _registered_stage(session, signed.wallet_id, req.stage)
    # Only a registration committed between the UPDATE and these reads gets here.
    peer.last_heartbeat, peer.round, peer.steps_in_round = now, req.round, req.steps_in_round


def submit_receipt(
    session: Session,
    signed: SignedBy,
    req: Receipt,
    *,
    body_sha256: str,
    now: float,
    cfg: LedgerConfig,
) -> str:
    """Store a receipt and its hash vote: 'recorded', or 'duplicate' for an identical resubmission.

    A thousand replicas send one a round each, so the checks are one SELECT (wallet, peer, a
    receipt already held for the round, the round's settlement) and the writes two INSERTs."""
    state = (
        session.connection()
        .execute(
            _RECEIPT_STATE, {"signer_wallet": signed.wallet_id, "rc_stage": req.stage, "rc_round": req.round}
        )
        .one_or_none()
    )
    _refuse_unless_active(signed, state)
    assert state is not None
    _check_stage(req.stage, cfg)
    _refuse_unless_registered_for(signed.wallet_id, state.registered_stage, req.stage)
    if state.held_sha256 is not None:
        if state.held_sha256 == body_sha256:
            return "duplicate"
        raise Refused(
            "conflict",
            f"a different receipt for stage {req.stage} round {req.round} is already recorded for this wallet",
        )
    _check_disputes(signed, req)
    first = req.data[0] if req.data else None
    try:
        connection = session.connection()
        connection.execute(
            _INSERT_RECEIPT,
            dict(
                wallet_id=signed.wallet_id,
                stage=req.stage,
                round=req.round,
                inner_steps=req.inner_steps,
                start_step=req.start_step,
                tokens=req.tokens,
                shard_id=first.shard_id if first else None,
                offset_start=first.offset_start if first else None,
                offset_end=first.offset_end if first else None,
                data_spans=[[s.shard_id, s.offset_start, s.offset_end] for s in req.data],
                losses=list(req.losses),
                loss_sum=float(sum(req.losses)),
                loss_count=len(req.losses),
                base_hash=req.base_hash,
                result_hash=req.result_hash,
                delta_digest=req.delta_digest,
                inner_state_digest=req.inner_state_digest,
                device=req.device,
                precision=req.precision,
                segment_root=req.segment_root,
                segments=req.segments,
                accepted=[dataclasses.asdict(c) for c in req.accepted],
                rejected=[dataclasses.asdict(c) for c in req.rejected],
                equivocators=list(req.equivocators),
                disputes=None if req.disputes is None else [d.to_obj() for d in req.disputes],
                accepted_count=len(req.accepted),
                rejected_count=len(req.rejected),
                body_sha256=body_sha256,
                received_at=now,
            ),
        )
        connection.execute(
            _INSERT_VOTE,
            dict(
                stage=req.stage,
                round=req.round,
                wallet_id=signed.wallet_id,
                result_hash=req.result_hash,
                base_hash=req.base_hash,
            ),
        )
    except IntegrityError:  # a concurrent submission of the same (wallet, stage, round) won
        raise Refused(
            "conflict", f"a receipt for stage {req.stage} round {req.round} is already recorded"
        ) from None
    if state.settled:
        # A receipt that comes after its round settled is judged, but can only lose: the spot
        # checks give no verdict on it (its node may have dropped the round by then,
        # verifier.replaycheck), so a wallet that sent every receipt that late would otherwise
        # gain reputation and admission from work nobody could check.
        vote = Vote(signed.wallet_id, req.result_hash, req.base_hash)
        for adj in judge_vote(vote, state.majority_hash, cfg.reputation, stage=req.stage, round_=req.round):
            if adj.delta < 0:
                apply_adjustment(session, adj, stage=req.stage, round_=req.round, now=now, cfg=cfg.reputation)
        if req.result_hash != state.majority_hash:
            members.record_round(
                session,
                req.stage,
                req.round,
                state.majority_hash,
                [(signed.wallet_id, req.result_hash)],
                cfg.membership,
                now=now,
            )
    return "recorded"


def _check_disputes(signed: SignedBy, req: Receipt) -> None:
    """Refused (invalid) unless every disputed reply is its replier's signature and was addressed to
    the receipt's signer: a replica can dispute only answers it was given, so it cannot make the
    verifier check replicas it never dealt with."""
    for dispute in req.disputes or ():
        for reply in dispute.replies:
            if reply.to != signed.public_key_hex:
                raise invalid(
                    f"disputed micro-batch {dispute.micro_batch}: the reply of {reply.wallet[:16]}… answers "
                    f"{reply.to[:16]}…, not this receipt's wallet"
                )
            if not reply.signature_valid():
                raise invalid(
                    f"disputed micro-batch {dispute.micro_batch}: the reply of {reply.wallet[:16]}… is not "
                    "its signature"
                )


def apply_adjustment(
    session: Session,
    adj: Adjustment,
    *,
    stage: int | None,
    round_: int | None,
    now: float,
    cfg: ReputationConfig,
) -> bool:
    """Move a wallet's reputation (clamped to [0, maximum], in one UPDATE so concurrent writers
    cannot lose each other's changes), log why, and refuse it if it fell under the threshold.
    False when the wallet is unknown (a claim about a wallet that never registered)."""
    if _move_reputation(session, m.Wallet.wallet_id == adj.wallet_id, adj.delta, cfg) == 0:
        return False
    _log_events(session, [adj.wallet_id], adj.delta, adj.reason, stage=stage, round_=round_, now=now)
    _refuse_fallen(session, m.Wallet.wallet_id == adj.wallet_id, adj.reason, cfg, now=now)
    return True


def _move_reputation(
    session: Session, wallets: ColumnElement[bool], delta: float, cfg: ReputationConfig
) -> int:
    """Add `delta` to the reputation of the `wallets`, clamped to [0, maximum], in one UPDATE (so
    concurrent writers cannot lose each other's changes); the number of wallets moved."""
    moved = m.Wallet.reputation + delta
    result = session.execute(
        update(m.Wallet)
        .where(wallets)
        .values(reputation=case((moved > cfg.maximum, cfg.maximum), (moved < 0.0, 0.0), else_=moved))
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def _log_events(
    session: Session,
    wallet_ids: Sequence[str],
    delta: float,
    reason: str,
    *,
    stage: int | None,
    round_: int | None,
    now: float,
) -> None:
    """One reputation event per wallet: what moved its reputation, by how much, and why."""
    if wallet_ids:
        session.execute(
            insert(m.ReputationEvent),
            [
                {
                    "wallet_id": w,
                    "stage": stage,
                    "round": round_,
                    "delta": delta,
                    "reason": reason,
                    "created_at": now,
                }
                for w in wallet_ids
            ],
        )


def _refuse_fallen(
    session: Session, wallets: ColumnElement[bool], reason: str, cfg: ReputationConfig, *, now: float
) -> None:
    """Refuse those of the active `wallets` whose reputation fell under the threshold, saying why.
    A refused wallet is on no member list, so the epochs of its stages move (verifier.members)."""
    fallen = sorted(
        session.scalars(
            select(m.Wallet.wallet_id).where(
                wallets, m.Wallet.status == m.STATUS_ACTIVE, m.Wallet.reputation < cfg.refuse_below
            )
        )
    )
    if not fallen:
        return
    session.execute(
        update(m.Wallet)
        .where(m.Wallet.wallet_id.in_(fallen))
        .values(
            status=m.STATUS_REFUSED, status_reason=f"reputation under {cfg.refuse_below:g} after: {reason}"
        )
        .execution_options(synchronize_session=False)
    )
    _bump_stages_of(session, fallen, now=now)


def _bump_stages_of(session: Session, wallet_ids: list[str], *, now: float) -> None:
    """A new epoch for every stage the wallets hold a membership of: their lists change."""
    stages = session.scalars(
        select(m.Membership.stage)
        .where(m.Membership.wallet_id.in_(wallet_ids))
        .distinct()
        .order_by(m.Membership.stage)
    ).all()
    for stage in stages:
        members.bump_epoch(session, stage, now=now)


_BULK = 500
"""Wallets per statement of apply_adjustments (SQLite binds at most 32,766 parameters)."""


def apply_adjustments(
    session: Session,
    adjustments: list[Adjustment],
    *,
    stage: int | None,
    round_: int | None,
    now: float,
    cfg: ReputationConfig,
) -> None:
    """`apply_adjustment` for many wallets (at most one adjustment each) in a few statements: one
    UPDATE, one INSERT of events and one refusal per (delta, reason) and batch. A settlement judges
    a flood of probationers' votes this way (issue 19: 1,000 probationers took 2.2 s of
    one-by-one updates per round on SQLite)."""
    groups: dict[tuple[float, str], list[str]] = {}
    for adj in adjustments:
        groups.setdefault((adj.delta, adj.reason), []).append(adj.wallet_id)
    for (delta, reason), wallet_ids in sorted(groups.items()):
        for at in range(0, len(wallet_ids), _BULK):
            ids = sorted(wallet_ids[at : at + _BULK])
            _move_reputation(session, m.Wallet.wallet_id.in_(ids), delta, cfg)
            known = session.scalars(select(m.Wallet.wallet_id).where(m.Wallet.wallet_id.in_(ids))).all()
            _log_events(session, known, delta, reason, stage=stage, round_=round_, now=now)
            _refuse_fallen(session, m.Wallet.wallet_id.in_(ids), reason, cfg, now=now)


def settle_rounds(session: Session, stage: int, *, now: float, cfg: LedgerConfig) -> list[int]:
    """Settle, oldest first, every unsettled round of `stage` that most live replicas moved past."""
    # Rounds settle in order, so only rounds after the last settled one can be waiting (a lone
    # vote arriving for an older round that never had any is left pending, not judged).
    last_settled = session.scalar(select(func.max(m.Round.round)).where(m.Round.stage == stage))
    unsettled = session.scalars(
        select(m.HashVote.round)
        .where(m.HashVote.stage == stage, m.HashVote.round > (-1 if last_settled is None else last_settled))
        .distinct()
        .order_by(m.HashVote.round)
    ).all()
    if not unsettled:
        return []
    # Only members count (verifier.members): a flood of probationers moving on must not settle a
    # round before the stage's members reported it.
    counted = members.counted(session, stage, cfg.membership, now=now)
    live_query = (
        select(func.count())
        .select_from(m.Peer)
        .join(m.Wallet, m.Wallet.wallet_id == m.Peer.wallet_id)
        .where(
            m.Peer.stage == stage,
            m.Wallet.status == m.STATUS_ACTIVE,
            m.Peer.last_heartbeat >= now - cfg.peer_ttl_s,
        )
    )
    if counted is not None:
        live_query = live_query.where(m.Peer.wallet_id.in_(sorted(counted)))
    live = session.scalar(live_query)
    settled = []
    for round_ in unsettled:
        moved_query = select(func.count(func.distinct(m.HashVote.wallet_id))).where(
            m.HashVote.stage == stage, m.HashVote.round >= round_ + cfg.settle_after_rounds
        )
        if counted is not None:
            moved_query = moved_query.where(m.HashVote.wallet_id.in_(sorted(counted)))
        moved_on = session.scalar(moved_query)
        if not moved_on or 2 * moved_on <= (live or 0):
            break  # later rounds have even fewer replicas past them
        settle_round(session, stage, round_, now=now, cfg=cfg)
        settled.append(round_)
    return settled


def settle_round(session: Session, stage: int, round_: int, *, now: float, cfg: LedgerConfig) -> m.Round:
    # Only the columns a vote needs: the receipts' other JSON (losses, data spans, accepted
    # contributions) is not parsed for a thousand replicas to settle their round.
    receipts = session.execute(
        select(
            m.Receipt.wallet_id,
            m.Receipt.result_hash,
            m.Receipt.base_hash,
            m.Receipt.rejected,
            m.Receipt.equivocators,
        )
        .where(m.Receipt.stage == stage, m.Receipt.round == round_)
        .order_by(m.Receipt.wallet_id)
    ).all()
    votes = [
        Vote(
            r.wallet_id,
            r.result_hash,
            r.base_hash,
            rejected=tuple((c["wallet"], c["reason"]) for c in r.rejected),
            equivocators=tuple(r.equivocators),
        )
        for r in receipts
    ]
    previous = session.get(m.Round, (stage, round_ - 1))
    # Probationers' votes are judged against the members' majority but never make it (issue 19).
    counted = members.counted(session, stage, cfg.membership, now=now)
    voting = votes if counted is None else [v for v in votes if v.wallet_id in counted]
    judgement = judge_round(
        voting, previous.majority_hash if previous else None, cfg.reputation, stage=stage, round_=round_
    )
    row = m.Round(
        stage=stage,
        round=round_,
        majority_hash=judgement.majority.hash,
        votes=judgement.majority.votes,
        agreeing=judgement.majority.agreeing,
        synced=judgement.synced,
        sync_checked=judgement.sync_checked,
        settled_at=now,
    )
    session.add(row)
    session.flush()  # a concurrent settler of the same round fails here, before touching reputations
    for adj in judgement.adjustments:
        apply_adjustment(session, adj, stage=stage, round_=round_, now=now, cfg=cfg.reputation)
    outsiders = [v for v in votes if counted is not None and v.wallet_id not in counted]
    judged = [
        adj
        for vote in outsiders
        for adj in judge_vote(vote, judgement.majority.hash, cfg.reputation, stage=stage, round_=round_)
    ]
    apply_adjustments(session, judged, stage=stage, round_=round_, now=now, cfg=cfg.reputation)
    members.record_round(
        session,
        stage,
        round_,
        judgement.majority.hash,
        [(v.wallet_id, v.result_hash) for v in votes],
        cfg.membership,
        now=now,
    )
    return row


def record_spot_check(
    session: Session,
    wallet_id: str,
    *,
    stage: int,
    round_: int,
    ok: bool,
    detail: str,
    now: float,
    cfg: ReputationConfig,
    membership: MembershipConfig | None = None,
    penalty: float | None = None,
) -> None:
    """Log a spot check's outcome on the wallet; a failure costs `penalty` (default
    `spot_check_penalty`) and restarts its probation in the stage (verifier.members). With
    `membership` (replay checks), a pass counts toward admission."""
    if ok:
        adj = Adjustment(wallet_id, 0.0, f"spot check passed in stage {stage} round {round_}: {detail}")
    else:
        cost = cfg.spot_check_penalty if penalty is None else penalty
        adj = Adjustment(wallet_id, -cost, f"spot check failed in stage {stage} round {round_}: {detail}")
    if not apply_adjustment(session, adj, stage=stage, round_=round_, now=now, cfg=cfg):
        raise Refused("not_found", f"wallet {wallet_id} is not registered")
    members.record_spot_check(session, wallet_id, stage, ok, membership, now=now, round_=round_)


def record_receipt_check(
    session: Session,
    receipt: m.Receipt,
    *,
    ok: bool,
    detail: str,
    now: float,
    cfg: ReputationConfig,
    membership: MembershipConfig | None = None,
    penalty: float | None = None,
) -> None:
    """`record_spot_check` for a check of one receipt (verifier.datacheck, verifier.replaycheck):
    the receipt's wallet, stage and round; `detail` cut to 400 characters."""
    record_spot_check(
        session,
        receipt.wallet_id,
        stage=receipt.stage,
        round_=receipt.round,
        ok=ok,
        detail=detail[:400],
        now=now,
        cfg=cfg,
        membership=membership,
        penalty=penalty,
    )


def reinstate(
    session: Session, wallet_id: str, reputation: float | None, *, now: float, cfg: ReputationConfig
) -> m.Wallet:
    """The operator lets a wallet back in, at `reputation` (default: the initial value)."""
    wallet = session.get(m.Wallet, wallet_id)
    if wallet is None:
        raise Refused("not_found", f"wallet {wallet_id} is not registered")
    target = cfg.initial if reputation is None else reputation
    if target < cfg.refuse_below:
        raise Refused(
            refusal.INVALID, f"reputation {target} would be refused again (threshold {cfg.refuse_below})"
        )
    session.add(
        m.ReputationEvent(
            wallet_id=wallet_id,
            stage=None,
            round=None,
            delta=target - wallet.reputation,
            reason=f"reinstated by the operator at {target:g} (was {wallet.status}, {wallet.reputation:.3f})",
            created_at=now,
        )
    )
    wallet.status, wallet.status_reason, wallet.reputation = m.STATUS_ACTIVE, None, target
    _bump_stages_of(session, [wallet_id], now=now)  # back on its stages' lists
    return wallet


def record_evaluation(
    session: Session,
    round: int,
    loss: float,
    tokens: int,
    *,
    stderr: float | None = None,
    now: float | None = None,
) -> m.Evaluation:
    """Store a held-out loss the verifier measured itself (verifier.evaluate) on round `round`'s model."""
    if not math.isfinite(loss) or loss < 0:
        raise ValueError(f"measured loss must be finite and ≥ 0, got {loss}")
    if tokens <= 0 or round < 0:
        raise ValueError(f"tokens ({tokens}) must be > 0 and round ({round}) ≥ 0")
    if stderr is not None and not (math.isfinite(stderr) and stderr >= 0):
        raise ValueError(f"stderr must be finite and ≥ 0, got {stderr}")
    row = m.Evaluation(
        round=round,
        loss=loss,
        loss_stderr=stderr,
        tokens=tokens,
        created_at=time.time() if now is None else now,
    )
    session.add(row)
    return row
