"""Round receipts as the node builds them, checked by the parser the verifier runs (protocol.reports)."""

import hashlib
import json
from collections.abc import Callable

import pytest
import torch
from tests_support import refused

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.p2p.rounds import RoundReport
from neuroshard.node.pipeline import stage_inner_step
from neuroshard.node.receipt import Receipting, receipt_document
from neuroshard.node.wallet import Wallet
from neuroshard.node.work import RoundWork
from neuroshard.protocol.identity import sha256_hex
from neuroshard.protocol.pipeline import GradientReply, micro_batch_id
from neuroshard.protocol.reports import Dispute, Receipt

A, B, C = (Wallet.from_token(t) for t in ("a", "b", "c"))


def _report(**overrides: object) -> RoundReport:
    fields: dict[str, object] = {
        "stage": 0,
        "round": 7,
        "accepted": (A.public_key_hex, B.public_key_hex),
        "rejected": ((C.public_key_hex, "base_hash 1234… != this replica's θ_r hash " + "x" * 300),),
        "equivocators": (C.public_key_hex,),
        "late": False,
        "next_round": 8,
        "theta_hash": hashlib.sha256(b"theta8").hexdigest(),
        "agree": 2,
        "voters": 2,
        "resynced_from": None,
        "seconds": 0.1,
    }
    fields.update(overrides)
    return RoundReport(**fields)  # type: ignore[arg-type]


def test_work_merges_consecutive_batches_of_a_shard_and_splits_on_a_change() -> None:
    work = RoundWork()
    for start in (0, 4, 8):
        work.read(3, start, start + 4)
    work.read(5, 0, 4)  # rotated to the next shard
    work.read(5, 8, 12)  # a gap is a new span, not a silent merge
    assert work.spans == [(3, 0, 12), (5, 0, 4), (5, 8, 12)]
    work.losses += [2.0, 1.5]
    work.clear()
    assert work.spans == [] and work.losses == []


def test_receipt_document_is_what_the_verifier_accepts() -> None:
    work = RoundWork()
    work.read(3, 0, 8)
    work.read(4, 0, 8)
    work.losses += [5.0, 4.9, 4.8, 4.7]
    base, delta = hashlib.sha256(b"theta7").hexdigest(), hashlib.sha256(b"delta").hexdigest()
    doc = receipt_document(
        _report(), work, inner_steps=4, start_step=28, tokens=4 * 8 * 32, base_hash=base, delta_digest=delta
    )
    receipt = Receipt.from_json(doc.to_json())
    assert (receipt.stage, receipt.round, receipt.inner_steps, receipt.start_step) == (0, 7, 4, 28)
    assert [(s.shard_id, s.offset_start, s.offset_end) for s in receipt.data] == [(3, 0, 8), (4, 0, 8)]
    assert receipt.base_hash == base and receipt.delta_digest == delta
    assert receipt.result_hash == hashlib.sha256(b"theta8").hexdigest()  # θ_{r+1}, the vote
    # Public keys on the peer plane become wallet ids in the receipt.
    assert [c.wallet for c in receipt.accepted] == [A.wallet_id, B.wallet_id]
    assert receipt.rejected[0].wallet == C.wallet_id and len(receipt.rejected[0].reason) == 200
    assert receipt.equivocators == (C.wallet_id,)
    assert receipt.losses == (5.0, 4.9, 4.8, 4.7)


def _dispute(stage: int, to: Wallet, sequence: int = 0) -> Dispute:
    """Two stage-`stage` replicas' replies to one of `to`'s micro-batches (they answered it apart)."""
    micro_batch = micro_batch_id(to.public_key_hex, 7, sequence)

    def reply(replier: Wallet, payload: bytes) -> GradientReply:
        return GradientReply.create(
            replier, to=to.public_key_hex, micro_batch=micro_batch, stage=stage, round=3, loss=4.5,
            codec="int8", payload_sha256=sha256_hex(payload),
        )  # fmt: skip

    return Dispute.checked(micro_batch=micro_batch, replies=(reply(A, b"honest"), reply(B, b"negated")))


def test_a_receipt_carries_its_disputes_as_signed_and_one_without_leaves_them_out() -> None:
    work = RoundWork()
    work.read(3, 0, 8)
    disputes = (_dispute(1, C), _dispute(1, C, sequence=1))

    def receipt(disputes: tuple[Dispute, ...] | None) -> bytes:
        return receipt_document(
            _report(), work, inner_steps=4, start_step=28, tokens=1024, base_hash="0" * 64,
            delta_digest="1" * 64, disputes=disputes,
        ).to_json()  # fmt: skip

    carried = Receipt.from_json(receipt(disputes)).disputes
    assert carried == disputes
    assert carried is not None and all(r.signature_valid() for d in carried for r in d.replies)
    assert "disputes" not in json.loads(receipt(None))  # a receipt without any reads as before


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 2e6])
def test_a_diverged_loss_leaves_the_losses_out_and_the_receipt_accepted(bad: float) -> None:
    work = RoundWork()
    work.read(3, 0, 8)
    work.losses += [5.0, bad, 4.8, 4.7]
    doc = receipt_document(
        _report(), work, inner_steps=4, start_step=28, tokens=1024, base_hash="0" * 64, delta_digest="1" * 64
    )
    assert Receipt.from_json(doc.to_json()).losses == ()


def test_a_stage0_receipt_without_data_would_be_refused() -> None:
    with refused("invalid", match="data is empty"):
        receipt_document(
            _report(),
            RoundWork(),
            inner_steps=4,
            start_step=0,
            tokens=1,
            base_hash="0" * 64,
            delta_digest="0" * 64,
        )


def _stage1_round(
    micro_batches: int, recorded: int, disputes: Callable[[int], tuple[Dispute, ...] | None] | None = None
) -> tuple[list[Receipt], list[str]]:
    """A stage-1 replica steps on `micro_batches` micro-batches, `recorded` of them in its RoundWork,
    then closes round 0 through Receipting, asking `disputes` for the round's; returns what it
    submitted and logged."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_dim=32, max_seq_len=16)
    diloco = DiLoCo(build_stage(config, 1, 2), DiLoCoConfig(inner_steps=micro_batches, warmup_steps=0))
    work = RoundWork()
    for i in range(micro_batches):
        hidden, labels = torch.randn(2, 8, 16), torch.randint(0, 64, (2, 8))
        _, loss = stage_inner_step(diloco, hidden, labels, None)
        if i < recorded:
            work.trained(labels.numel(), loss)
    reports: list[RoundReport] = []

    def finish(d: DiLoCo) -> None:
        d.outer_step(d.pseudo_gradient())
        reports.append(_report(stage=1, round=0, theta_hash=d.weights_hash()))

    submitted: list[Receipt] = []
    lines: list[str] = []
    hook = Receipting(
        finish, reports, work, submitted.append, batch_size=None, tokens_per_step=0, log=lines.append
    )
    hook.disputes = disputes
    hook(diloco)
    return submitted, lines


def test_a_later_stage_receipt_claims_no_data_and_counts_the_micro_batches_it_trained() -> None:
    submitted, _ = _stage1_round(3, 3)
    [doc] = submitted
    receipt = Receipt.from_json(doc.to_json())
    assert (receipt.stage, receipt.inner_steps, receipt.data, receipt.tokens) == (1, 3, (), 3 * 2 * 8)
    assert len(receipt.losses) == 3


def test_a_later_stage_round_not_wholly_recorded_sends_no_receipt() -> None:
    submitted, lines = _stage1_round(3, 2)  # resumed mid-round: one step's work is not known
    assert submitted == [] and any("resumed mid-round" in line for line in lines)


def test_a_round_s_receipt_asks_for_that_round_s_disputes_and_carries_them() -> None:
    asked: list[int] = []
    disputes = (_dispute(2, C),)

    def disputes_of(round_: int) -> tuple[Dispute, ...] | None:
        asked.append(round_)
        return disputes

    [doc] = _stage1_round(3, 3, disputes_of)[0]
    assert asked == [0] and Receipt.from_json(doc.to_json()).disputes == disputes


def test_disputes_the_verifier_would_refuse_leave_the_receipt_and_the_round_is_still_reported() -> None:
    """A stage-1 replica disputes stage 2's answers only: disputes of its own stage's would have the
    whole receipt refused, so it is sent without them, and says so."""
    submitted, lines = _stage1_round(3, 3, lambda round_: (_dispute(1, C),))
    [doc] = submitted
    assert doc.disputes is None and any("its disputes would be refused" in line for line in lines)
