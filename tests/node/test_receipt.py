"""Round receipts as the node builds them, checked by the verifier's own strict wire model."""

import hashlib

import pytest
from pydantic import ValidationError

from neuroshard.node.p2p.rounds import RoundReport
from neuroshard.node.receipt import receipt_document
from neuroshard.node.wallet import Wallet
from neuroshard.node.work import RoundWork
from neuroshard.verifier.wire import ReceiptRequest

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
    receipt = ReceiptRequest.model_validate(doc, strict=True)
    assert (receipt.stage, receipt.round, receipt.inner_steps, receipt.start_step) == (0, 7, 4, 28)
    assert [(s.shard_id, s.offset_start, s.offset_end) for s in receipt.data] == [(3, 0, 8), (4, 0, 8)]
    assert receipt.base_hash == base and receipt.delta_digest == delta
    assert receipt.result_hash == hashlib.sha256(b"theta8").hexdigest()  # θ_{r+1}, the vote
    # Public keys on the peer plane become wallet ids in the receipt.
    assert [c.wallet for c in receipt.accepted] == [A.wallet_id, B.wallet_id]
    assert receipt.rejected[0].wallet == C.wallet_id and len(receipt.rejected[0].reason) == 200
    assert receipt.equivocators == [C.wallet_id]
    assert receipt.losses == [5.0, 4.9, 4.8, 4.7]


def test_a_stage0_receipt_without_data_would_be_refused() -> None:
    doc = receipt_document(
        _report(),
        RoundWork(),
        inner_steps=4,
        start_step=0,
        tokens=1,
        base_hash="0" * 64,
        delta_digest="0" * 64,
    )
    with pytest.raises(ValidationError, match="data is empty"):
        ReceiptRequest.model_validate(doc)
