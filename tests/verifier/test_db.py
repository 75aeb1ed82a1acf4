import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import func, inspect, select

from neuroshard.verifier import models as m
from neuroshard.verifier.db import Database, DatabaseURLError, current_revision, head_revision, normalise_url


def test_upgrade_head_on_an_empty_database_creates_every_table(empty_database_url: str) -> None:
    db = Database(empty_database_url)
    try:
        assert current_revision(db.engine) is None
        db.upgrade()
        assert current_revision(db.engine) == head_revision()
        tables = set(inspect(db.engine).get_table_names())
        assert set(m.Base.metadata.tables) <= tables
        assert "alembic_version" in tables
    finally:
        db.dispose()


def test_the_migrations_build_exactly_the_models(db: Database) -> None:
    with db.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, m.Base.metadata) == []


def test_second_upgrade_is_a_no_op_and_keeps_data(db: Database) -> None:
    with db.write() as s:
        s.add(m.Evaluation(round=1, loss=5.0, tokens=10, created_at=1.0))
    db.upgrade()
    assert current_revision(db.engine) == head_revision()
    with db.read() as s:
        assert s.scalar(select(func.count()).select_from(m.Evaluation)) == 1


def test_a_failed_write_leaves_nothing(db: Database) -> None:
    with pytest.raises(RuntimeError), db.write() as s:
        s.add(m.Evaluation(round=1, loss=5.0, tokens=10, created_at=1.0))
        s.flush()
        raise RuntimeError("boom")
    with db.read() as s:
        assert s.scalar(select(func.count()).select_from(m.Evaluation)) == 0


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://127.0.0.1:5432/test", "postgresql+psycopg://127.0.0.1:5432/test"),
        ("postgres://u:p@h/db", "postgresql+psycopg://u:p@h/db"),
        ("postgresql+psycopg://h/db", "postgresql+psycopg://h/db"),
        ("sqlite:////var/lib/v.db", "sqlite:////var/lib/v.db"),
    ],
)
def test_url_normalisation(given: str, expected: str) -> None:
    assert normalise_url(given) == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("just-a-path.db", "is not a URL"),
        ("mysql://h/db", "only sqlite and postgresql"),
        ("sqlite://", "needs a file"),
        ("sqlite:///:memory:", "needs a file"),
        ("postgresql+psycopg2://h/db", "psycopg 3"),
    ],
)
def test_bad_urls_are_named(given: str, message: str) -> None:
    with pytest.raises(DatabaseURLError, match=message):
        normalise_url(given)


def test_receipt_sums_are_backfilled_by_the_0003_upgrade(db: Database) -> None:
    """Receipts stored before revision 0003 get loss and contribution counts from their JSON."""
    from alembic import command

    from neuroshard.verifier.db import alembic_config

    with db.write() as s:
        s.add(
            m.Wallet(
                wallet_id="a" * 20,
                public_key="b" * 64,
                reputation=1.0,
                registered_at=0.0,
                software_version="x",
            )
        )
    with db.write() as s:
        for r in range(3):
            s.add(
                m.Receipt(
                    wallet_id="a" * 20, stage=0, round=r, inner_steps=2, start_step=0, tokens=1,
                    shard_id=None, offset_start=None, offset_end=None, data_spans=[],
                    losses=[1.5, 2.5 + r], base_hash="0" * 64, result_hash="1" * 64, delta_digest="2" * 64,
                    accepted=[{"wallet": "c" * 20}] * r, rejected=[{"wallet": "d" * 20, "reason": "x"}],
                    equivocators=[], body_sha256=f"{r:064x}", received_at=0.0,
                )
            )  # fmt: skip
    with db.engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0002")
    db.upgrade()
    with db.read() as s:
        rows = s.execute(
            select(
                m.Receipt.loss_sum, m.Receipt.loss_count, m.Receipt.accepted_count, m.Receipt.rejected_count
            ).order_by(m.Receipt.round)
        ).all()
    assert [tuple(row) for row in rows] == [(4.0 + r, 2, r, 1) for r in range(3)]


def test_fraud_proofs_kept_before_0012_are_segment_proofs(db: Database) -> None:
    """Rows from before proofs had a kind come back from the 0012 upgrade as segment proofs."""
    from alembic import command

    from neuroshard.verifier.db import alembic_config

    with db.write() as s:
        s.add(m.Wallet(wallet_id="a" * 20, public_key="b" * 64, reputation=1.0, registered_at=0.0,
                       software_version="x"))  # fmt: skip
    with db.write() as s:
        s.add(
            m.FraudProof(
                sha256="e" * 64, wallet_id="a" * 20, stage=1, round=3, segment=2, kind="sender",
                reason="r", size_bytes=10, data_spans=[], created_at=0.0,
            )
        )  # fmt: skip
    with db.engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0011")
        assert "kind" not in {c["name"] for c in inspect(conn).get_columns("fraud_proofs")}
    db.upgrade()
    with db.read() as s:
        assert s.scalars(select(m.FraudProof.kind)).all() == ["segment"]
