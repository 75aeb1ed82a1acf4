"""Round receipts: the signed work report a replica sends the verifier after every round.

`Receipting` wraps the round hook (PeerPlane.finish_round). Before the hook it reads
what only the engine knows at the round's end — θ_r's hash, the inner steps, Δ's digest —
and after it what the peer exchange decided (RoundReport: the result hash, accepted and
rejected contributions, equivocators); with the trainer's RoundWork (data spans, losses)
that is the whole receipt (``neuroshard.protocol.reports.Receipt``, checked here as the verifier
will check it). The receipt goes to the VerifierClient's queue; the round never waits for the verifier.

With a ReplayArchive it also snapshots the inner AdamW state whenever a round starts,
commits to its digest in the receipt (`inner_state_digest`), and keeps the round's
(θ_round, inner state, Δ) for the verifier's replay spot checks (node.replay).

With a SegmentRecorder (node.segments) it starts, ends and closes the round's segment log around
the round hook and puts its root and segment count in the receipt (`segment_root`, `segments`):
the commitment a segment spot check holds the replica to, at every stage.

With `Receipting.disputes` (the pipeline client's `disputes_of`, node.p2p.pipeline) a sender's
receipt also names the micro-batches of its round whose audits found the next stage's answers
apart (`disputes`), for the verifier to replay what an audit could not settle.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from neuroshard.protocol.identity import wallet_id_of
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.reports import (
    MAX_LOSS,
    MAX_REASON_CHARS,
    AcceptedContribution,
    DataSpan,
    Dispute,
    Receipt,
    RejectedContribution,
)
from neuroshard.protocol.segments import SegmentLog

from .diloco import DiLoCo, tensor_digest
from .inner_loop import RoundFinisher
from .p2p.rounds import RoundReport
from .replay import InnerState, ReplayArchive, ReplayRecord, capture_inner_state
from .segments import SegmentRecorder
from .wallet import Wallet
from .work import RoundWork


def reportable_losses(losses: list[float]) -> list[float]:
    """The inner-step losses as the receipt reports them: all of them, or none when any is not a
    loss the verifier takes (NaN, inf: a diverged step). Losses are only shown, but a refused
    receipt would cost the replica its hash vote, which is judged."""
    values = [float(x) for x in losses]
    return values if all(math.isfinite(x) and 0.0 <= x <= MAX_LOSS for x in values) else []


def _wallet_id(public_key_hex: str) -> str:
    return wallet_id_of(bytes.fromhex(public_key_hex))


def receipt_document(
    report: RoundReport,
    work: RoundWork,
    *,
    inner_steps: int,
    start_step: int,
    tokens: int,
    base_hash: str,
    delta_digest: str,
    inner_state_digest: str | None = None,
    device: str | None = None,
    precision: str | None = None,
    segment_log: SegmentLog | None = None,
    disputes: tuple[Dispute, ...] | None = None,
) -> Receipt:
    """The receipt of one round (wallet ids, not public keys), checked as the verifier checks it
    (Refused if it could not pass). `device` (cpu, cuda, mps) and `precision` (fp32, bf16, fp16)
    state what the inner steps ran on: a replay in another precision is judged with the
    cross-precision tolerance (verifier.replaycheck). `segment_log`: the round's segment log,
    whose root and segment count the receipt commits to. `disputes`: this round's micro-batches
    whose next-stage answers an audit found apart (None: none)."""
    return Receipt.checked(
        stage=report.stage,
        round=report.round,
        inner_steps=inner_steps,
        start_step=start_step,
        tokens=tokens,
        data=tuple(DataSpan(shard_id=s, offset_start=a, offset_end=b) for s, a, b in work.spans),
        losses=tuple(reportable_losses(work.losses[-inner_steps:])),
        base_hash=base_hash,
        result_hash=report.theta_hash,
        delta_digest=delta_digest,
        inner_state_digest=inner_state_digest,
        device=device,
        precision=precision,
        segment_root=None if segment_log is None else segment_log.root(),
        segments=None if segment_log is None else segment_log.segments,
        accepted=tuple(AcceptedContribution(wallet=_wallet_id(w)) for w in report.accepted),
        rejected=tuple(
            RejectedContribution(wallet=_wallet_id(w), reason=(reason or "rejected")[:MAX_REASON_CHARS])
            for w, reason in report.rejected
        ),
        equivocators=tuple(_wallet_id(w) for w in report.equivocators),
        disputes=disputes,
    )


class Receipting:
    """A round hook that runs `inner` and then hands the round's receipt to `submit`."""

    def __init__(
        self,
        inner: RoundFinisher,
        reports: list[RoundReport],
        work: RoundWork,
        submit: Callable[[Receipt], None],
        *,
        batch_size: int | None,
        tokens_per_step: int,
        log: Callable[[str], None],
        archive: ReplayArchive | None = None,
        segments: SegmentRecorder | None = None,
        signer: Wallet | None = None,
        archive_every_round: bool = False,
    ) -> None:
        """`batch_size` None: a stage > 0 replica, which reads no data; its receipt claims no spans
        and counts the tokens of the micro-batches it trained (RoundWork.tokens). `segments`: the
        recorder the training loop feeds (`record_step`); `signer` signs each round's segment root.
        `archive_every_round`: keep whole-round material of rounds with a segment root too (a
        benchmark that times the whole-round replay against segment checks; a node never does)."""
        self._inner = inner
        self._reports = reports
        self._work = work
        self._submit = submit
        self._batch_size = batch_size
        self._tokens_per_step = tokens_per_step
        self._log = log
        self._archive = archive
        self._archive_every_round = archive_every_round
        self._segments = segments
        self._signer = signer
        self._round_start: tuple[int, InnerState] | None = None
        """(diloco.step, inner state) when the current round started; None until a round starts here."""
        self.disputes: Callable[[int], tuple[Dispute, ...] | None] | None = None
        """A round's disputes, handed over for its receipt (node.p2p.pipeline
        `PipelineClient.disputes_of`); set once the link to the next stage exists (the driver
        builds it after this hook). None: a replica that sends nothing onward (the last stage)
        disputes nothing."""

    def round_started(self, diloco: DiLoCo) -> None:
        """Snapshot the inner state of a round about to start (called by the hook after each round;
        call it once before training when the engine starts at a round boundary)."""
        if self._segments is not None:
            self._segments.start_round(diloco)
        if self._archive is None or diloco.steps_in_round != 0:
            return
        inner = capture_inner_state(diloco)
        self._round_start = None if inner is None else (diloco.step, inner)

    def __call__(self, diloco: DiLoCo) -> None:
        steps = diloco.steps_in_round
        theta_round = diloco.theta_round.detach().clone()
        base_hash = tensor_digest(theta_round)
        # Δ as the replica computed it, float32 before any wire encoding: what a spot check replays.
        delta = diloco.pseudo_gradient()
        delta_digest = tensor_digest(delta)
        start_step = diloco.schedule_step - steps
        inner = self._inner_state_of_round(diloco, steps)
        round_ = diloco.round
        seen = len(self._reports)
        if self._segments is not None:
            self._segments.end_round(diloco)  # the last checkpoint, before the outer step moves it
        self._inner(diloco)
        closed = None if self._segments is None else self._segments.close_round(self._signer)
        self.round_started(diloco)
        if inner is not None and self._archive is not None and (closed is None or self._archive_every_round):
            # Only a receipt without a segment root is checked by replaying its whole round from
            # this record (a round redone after a restart that followed its commitment); one with a
            # root is checked by segments, from disk. So the archive's 16 bytes a parameter a round
            # are held in memory only for the rounds that need them.
            self._archive.add(ReplayRecord(round=round_, theta_round=theta_round, inner=inner, delta=delta))
        if len(self._reports) == seen:
            self._log("receipt: the round hook produced no round report; nothing to send")
            return
        if not self._whole_round(steps):
            return
        tokens = steps * self._tokens_per_step if self._batch_size is not None else self._work.tokens
        report = self._reports[-1]

        def document(disputes: tuple[Dispute, ...] | None) -> Receipt:
            return receipt_document(
                report,
                self._work,
                inner_steps=steps,
                start_step=start_step,
                tokens=tokens,
                base_hash=base_hash,
                delta_digest=delta_digest,
                inner_state_digest=None if inner is None else inner.digest(),
                device=diloco.placement.kind,
                precision=diloco.placement.precision,
                segment_log=None if closed is None else closed[0],
                disputes=disputes,
            )

        disputes = None if self.disputes is None else self.disputes(report.round)
        try:
            try:
                receipt = document(disputes)
            except Refused as exc:
                if disputes is None:
                    raise
                # The round's work is reported whatever became of its disputes.
                self._log(
                    f"receipt: round {report.round}: its disputes would be refused ({exc}); sent without them"
                )
                receipt = document(None)
        except Refused as exc:  # the verifier would refuse it: say so here instead of sending it
            self._log(f"receipt: round {report.round}: not sent, it would be refused: {exc}")
            return
        self._submit(receipt)

    def _whole_round(self, steps: int) -> bool:
        """Whether the work record covers all `steps` of the round. A round resumed from a mid-round
        checkpoint does not: what was read or trained before the restart is not known, and a receipt
        claiming the whole round would misstate it."""
        if self._batch_size is None:
            recorded, wanted, what = len(self._work.losses), steps, "micro-batches"
        else:
            recorded = sum(end - start for _, start, end in self._work.spans)
            wanted, what = steps * self._batch_size, f"windows (batches of {self._batch_size})"
        if steps >= 1 and recorded == wanted:
            return True
        self._log(
            f"receipt: round {self._reports[-1].round}: {recorded} {what} recorded for {steps} steps "
            "(resumed mid-round); no receipt"
        )
        return False

    def _inner_state_of_round(self, diloco: DiLoCo, steps: int) -> InnerState | None:
        """The snapshot taken when this round started, if it was (a round resumed from a mid-round
        checkpoint, or entered before the hook was installed, has none)."""
        if self._round_start is None:
            return None
        at_step, inner = self._round_start
        self._round_start = None
        return inner if diloco.step - at_step == steps else None
