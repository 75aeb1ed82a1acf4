"""Who feeds a stage > 0 replica, and whether they have all ended (`Upstream`): the bookkeeping behind
the signed `PipelineEnd` (protocol.pipeline), kept apart from the transport (p2p.pipeline) that
records into it. No I/O."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from neuroshard.protocol.pipeline import PipelineEnd

MAX_SENDERS = 4096
"""Senders (and ends) an `Upstream` remembers: far beyond any stage's replica count; a flood of
fresh wallets pushes out the oldest instead of growing the tables."""


class Upstream:
    """Which replicas of the stage before this one sent it work lately, and which of them ended.

    No I/O; safe from any thread (the route writes on the event loop, the worker reads on its
    own). The pipeline is over for this replica once a sender has ended and every sender heard
    from in the last `ttl_s` has ended: a sender that sends again after its end (restarted) is
    live again, and one silent for `ttl_s` (gone without a word) no longer holds the end up.
    Only a wallet whose micro-batch this replica took in the last `ttl_s` can end it: an end
    from anyone else is not recorded (`ended` says so; the route refuses it), so a stranger
    cannot end an idle replica. Both tables are bounded by `max_senders`, oldest out first."""

    def __init__(
        self, ttl_s: float, clock: Callable[[], float] = time.monotonic, max_senders: int = MAX_SENDERS
    ) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_senders = max_senders
        self._lock = threading.Lock()
        self._last_sent: OrderedDict[str, float] = OrderedDict()
        """Sender -> when its last micro-batch was taken, oldest first; none older than `ttl_s`."""
        self._ended: OrderedDict[str, PipelineEnd] = OrderedDict()

    def sent(self, wallet: str) -> None:
        """This replica took a micro-batch from `wallet` now (it is live, whatever it said before)."""
        with self._lock:
            self._last_sent[wallet] = self.clock()
            self._last_sent.move_to_end(wallet)
            self._ended.pop(wallet, None)
            self._trim()

    def knows(self, wallet: str) -> bool:
        """Whether a micro-batch of `wallet` was taken here in the last `ttl_s`."""
        with self._lock:
            self._trim()
            return wallet in self._last_sent

    def ended(self, end: PipelineEnd) -> bool:
        """Record that `end.wallet` sends no more (its signature checked by the caller); False, and
        nothing recorded, when no micro-batch of that wallet was taken here in the last `ttl_s`."""
        with self._lock:
            self._trim()
            if end.wallet not in self._last_sent:
                return False
            self._ended[end.wallet] = end
            self._ended.move_to_end(end.wallet)
            while len(self._ended) > self.max_senders:
                self._ended.popitem(last=False)
            return True

    def over(self) -> str | None:
        """Why this replica has no more work to wait for, or None while a recent sender is live."""
        with self._lock:
            if not self._ended:
                return None
            self._trim()
            if any(wallet not in self._ended for wallet in self._last_sent):
                return None
            last = max(self._ended.values(), key=lambda e: (e.round, e.step))
            return (
                f"{len(self._ended)} replica(s) of stage {last.stage} sent a signed end "
                f"(the last at its round {last.round}, step {last.step}) and none sends work"
            )

    def _trim(self) -> None:
        """Forget senders quiet for `ttl_s` (they no longer hold the end up) and the oldest beyond
        `max_senders`. Called with the lock held."""
        now = self.clock()
        while self._last_sent:
            wallet, at = next(iter(self._last_sent.items()))
            if now - at <= self.ttl_s and len(self._last_sent) <= self.max_senders:
                break
            del self._last_sent[wallet]
