"""Upkeep of the write path, run by the lead process only (verifier.leader): expired nonces are
forgotten and waiting rounds settled every `period_s`, a stage whose lists still name an operator's
roster that expired gets a new epoch (verifier.members.roster_expired), and a stage whose listed
probationers' turn is over starts the next one (verifier.members.next_turn).

Both used to happen in every write. A request's nonce DELETE deleted nothing most of the time,
and settling a stage after every receipt read the stage's votes and live replicas again for
each of a thousand receipts a round (issue 15: most of a receipt's cost). Requests now settle
a stage at most every `VerifierConfig.settle_interval_s` per process (api.writes); this job
settles whatever a pause left waiting, so a round whose last receipt fell in one still settles
within a period.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from . import ledger, members
from .background import JobContext, PollingThread
from .ledger import LedgerConfig


@dataclass(frozen=True, kw_only=True)
class HousekeepingConfig:
    period_s: float = 2.0
    """Seconds between two sweeps."""
    timeout_s: float = 10.0
    """How long stop() waits for the sweep in progress."""

    def __post_init__(self) -> None:
        if self.period_s <= 0:
            raise ValueError(f"HousekeepingConfig: period_s must be > 0, got {self.period_s}")


class Housekeeping:
    """A `leader.Job`: one sweep every `config.period_s` on its own thread."""

    def __init__(self, ctx: JobContext, *, ledger_config: LedgerConfig, config: HousekeepingConfig) -> None:
        self.ctx = ctx
        self.ledger = ledger_config
        self.config = config
        self._loop = PollingThread("housekeeping", self._sweep, config.period_s, ctx.log, "housekeeping")

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(self.config.timeout_s)

    def _sweep(self) -> None:
        self.run_once()

    def run_once(self) -> tuple[int, dict[int, list[int]]]:
        """One sweep: (nonces forgotten, {stage: rounds settled}). Each stage settles in its own
        transaction: a race with a receipt settling the same round, or a deadlock, costs only that
        stage's settlement until the next sweep. A nonce is forgotten one freshness window after
        it expired, so a request verified just before its timestamp went stale and delayed in the
        thread pool or the group commit's queue (verifier.groupcommit), or by another host's clock,
        still finds its nonce taken."""
        now = self.ctx.clock()
        with self.ctx.db.write(stale_reads=False) as session:
            purged = ledger.purge_nonces(session, now=now - self.ledger.nonce_window_s)
        settled: dict[int, list[int]] = {}
        for stage in range(self.ledger.num_stages):
            try:
                with self.ctx.db.write(stale_reads=False) as session:
                    rounds = ledger.settle_rounds(session, stage, now=now, cfg=self.ledger)
            except IntegrityError:
                continue  # a receipt settled it first; the next sweep sees it settled
            except SQLAlchemyError as exc:
                self.ctx.log(f"housekeeping: settling stage {stage} deferred: {type(exc).__name__}: {exc}")
                continue
            if rounds:
                settled[stage] = rounds
        expired = self._expired_rosters(now)
        turned = self._next_turns(now)
        if settled or turned or expired:
            self.ctx.db.touch()  # the settled rounds and the new member lists show in the reads
        return purged, settled

    def _expired_rosters(self, now: float) -> list[int]:
        """Stages whose lists named an operator's roster that has expired since: a new epoch each,
        whose list leaves the roster's wallets out (members.roster_expired). Read first: most
        sweeps write nothing."""
        expired: list[int] = []
        for stage in range(self.ledger.num_stages):
            with self.ctx.db.read() as session:
                if not members.roster_expired(session, stage, now=now):
                    continue
            try:
                with self.ctx.db.write(stale_reads=False) as session:
                    if members.roster_expired(session, stage, now=now):
                        members.bump_epoch(session, stage, now=now)
                        expired.append(stage)
            except SQLAlchemyError as exc:
                self.ctx.log(
                    f"housekeeping: stage {stage}'s expired roster deferred: {type(exc).__name__}: {exc}"
                )
        if expired:
            self.ctx.log(
                f"housekeeping: the operator's roster expired; new member lists in stage(s) {expired}"
            )
        return expired

    def _next_turns(self, now: float) -> list[int]:
        """Stages whose turn of listed probationers ended and that started the next (a new epoch).
        A stage's turn is read in a read transaction first: most sweeps write nothing."""
        cfg = self.ledger.membership
        turned: list[int] = []
        for stage in range(self.ledger.num_stages):
            with self.ctx.db.read() as session:
                due = members.turn_due(session, stage, cfg, now=now)
            if due is None:
                continue
            try:
                with self.ctx.db.write(stale_reads=False) as session:
                    if (
                        members.next_turn(session, stage, cfg, now=now, alive_s=self.ledger.peer_ttl_s)
                        == "started"
                    ):
                        turned.append(stage)
            except SQLAlchemyError as exc:
                self.ctx.log(
                    f"housekeeping: stage {stage}'s probation turn deferred: {type(exc).__name__}: {exc}"
                )
        if turned:
            self.ctx.log(f"housekeeping: a new turn of listed probationers in stage(s) {turned}")
        return turned
