"""The stages' vocabulary schedule (verifier.vocab), on each database backend: the head (last stage)
grows first, the embedding (stage 0) only once the last stage reported a round at the grown head,
middle stages never; a schedule is a new epoch of the stage's member list, which carries it; a
vocabulary only grows; the background job reads the manifest and survives one that does not load."""

import hashlib
import time
from dataclasses import replace

import pytest
from conftest import PublishedData
from sqlalchemy import select, text

from neuroshard.data import Manifest
from neuroshard.data.manifest import ManifestError, TokenizerInfo
from neuroshard.node.vocab import vocab_cap
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.roster import MAX_VOCAB, MemberList
from neuroshard.testing.verifier import small_network
from neuroshard.verifier import members
from neuroshard.verifier import models as m
from neuroshard.verifier.background import JobContext
from neuroshard.verifier.db import Database
from neuroshard.verifier.members import MembershipConfig
from neuroshard.verifier.network import NetworkDefinition
from neuroshard.verifier.vocab import VocabWatch, VocabWatchConfig, schedule_growth

NOW = 1_700_000_000.0
NETWORK_VOCAB = 512
CFG = MembershipConfig(lead_rounds=2)
OPERATOR = Wallet.from_token("vocab-operator")
REPLICA = Wallet.from_token("vocab-replica")


def add_wallet(db: Database, wallet: Wallet) -> None:
    with db.write() as s:
        if s.get(m.Wallet, wallet.wallet_id) is None:
            s.add(m.Wallet(wallet_id=wallet.wallet_id, public_key=wallet.public_key_hex, reputation=1.0,
                           registered_at=NOW, software_version="x"))  # fmt: skip


def report(db: Database, stage: int, round_: int, wallet: Wallet = REPLICA) -> None:
    """A receipt of `round_` from a replica of `stage` (all the schedule reads of receipts)."""
    add_wallet(db, wallet)
    with db.write() as s:
        s.add(m.Receipt(wallet_id=wallet.wallet_id, stage=stage, round=round_, inner_steps=4, start_step=0,
                        tokens=1, shard_id=None, offset_start=None, offset_end=None, data_spans=[], losses=[],
                        base_hash="0" * 64, result_hash="1" * 64, delta_digest="2" * 64, accepted=[],
                        rejected=[], equivocators=[], body_sha256=hashlib.sha256(f"{wallet.wallet_id}/{stage}/{round_}".encode()).hexdigest(), received_at=NOW))  # fmt: skip


def grow(db: Database, num_stages: int, target: int) -> str | None:
    with db.write() as s:
        return schedule_growth(
            s, num_stages=num_stages, network_vocab=NETWORK_VOCAB, target_vocab=target, cfg=CFG, now=NOW
        )


def listed(db: Database, stage: int) -> MemberList:
    with db.read() as s:
        doc = members.member_list(s, stage, CFG, network="vocab-test", signer=OPERATOR, now=NOW)
    parsed = MemberList.from_json(doc.to_json())
    parsed.verify(OPERATOR.public_key_hex, network="vocab-test", now=NOW)
    return parsed


def schedule(db: Database, stage: int) -> tuple[int, int]:
    """The listed (vocab_size, vocab_from_round); (0, 0) for a list that names no growth."""
    doc = listed(db, stage)
    return doc.vocab_size or 0, doc.vocab_from_round or 0


def test_one_stage_grows_in_one_step_from_a_later_round(db: Database) -> None:
    """Stage 0 is the head too: no wait. The stage had no epoch row yet (receipts alone make none)."""
    before = listed(db, 0)
    assert (before.epoch, before.vocab_size, before.vocab_from_round) == (0, None, None)
    report(db, 0, 5)
    line = grow(db, 1, 600)
    assert line is not None and "stage 0" in line and "600" in line and "round 7" in line
    after = listed(db, 0)
    assert (after.vocab_size, after.vocab_from_round) == (600, 5 + CFG.lead_rounds)
    # no round settled here: the list's own round is capped at members.REPORT_SLACK, so it takes
    # effect no later than the growth
    assert after.newer_than(before) and after.effective_round <= after.vocab_from_round
    assert grow(db, 1, 600) is None, "the same target again changes nothing"
    assert listed(db, 0).epoch == after.epoch


def test_a_vocabulary_only_grows(db: Database) -> None:
    assert grow(db, 1, NETWORK_VOCAB) is None and grow(db, 1, NETWORK_VOCAB - 100) is None
    assert listed(db, 0).epoch == 0, "nothing scheduled, no new list"
    grow(db, 1, 700)
    held = listed(db, 0)
    assert grow(db, 1, 600) is None
    assert listed(db, 0) == held
    with pytest.raises(ValueError, match="may grow to"):  # past what the checks accept (vocab_cap)
        grow(db, 1, vocab_cap(NETWORK_VOCAB) + 1)
    with pytest.raises(ValueError, match="may grow to"):
        grow(db, 1, MAX_VOCAB + 1)


def test_the_head_grows_before_the_embedding(db: Database) -> None:
    with db.write() as s:  # both stages already have an epoch (registrations)
        members.bump_epoch(s, 0, now=NOW)
        members.bump_epoch(s, 1, now=NOW)
    report(db, 0, 3)
    report(db, 1, 10)
    line = grow(db, 2, 600)
    assert line is not None and "stage 1 (head)" in line
    assert schedule(db, 1) == (600, 12) and listed(db, 1).epoch == 2
    assert schedule(db, 0) == (0, 0) and listed(db, 0).epoch == 1
    report(db, 1, 11)
    assert grow(db, 2, 600) is None, "the head has not trained a round at 600 ids yet"
    assert schedule(db, 0) == (0, 0)
    report(db, 1, 12)
    line = grow(db, 2, 600)
    assert line is not None and "stage 0 (embedding)" in line
    assert schedule(db, 0) == (600, 3 + CFG.lead_rounds) and listed(db, 0).epoch == 2
    assert schedule(db, 1) == (600, 12), "the head's schedule stays"
    assert grow(db, 2, 600) is None


def test_a_newer_target_regrows_the_head_and_the_embedding_waits_for_it(db: Database) -> None:
    report(db, 1, 0)
    grow(db, 2, 600)  # head: 600 from round 2
    report(db, 1, 2)
    grow(db, 2, 600)  # embedding: 600
    report(db, 1, 4)
    assert grow(db, 2, 800) is not None
    assert schedule(db, 1) == (800, 6) and schedule(db, 0)[0] == 600
    report(db, 1, 5)
    assert grow(db, 2, 800) is None and schedule(db, 0)[0] == 600
    report(db, 1, 6)
    assert grow(db, 2, 800) is None, "stage 0 has not reached its first growth (round 2) yet"
    report(db, 0, 2)
    assert grow(db, 2, 800) is not None and schedule(db, 0) == (800, 2 + CFG.lead_rounds)


def test_one_far_off_receipt_moves_no_schedule(db: Database) -> None:
    """The stage's round leaves out the top third of its wallets' newest rounds: a wallet that claims
    a far-off round neither puts the head's growth out of reach nor lets the embedding go first,
    and a replica that lags does not put the growth round in the past of the others."""
    others = [Wallet.from_token(f"vocab-honest-{i}") for i in range(3)]
    liar = Wallet.from_token("vocab-liar")
    for wallet in [*others, liar]:
        add_wallet(db, wallet)
    for wallet, round_ in zip(others, (1, 4, 4), strict=True):  # one lags (or left)
        report(db, 1, round_, wallet)
    report(db, 1, 10**9, liar)
    assert grow(db, 2, 600) is not None and schedule(db, 1) == (600, 4 + CFG.lead_rounds)
    assert grow(db, 2, 600) is None, "the honest replicas have not reached round 6: the embedding waits"
    assert schedule(db, 0) == (0, 0)


def test_middle_stages_are_never_scheduled(db: Database) -> None:
    for stage in range(3):
        report(db, stage, 4)
    grow(db, 3, 600)
    report(db, 2, 6)
    grow(db, 3, 600)
    assert grow(db, 3, 600) is None
    assert schedule(db, 2) == (600, 6) and schedule(db, 0) == (600, 6)
    middle = listed(db, 1)
    assert (middle.epoch, middle.vocab_size, middle.vocab_from_round) == (0, None, None)


def test_a_membership_change_keeps_the_schedule(db: Database) -> None:
    grow(db, 1, 600)
    with db.write() as s:
        members.bump_epoch(s, 0, now=NOW + 1)
    assert schedule(db, 0) == (600, CFG.lead_rounds)


# --- the background job -----------------------------------------------------------------------


def _manifest(next_merge_id: int) -> Manifest:
    tokenizer = TokenizerInfo(
        file=f"tokenizers/{'a' * 64}.json", sha256="a" * 64, next_merge_id=next_merge_id
    )
    return Manifest(
        version=1, created="2026-11-26T00:00:00Z", publisher="b" * 64, tokenizers=(tokenizer,), shards=()
    )


def _ctx(db: Database, lines: list[str], network: NetworkDefinition | None = None) -> JobContext:
    network = network or small_network(stages={"count": 2})
    return JobContext(db=db, network=network, operator=OPERATOR, log=lines.append, clock=lambda: NOW)


def test_the_job_schedules_from_the_manifest_and_survives_one_that_does_not_load(db: Database) -> None:
    lines: list[str] = []
    served: list[Manifest | Exception] = [ManifestError("manifest.sig does not verify"), _manifest(600)]

    def load() -> Manifest:
        got = served.pop(0) if len(served) > 1 else served[0]
        if isinstance(got, Exception):
            raise got
        return got

    job = VocabWatch(_ctx(db, lines), membership=CFG, manifest=load)
    job.run_once()
    assert lines == ["vocab watch: the manifest did not load: ManifestError: manifest.sig does not verify"]
    assert schedule(db, 1) == (0, 0)
    job.run_once()
    assert lines[1] == "vocab: stage 1 (head) grows from 512 to 600 ids from round 2"
    assert schedule(db, 1) == (600, 2)
    job.run_once()
    assert len(lines) == 2, "nothing new to schedule, nothing logged"


def test_the_job_reads_the_published_manifest(db: Database, published: PublishedData) -> None:
    """The default loader verifies the run's manifest against the publisher key (datacheck.load_manifest)."""
    target = published.dataset.manifest.tokenizer.next_merge_id
    network = small_network(
        model={"size": "tiny", "vocab_size": target - 10},
        data={"manifest_url": str(published.directory), "publisher_key": published.public_key_hex},
    )
    lines: list[str] = []
    VocabWatch(_ctx(db, lines, network), membership=CFG).run_once()
    assert schedule(db, 0) == (target, CFG.lead_rounds), lines
    wrong_key = replace(network, publisher_key="cd" * 32)
    VocabWatch(_ctx(db, lines, wrong_key), membership=CFG).run_once()
    assert "did not load" in lines[-1]


def test_the_job_polls_on_its_own_thread_until_stopped(db: Database) -> None:
    lines: list[str] = []
    job = VocabWatch(
        _ctx(db, lines),
        membership=CFG,
        config=VocabWatchConfig(period_s=0.01),
        manifest=lambda: _manifest(600),
    )
    job.start()
    deadline = time.monotonic() + 10
    while schedule(db, 1) != (600, 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    job.stop()
    assert schedule(db, 1) == (600, 2), lines
    with pytest.raises(ValueError, match="period_s"):
        VocabWatchConfig(period_s=0)


# --- the migration ----------------------------------------------------------------------------


def test_the_0011_upgrade_keeps_epochs_and_grows_nothing(db: Database) -> None:
    from alembic import command

    from neuroshard.verifier.db import alembic_config

    with db.engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0010")
    with db.engine.begin() as conn:
        conn.execute(  # the 0010 table: the model's new columns are not there yet
            text("INSERT INTO stage_epochs (stage, epoch, changed_at, changed_round) VALUES (1, 7, :t, 30)"),
            {"t": NOW},
        )
    db.upgrade()
    with db.read() as s:
        row = s.execute(select(m.StageEpoch).where(m.StageEpoch.stage == 1)).scalar_one()
        # 0013 moves every epoch on once (the probation lists' ranking changed) and caps the round
        # at members.REPORT_SLACK past the settled ones (none here)
        assert (row.epoch, row.changed_round, row.vocab_size, row.vocab_from_round) == (8, 4, 0, 0)
