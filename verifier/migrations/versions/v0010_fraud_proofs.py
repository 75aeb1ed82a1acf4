"""Segment fraud proofs are kept (issue 17): a failed segment is a proof a third party can check
alone, so it must outlive the verifier process and be downloadable. The bytes (tens of MB even for
the tiny model) go to files under HOME/fraud-proofs; this table names them and says whose they are
(verifier.fraudproofs, GET /api/fraud-proofs).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fraud_proofs",
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("wallet_id", sa.String(20), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(400), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("data_spans", sa.JSON(), nullable=False),
        sa.Column("device", sa.String(8), nullable=True),
        sa.Column("precision", sa.String(8), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["wallet_id"], ["wallets.wallet_id"], name="fk_fraud_proofs_wallet_id_wallets"
        ),
        sa.PrimaryKeyConstraint("sha256", name="pk_fraud_proofs"),
    )
    op.create_index("ix_fraud_proofs_wallet_id", "fraud_proofs", ["wallet_id"])
    op.create_index("ix_fraud_proofs_created_at", "fraud_proofs", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_fraud_proofs_created_at", table_name="fraud_proofs")
    op.drop_index("ix_fraud_proofs_wallet_id", table_name="fraud_proofs")
    op.drop_table("fraud_proofs")
