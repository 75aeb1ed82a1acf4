"""A replica's way to the next pipeline stage (`PipelineLink`), as blocking calls for its training
thread. The stage > 0 replica that serves micro-batches is built in node.stage_replica.

- Stage 0 (the driver) is a normal `Trainer` built with ``num_stages=S`` and
  ``loss_fn=remote_loss(link.downstream, link.blame_driven)``: each inner step runs its layers,
  sends the hidden state through `PipelineLink`, and back-propagates the gradient that comes back
  (refusing one that overflows the backward, whose sender `blame_driven` bans).
- A stage i > 0 replica (node.stage_replica) has no data: its peer server takes micro-batches
  (`PipelineService`), a `StageWorker` trains on them, and a non-last stage forwards its own
  output through its own `PipelineLink`.
- Every stage runs its own DiLoCo outer rounds among its replicas through `PeerPlane`
  (already per stage), counted in inner steps per replica (H).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from torch import Tensor

from neuroshard.protocol.pipeline import micro_batch_id

from ..membership import Neighbours
from ..segments import SegmentRecorder
from .pipeline import NotListed, PipelineClient, PipelineConfig
from .plane import PeerPlane


class PipelineLink:
    """This node's way to the next stage, as blocking calls for the training thread."""

    def __init__(
        self,
        network: PeerPlane,
        config: PipelineConfig,
        *,
        stop: threading.Event,
        round_of: Callable[[], int],
        log: Callable[[str], None],
        step_of: Callable[[], int] | None = None,
        segments: SegmentRecorder | None = None,
        receivers: Neighbours | None = None,
    ) -> None:
        """`segments`: where the sent activations and the gradient replies are recorded, if anywhere.
        `receivers`: the next stage's membership (None: every live replica of it is offered work)."""
        self.network = network
        self.config = config
        self.log = log
        self.round_of = round_of
        self.step_of = step_of
        self.stop = stop
        self.driving: str | None = None
        """The micro-batch id `downstream` sent last (the driver's step in progress)."""
        self.client = PipelineClient(
            wallet=network.wallet,
            stage=network.stage,
            peers=network.node.peers,
            config=config,
            clock=network.node.clock,
            log=log,
            stop=stop,
            segments=segments,
            bucket=network.bucket,
            receivers=receivers,
        )

    def start(self) -> None:
        self.network.call(self.client.start(), timeout=10.0)

    def close(self) -> None:
        """Closes the client, after logging what its audits of the next stage found."""
        c = self.client
        if c.audits:
            self.log(
                f"pipeline: audited {c.audits} answer(s) of stage {self.network.stage + 1}: {c.audit_blamed} outvoted "
                f"and banned, {c.audits_unsettled} disputes without a majority that may ban, "
                f"{c.audits_unchecked} with nobody else to ask; {c.disputes_reported} dispute(s) reported "
                f"to the verifier in receipts, {c.disputes_dropped} dropped"
            )
        self.network.call(self.client.close(), timeout=10.0)

    def end(self, round_: int, step: int) -> None:
        """Tell the next stage's replicas this one sent work to that it sends no more (a signed
        `PipelineEnd`): when every replica feeding one of them has said so, it ends too."""
        try:
            told, tried = self.network.call(self.client.end(round_, step), timeout=30.0)
        except Exception as exc:  # leaving regardless: to the next stage this one left without a word
            self.log(f"pipeline: could not tell the next stage this one ends ({type(exc).__name__}: {exc})")
            return
        if tried:
            self.log(
                f"pipeline: told {told}/{tried} stage {self.network.stage + 1} replica(s) this one sends no more"
            )

    def downstream(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
        """The driver's `Downstream`: (hidden (B, T, C), labels (B, T)) -> (∂loss/∂hidden, loss), sent
        as micro-batch number `step_of()` (the inner step it is for) of round `round_of()`. While the
        next stage's replicas refuse it as not on their member list (`NotListed`), it waits and
        asks again, until stopped; with nobody there at all it raises `PipelineUnavailable`."""
        if self.step_of is None:
            raise ValueError("only the driver (stage 0, built with step_of) names micro-batches")
        round_ = self.round_of()
        micro_batch = micro_batch_id(self.network.wallet.public_key_hex, round_, self.step_of())
        self.driving = micro_batch
        while True:
            try:
                return self.forward(hidden, labels, micro_batch, patient=True)
            except NotListed as exc:
                # A driver new to the run (or past a full list of probationers) is not named yet:
                # the next stage reads its lists every few seconds, so it waits rather than stops.
                if self.stop.is_set():
                    raise
                self.log(f"pipeline: {exc}; waiting for a member list that names this replica")

    def blame_driven(self, why: str) -> bool:
        """The driver's `pipeline.Blame`: the gradient for the micro-batch `downstream` sent last
        overflowed the backward; its sender is banned and a retry goes elsewhere."""
        return self.driving is not None and self.blame(self.driving, why)

    def blame(self, micro_batch: str, why: str) -> bool:
        """The gradient that came back for `micro_batch` overflowed this replica's backward: ban
        its sender (`PipelineClient.blame`); False when no answer to that id is known."""
        return self.network.call(self.client.blame(micro_batch, why), timeout=10.0) is not None

    def forward(
        self, hidden: Tensor, labels: Tensor, micro_batch: str, *, patient: bool = False
    ) -> tuple[Tensor, float]:
        """A `stage_worker.Forward`: send a micro-batch on under the id it already has. A middle
        replica is not `patient`: refused as not listed by every next-stage replica (`NotListed`),
        or 409 by every one (the id already taken with another payload: `PipelineUnavailable`), it
        gives the micro-batch up at once and its sender takes it elsewhere."""
        coro = self.client.forward(
            hidden, labels, round_=self.round_of(), micro_batch=micro_batch, patient=patient
        )
        # No attempt starts after deadline_s, and one through the bucket may take 1.5 × the timeout.
        return self.network.call(
            coro, timeout=self.config.deadline_s + 1.5 * self.config.request_timeout_s + 10.0
        )
