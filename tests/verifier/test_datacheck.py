"""Live data checks on receipts: spans must follow the wallet's shard order (held-out shard
excluded) and cover its inner steps exactly; a liar loses reputation (SQLite and PostgreSQL)."""

import time

from conftest import PublishedData
from sqlalchemy import select

from neuroshard.data import assign_shards
from neuroshard.node.wallet import Wallet
from neuroshard.testing.verifier import small_network
from neuroshard.verifier import models as m
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.datacheck import DataCheckConfig, DataChecker
from neuroshard.verifier.db import Database
from neuroshard.verifier.network import NetworkDefinition
from neuroshard.verifier.sampling import sampled

HONEST, LIAR = Wallet.from_token("datacheck-honest"), Wallet.from_token("datacheck-liar")
OPERATOR = Wallet.from_token("datacheck-operator")
STEPS, BATCH = 4, 2


def _network(published: PublishedData) -> NetworkDefinition:
    return small_network(
        data={"manifest_url": str(published.directory), "publisher_key": published.public_key_hex},
        training={"batch_size": BATCH, "seq_len": 32},
        evaluation={"held_out_shard": 0},
    )


def _receipt(wallet: Wallet, round_: int, spans: list[list[int]]) -> m.Receipt:
    return m.Receipt(wallet_id=wallet.wallet_id, stage=0, round=round_, inner_steps=STEPS, start_step=0,
                     tokens=1, shard_id=spans[0][0], offset_start=spans[0][1], offset_end=spans[0][2],
                     data_spans=spans, losses=[], base_hash="0" * 64, result_hash="1" * 64,
                     delta_digest="2" * 64, accepted=[], rejected=[], equivocators=[], body_sha256=f"{round_:064x}",
                     received_at=time.time())  # fmt: skip


def test_receipts_that_misstate_their_data_are_caught(database_url: str, published: PublishedData) -> None:
    db = Database(database_url)
    now = time.time()
    with db.write() as s:
        for w in (HONEST, LIAR):
            s.add(m.Wallet(wallet_id=w.wallet_id, public_key=w.public_key_hex, reputation=0.8,
                           status=m.STATUS_ACTIVE, registered_at=now, software_version="0.1.0"))  # fmt: skip
    manifest = published.dataset.manifest
    honest = assign_shards(HONEST.wallet_id, manifest, exclude={0})
    liar = assign_shards(LIAR.wallet_id, manifest, exclude={0})
    lines: list[str] = []
    checker = DataChecker(
        JobContext(db=db, network=_network(published), operator=OPERATOR, log=lines.append),
        config=DataCheckConfig(sample_rate=1.0),
    )
    checker.run_once()  # starts at the newest receipt: none yet
    with db.write() as s:
        # Honest: 4 steps of 2 windows, rotating in order from its first shard to its second.
        s.add(_receipt(HONEST, 0, [[honest[0], 0, 4], [honest[1], 0, 4]]))
        s.add(_receipt(LIAR, 0, [[0, 0, 8]]))  # the held-out shard
        s.add(_receipt(LIAR, 1, [[liar[0], 0, 4], [liar[2], 0, 4]]))  # skips ahead in its order
        s.add(_receipt(LIAR, 2, [[liar[0], 0, 6]]))  # 3 batches for 4 steps
    checker.run_once()
    assert (checker.checked, checker.failed) == (4, 3), lines
    with db.read() as s:
        events = {(e.wallet_id, e.round): e.reason for e in s.scalars(select(m.ReputationEvent))}
        honest_row, liar_row = s.get(m.Wallet, HONEST.wallet_id), s.get(m.Wallet, LIAR.wallet_id)
        assert honest_row is not None and liar_row is not None
        assert honest_row.reputation == 0.8 and honest_row.status == m.STATUS_ACTIVE
        assert liar_row.reputation == 0.0 and liar_row.status == m.STATUS_REFUSED
    assert "passed" in events[(HONEST.wallet_id, 0)]
    assert "held-out shard 0" in events[(LIAR.wallet_id, 0)]
    assert f"expected {liar[1]}" in events[(LIAR.wallet_id, 1)]
    assert "spans hold 6 windows" in events[(LIAR.wallet_id, 2)]
    checker.run_once()  # nothing new: nothing judged twice
    assert checker.checked == 4
    db.dispose()


def test_sampling_is_a_fixed_share_only_the_operator_can_predict() -> None:
    def picks(operator: Wallet, check: str = "data", rate: float = 0.25) -> list[bool]:
        return [sampled(operator, check, "w", 0, r, rate) for r in range(2000)]

    ours = picks(OPERATOR)
    assert 0.22 < sum(ours) / len(ours) < 0.28
    assert ours == picks(OPERATOR)  # the same after a restart (Ed25519 signatures are deterministic)
    # Anyone without the operator's key (the replica itself) guesses no better than chance, and the
    # data and replay checks pick independently.
    for other in (picks(Wallet.from_token("not-the-operator")), picks(OPERATOR, "replay")):
        agree = sum(a == b for a, b in zip(ours, other, strict=True)) / len(ours)
        assert 0.58 < agree < 0.67  # 0.25² + 0.75² = 0.625 for independent picks
    assert not any(picks(OPERATOR, rate=0.0)) and all(picks(OPERATOR, rate=1.0))
