"""What a replica did in the current round: the data it read and its inner-step losses.

The trainer fills it step by step; whoever finishes the round (the receipt reporter,
node.verifier_client) reads it, and the trainer clears it once the round is done. The spans are
exactly what data.shards.BatchStream read, so the verifier can recompute the batches
(verifier.spotcheck.claimed_batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundWork:
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    """(shard_id, offset_start, offset_end) runs of windows read in order; offsets index the
    shard's window permutation (data.shards.window_order)."""
    losses: list[float] = field(default_factory=list)
    """Training loss of each inner step of the round (self-reported: never proof of anything)."""
    tokens: int = 0
    """Tokens of the micro-batches a stage > 0 replica trained on this round (their sizes vary by
    sender); stage 0 reads fixed batches and its receipt counts steps × batch × seq instead."""

    def read(self, shard_id: int, offset_start: int, offset_end: int) -> None:
        """Record one batch; consecutive batches of the same shard merge into one span."""
        if self.spans:
            last_shard, last_start, last_end = self.spans[-1]
            if last_shard == shard_id and last_end == offset_start:
                self.spans[-1] = (shard_id, last_start, offset_end)
                return
        self.spans.append((shard_id, offset_start, offset_end))

    def trained(self, tokens: int, loss: float) -> None:
        """Record one micro-batch a stage > 0 replica stepped on."""
        self.tokens += tokens
        self.losses.append(loss)

    def clear(self) -> None:
        self.spans.clear()
        self.losses.clear()
        self.tokens = 0
