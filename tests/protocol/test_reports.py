"""Receipts name disputed micro-batches (protocol.reports.Dispute): the replies an audit found apart."""

import json

import pytest

from neuroshard.node.wallet import Wallet
from neuroshard.protocol.pipeline import GradientReply
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.reports import MAX_DISPUTES, Dispute, Receipt

RECEIVER, A, B, C = (Wallet.from_token(f"reports-{n}") for n in ("receiver", "a", "b", "c"))
MB = "12" * 16


def reply(signer: Wallet, *, micro_batch: str = MB, to: Wallet = RECEIVER, stage: int = 1) -> GradientReply:
    return GradientReply.create(
        signer, to=to.public_key_hex, micro_batch=micro_batch, stage=stage, round=3, loss=4.0,
        codec="int8", payload_sha256=signer.public_key_hex,
    )  # fmt: skip


def receipt(**fields: object) -> dict[str, object]:
    return {
        "stage": 0, "round": 3, "inner_steps": 4, "start_step": 12, "tokens": 256,
        "data": [{"shard_id": 0, "offset_start": 0, "offset_end": 8}], "losses": [5.0] * 4,
        "base_hash": "a" * 64, "result_hash": "b" * 64, "delta_digest": "c" * 64, **fields,
    }  # fmt: skip


def test_a_dispute_names_two_or_three_answers_to_one_micro_batch_from_different_replicas() -> None:
    two = Dispute(micro_batch=MB, replies=(reply(A), reply(B)))
    assert Dispute.from_json(two.to_json()) == two and all(r.signature_valid() for r in two.replies)
    Dispute.checked(micro_batch=MB, replies=(reply(A), reply(B), reply(C)))
    bad = {
        "one answer": (reply(A),),
        "the same replica twice": (reply(A), reply(A)),
        "another micro-batch": (reply(A), reply(B, micro_batch="34" * 16)),
        "answers to two replicas": (reply(A), reply(B, to=C)),
        "answers of two stages": (reply(A), reply(B, stage=2)),
    }
    for why, replies in bad.items():
        with pytest.raises(Refused, match="dispute") as refused:
            Dispute.checked(micro_batch=MB, replies=replies)
        assert refused.value.code == "invalid", why


def test_a_receipt_disputes_the_next_stage_once_a_micro_batch_and_says_nothing_without_disputes() -> None:
    plain = Receipt.from_obj(receipt())
    assert plain.disputes is None and "disputes" not in json.loads(plain.to_json())
    dispute = Dispute(micro_batch=MB, replies=(reply(A), reply(B)))
    held = Receipt.from_obj(receipt(disputes=[dispute.to_obj()]))
    assert held.disputes == (dispute,) and Receipt.from_json(held.to_json()) == held
    with pytest.raises(Refused, match="once"):
        Receipt.from_obj(receipt(disputes=[dispute.to_obj()] * 2))
    with pytest.raises(Refused, match="at most"):
        Receipt.from_obj(receipt(disputes=[dispute.to_obj()] * (MAX_DISPUTES + 1)))
    later = Dispute(micro_batch=MB, replies=(reply(A, stage=2), reply(B, stage=2)))
    with pytest.raises(Refused, match="stage 1"):
        Receipt.from_obj(receipt(disputes=[later.to_obj()]))
