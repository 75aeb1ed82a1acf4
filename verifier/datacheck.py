"""Live data checks: did a replica read the data it was assigned, as much as it claims?

The cheap part of a spot check, run on a sample of incoming receipts from the evaluator's
background thread. A receipt's spans must follow the wallet's own shard order (a pure
function of its wallet id, the manifest and the held-out shard: data.assign_shards) and
cover exactly inner_steps × batch_size windows (verifier.spotcheck.check_data_spans). A
replica that trains on shards it picked itself, on the held-out shard, or claims more or
fewer batches than its steps fails and loses `spot_check_penalty` (ledger.record_spot_check).
In a pipeline run only stage 0 reads data, so only stage-0 receipts are checked; a later
stage's receipt claims no spans (its work is judged by its stage's hash agreement).

That the Δ is what those batches give is the replay check's job (verifier.replaycheck), on
its own sample: it costs a round of compute per receipt where this costs microseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select

from neuroshard.data import Manifest, assign_shards, read_manifest
from neuroshard.data.fetch import FetchConfig, fetch_manifest
from neuroshard.protocol.reports import DataSpan

from . import ledger
from . import models as m
from .background import JobContext
from .network import NetworkDefinition
from .sampling import sampled
from .spotcheck import check_data_spans

Log = Callable[[str], None]


@dataclass(kw_only=True)
class DataCheckConfig:
    sample_rate: float = 0.25
    """Share of receipts checked, picked by a hash of (wallet, stage, round): a replica cannot
    tell which of its receipts will be looked at."""
    max_per_pass: int = 200
    """Receipts looked at per pass, so a backlog never holds the thread for long."""

    def __post_init__(self) -> None:
        if not 0 <= self.sample_rate <= 1 or self.max_per_pass < 1:
            raise ValueError(f"DataCheckConfig: sample_rate in [0, 1], max_per_pass ≥ 1, got {self}")


def load_manifest(network: NetworkDefinition, log: Log) -> Manifest:
    """The run's manifest, verified against the network's publisher key."""
    key = bytes.fromhex(network.publisher_key)
    url = network.manifest_url
    if url.startswith(("http://", "https://")):
        return fetch_manifest(url, key, config=FetchConfig(), log=log)
    return read_manifest(Path(url), key)


def receipt_problems(receipt: m.Receipt, manifest: Manifest, network: NetworkDefinition) -> list[str]:
    """What is wrong with one stage-0 receipt's data claim (empty when nothing is)."""
    order = assign_shards(receipt.wallet_id, manifest, exclude={network.held_out_shard})
    spans = [DataSpan(shard_id=s, offset_start=a, offset_end=b) for s, a, b in receipt.data_spans]
    problems = check_data_spans(order, spans, batch_size=network.batch_size, inner_steps=receipt.inner_steps)
    if any(span.shard_id == network.held_out_shard for span in spans):
        problems.insert(0, f"read the held-out shard {network.held_out_shard}")
    return problems


class DataChecker:
    """Checks the data spans of a sample of new stage-0 receipts; run by the evaluator's thread."""

    def __init__(
        self,
        ctx: JobContext,
        *,
        config: DataCheckConfig | None = None,
        manifest: Callable[[], Manifest] | None = None,
    ) -> None:
        """`manifest`: a loader in place of the run's published manifest (tests)."""
        self.ctx = ctx
        self.config = config or DataCheckConfig()
        self._load_manifest = manifest or (lambda: load_manifest(ctx.network, ctx.log))
        self._manifest: Manifest | None = None
        self.last_id: int | None = None
        """Receipts up to this id were looked at; None until the first pass, which starts at the
        newest receipt (a restarted verifier does not judge its history twice)."""
        self.checked = 0
        self.failed = 0

    def run_once(self) -> None:
        if self.last_id is None:
            with self.ctx.db.read() as session:
                self.last_id = session.scalar(select(func.max(m.Receipt.id))) or 0
            return
        with self.ctx.db.read() as session:
            receipts = session.scalars(
                select(m.Receipt)
                .where(m.Receipt.id > self.last_id, m.Receipt.stage == 0)
                .order_by(m.Receipt.id)
                .limit(self.config.max_per_pass)
            ).all()
            session.expunge_all()
        for receipt in receipts:
            self.last_id = receipt.id
            if sampled(
                self.ctx.operator,
                "data",
                receipt.wallet_id,
                receipt.stage,
                receipt.round,
                self.config.sample_rate,
            ):
                self.check(receipt)

    def check(self, receipt: m.Receipt) -> None:
        if self._manifest is None:
            self._manifest = self._load_manifest()
        problems = receipt_problems(receipt, self._manifest, self.ctx.network)
        ok = not problems
        detail = "data spans follow the wallet's shard order" if ok else "; ".join(problems)
        with self.ctx.db.write() as session:
            ledger.record_receipt_check(
                session,
                receipt,
                ok=ok,
                detail=f"data check: {detail}",
                now=self.ctx.clock(),
                cfg=self.ctx.reputation,
            )
        self.checked += 1
        if not ok:
            self.failed += 1
            self.ctx.log(f"data check: {receipt.wallet_id} round {receipt.round} failed: {detail}")
