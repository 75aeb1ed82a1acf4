"""Vocabulary growth across pipeline stages: when the publisher extends the tokenizer, the verifier
schedules the round from which each stage holding vocabulary rows grows to the new size.

The publisher's merges are append-only (data.manifest: the lineage's `next_merge_id` is the
tokenizer's vocabulary size), so an old id keeps its meaning and only new rows appear. Two stages
hold such rows: stage 0 the embedding (ids in), the last stage the head (logits out, scored
against labels). Every replica of a stage must grow at the same round boundary or the replicas'
models stop being bit-identical and their hashes disagree; rounds are counted per stage, so the
schedule is per stage too. It travels in the stage's signed member list (MemberList.vocab_size,
vocab_from_round), which every node already reads; a new schedule bumps the stage's epoch so nodes
take the new list, and `vocab_from_round` is `MembershipConfig.lead_rounds` past the stage's
current round (`current_round`: not moved by a minority of wallets claiming far-off rounds): time
for every replica to read it. A stage grows once more only after it reached its last growth.

The head grows first and the embedding only once the last stage has reported a round trained at the
grown head. The other order would let stage 0 feed a new id through the pipeline while the head
still has no row for it: that token's label would be out of the head's range. Middle stages hold
neither and are never scheduled; at one stage, stage 0 is the last stage and grows in one step.

`schedule_growth` is the decision, one transaction; `VocabWatch` is the leader-only background job
(verifier.leader) that reads the run's manifest every `VocabWatchConfig.period_s` and calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from neuroshard.data import Manifest
from neuroshard.node.vocab import vocab_cap

from . import members
from . import models as m
from .background import JobContext, PollingThread
from .datacheck import load_manifest
from .members import MembershipConfig


@dataclass(kw_only=True)
class VocabWatchConfig:
    period_s: float = 60.0
    """Seconds between reads of the run's manifest. A publisher grows the tokenizer rarely (days),
    and a schedule takes `MembershipConfig.lead_rounds` rounds to apply anyway: a minute of delay
    costs nothing, and the manifest is one small signed GET."""
    timeout_s: float = 30.0
    """How long stopping waits for a read of the manifest in progress."""

    def __post_init__(self) -> None:
        if not self.period_s > 0 or not self.timeout_s > 0:
            raise ValueError(
                f"VocabWatchConfig: period_s ({self.period_s}) and timeout_s ({self.timeout_s}) must be > 0"
            )


def vocab_in_force(session: Session, stage: int, network_vocab: int) -> int:
    """The vocabulary the stage has (or is scheduled to have): its schedule's, else the network's."""
    size, _ = members.vocab_schedule(session, stage)
    return size or network_vocab


RECENT_S = 3600.0
"""Receipts younger than this say where a stage is now (`current_round`); older ones only when no
replica of the stage reported that recently."""


def current_round(session: Session, stage: int, cfg: MembershipConfig, *, now: float) -> int | None:
    """The stage's round as its replicas report it, not as its most extreme wallets do: each
    wallet's newest receipt round (receipts of the last `RECENT_S`, all of them when none is that
    recent; only wallets whose votes count, under a probation or allowlist policy), sorted, with the
    top f = ⌊(n − 1)/3⌋ left out — the highest round that more than f wallets reached or passed.
    Replicas that lag or left lower it no more than they hold it back (a median would put a growth
    round in the past of the stage's leaders when half of its wallets lag); a minority of f wallets
    that claim a far-off round moves it not at all. None before the stage's first receipt."""
    counted = members.counted(session, stage, cfg, now=now)

    def newest_per_wallet(since: float | None) -> list[int]:
        query = select(m.Receipt.wallet_id, func.max(m.Receipt.round)).where(m.Receipt.stage == stage)
        if since is not None:
            query = query.where(m.Receipt.received_at >= since)
        rows = session.execute(query.group_by(m.Receipt.wallet_id))
        return sorted(r for w, r in rows if counted is None or w in counted)

    rounds = newest_per_wallet(now - RECENT_S) or newest_per_wallet(None)
    if not rounds:
        return None
    return rounds[len(rounds) - 1 - (len(rounds) - 1) // 3]


def _schedule(session: Session, stage: int, size: int, cfg: MembershipConfig, *, now: float) -> int | None:
    """Grow `stage` to `size` from `lead_rounds` past its current round; that round, or None when
    it is already at that size (another leader scheduled it first: the update only ever raises a
    stage's vocabulary). The stage's epoch moves so its replicas read the new list."""
    if members.vocab_schedule(session, stage)[0] >= size:
        return None
    from_round = (current_round(session, stage, cfg, now=now) or 0) + cfg.lead_rounds
    members.bump_epoch(session, stage, now=now)
    moved = session.execute(
        update(m.StageEpoch)
        .where(m.StageEpoch.stage == stage, m.StageEpoch.vocab_size < size)
        .values(vocab_size=size, vocab_from_round=from_round)
        .execution_options(synchronize_session=False)
    )
    return from_round if moved.rowcount else None  # type: ignore[attr-defined]


def _pending(session: Session, stage: int, cfg: MembershipConfig, *, now: float) -> bool:
    """Whether the stage has a growth scheduled that its replicas have not reached: a new one waits
    for it (a replica that crossed the first round would grow to the first size, the others to the
    second)."""
    size, from_round = members.vocab_schedule(session, stage)
    return bool(size) and (current_round(session, stage, cfg, now=now) or 0) < from_round


def schedule_growth(
    session: Session,
    *,
    num_stages: int,
    network_vocab: int,
    target_vocab: int,
    cfg: MembershipConfig,
    now: float,
) -> str | None:
    """One step toward `target_vocab` (the manifest's newest tokenizer size), in the caller's
    transaction: the head (last stage) first, then the embedding (stage 0) once the last stage has
    reported a round at its grown size. Returns what it scheduled, None when nothing. A target at
    or below a stage's vocabulary changes nothing: a vocabulary only grows, and calling this again
    with the same target is a no-op."""
    if num_stages < 1 or network_vocab < 1:
        raise ValueError(
            f"schedule_growth: num_stages ({num_stages}) and network_vocab ({network_vocab}) must be ≥ 1"
        )
    last = num_stages - 1
    if target_vocab > vocab_cap(network_vocab):
        head = vocab_in_force(session, last, network_vocab)
        if last > 0 and vocab_in_force(session, 0, network_vocab) < head:
            target_vocab = head  # no growth past the cap, but the embedding still catches up with the head
        else:
            raise ValueError(
                f"schedule_growth: target vocabulary {target_vocab} is beyond what a run defined at "
                f"{network_vocab} ids may grow to ({vocab_cap(network_vocab)}: node.vocab.vocab_cap); "
                "its checks would refuse every grown replica. Start a new run with a larger [model] vocab_size"
            )
    head = vocab_in_force(session, last, network_vocab)
    if head < target_vocab:
        if _pending(session, last, cfg, now=now):
            return None
        from_round = _schedule(session, last, target_vocab, cfg, now=now)
        if from_round is None:
            return None
        where = "stage 0 (embedding and head)" if last == 0 else f"stage {last} (head)"
        return f"vocab: {where} grows from {head} to {target_vocab} ids from round {from_round}"
    embedding = vocab_in_force(session, 0, network_vocab)
    if last == 0 or embedding >= target_vocab or _pending(session, 0, cfg, now=now):
        return None
    _, head_from = members.vocab_schedule(session, last)
    reported = current_round(session, last, cfg, now=now)
    if reported is None or reported < head_from:
        return None  # the head has not trained at its grown size yet: no new id may reach it
    from_round = _schedule(session, 0, target_vocab, cfg, now=now)
    if from_round is None:
        return None
    return (
        f"vocab: stage 0 (embedding) grows from {embedding} to {target_vocab} ids from round {from_round} "
        f"(stage {last}'s head reported round {reported}, at {head} ids since round {head_from})"
    )


class VocabWatch:
    """Reads the run's manifest every `period_s` and schedules the stages' vocabulary growth."""

    def __init__(
        self,
        ctx: JobContext,
        *,
        membership: MembershipConfig,
        config: VocabWatchConfig | None = None,
        manifest: Callable[[], Manifest] | None = None,
    ) -> None:
        """`manifest`: a loader in place of the run's published manifest (tests)."""
        self.ctx = ctx
        self.membership = membership
        self.config = config or VocabWatchConfig()
        self._load_manifest = manifest or (lambda: load_manifest(ctx.network, ctx.log))
        self._loop = PollingThread("vocab-watch", self.run_once, self.config.period_s, ctx.log, "vocab watch")
        self._refused: int | None = None
        """The last target refused (logged once, not every period)."""

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(self.config.timeout_s)

    def run_once(self) -> None:
        """One look at the manifest; what it schedules is logged."""
        try:
            target = self._load_manifest().tokenizer.next_merge_id
        except (OSError, ValueError) as exc:  # ManifestError is a ValueError; tried again next period
            self.ctx.log(f"vocab watch: the manifest did not load: {type(exc).__name__}: {exc}")
            return
        network = self.ctx.network
        try:
            with self.ctx.db.write() as session:
                line = schedule_growth(
                    session,
                    num_stages=network.num_stages,
                    network_vocab=network.model.vocab_size,
                    target_vocab=target,
                    cfg=self.membership,
                    now=self.ctx.clock(),
                )
        except ValueError as exc:  # a tokenizer grown past the cap: said once per target
            if self._refused != target:
                self._refused = target
                self.ctx.log(f"vocab watch: not scheduled: {exc}")
            return
        if line is not None:
            self.ctx.log(line)
