"""Initial schema: wallets, peers, receipts, nonces, evaluations, hash votes, rounds, reputation events.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "wallets",
        sa.Column("wallet_id", sa.String(20), nullable=False),
        sa.Column("public_key", sa.String(64), nullable=False),
        sa.Column("reputation", sa.Double(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("registered_at", sa.Double(), nullable=False),
        sa.Column("software_version", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("wallet_id", name="pk_wallets"),
        sa.UniqueConstraint("public_key", name="uq_wallets_public_key"),
    )
    op.create_table(
        "peers",
        sa.Column("wallet_id", sa.String(20), nullable=False),
        sa.Column("address", sa.String(255), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("registered_at", sa.Double(), nullable=False),
        sa.Column("last_heartbeat", sa.Double(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=True),
        sa.Column("steps_in_round", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["wallet_id"], ["wallets.wallet_id"], name="fk_peers_wallet_id_wallets"),
        sa.PrimaryKeyConstraint("wallet_id", name="pk_peers"),
    )
    op.create_index("ix_peers_stage_heartbeat", "peers", ["stage", "last_heartbeat"])
    op.create_table(
        "receipts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("wallet_id", sa.String(20), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("inner_steps", sa.Integer(), nullable=False),
        sa.Column("start_step", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("shard_id", sa.Integer(), nullable=True),
        sa.Column("offset_start", sa.Integer(), nullable=True),
        sa.Column("offset_end", sa.Integer(), nullable=True),
        sa.Column("data_spans", sa.JSON(), nullable=False),
        sa.Column("losses", sa.JSON(), nullable=False),
        sa.Column("base_hash", sa.String(64), nullable=False),
        sa.Column("result_hash", sa.String(64), nullable=False),
        sa.Column("delta_digest", sa.String(64), nullable=False),
        sa.Column("accepted", sa.JSON(), nullable=False),
        sa.Column("rejected", sa.JSON(), nullable=False),
        sa.Column("equivocators", sa.JSON(), nullable=False),
        sa.Column("body_sha256", sa.String(64), nullable=False),
        sa.Column("received_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["wallet_id"], ["wallets.wallet_id"], name="fk_receipts_wallet_id_wallets"),
        sa.PrimaryKeyConstraint("id", name="pk_receipts"),
        sa.UniqueConstraint("wallet_id", "stage", "round", name="uq_receipts_wallet_stage_round"),
    )
    op.create_index("ix_receipts_stage_round", "receipts", ["stage", "round"])
    op.create_table(
        "nonces",
        sa.Column("public_key", sa.String(64), nullable=False),
        sa.Column("nonce", sa.String(64), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("public_key", "nonce", name="pk_nonces"),
    )
    op.create_index("ix_nonces_expires_at", "nonces", ["expires_at"])
    op.create_table(
        "evaluations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Double(), nullable=False),
        sa.Column("loss_stderr", sa.Double(), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_evaluations"),
    )
    op.create_index("ix_evaluations_round", "evaluations", ["round"])
    op.create_table(
        "hash_votes",
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("wallet_id", sa.String(20), nullable=False),
        sa.Column("result_hash", sa.String(64), nullable=False),
        sa.Column("base_hash", sa.String(64), nullable=False),
        sa.ForeignKeyConstraint(["wallet_id"], ["wallets.wallet_id"], name="fk_hash_votes_wallet_id_wallets"),
        sa.PrimaryKeyConstraint("stage", "round", "wallet_id", name="pk_hash_votes"),
    )
    op.create_table(
        "rounds",
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("majority_hash", sa.String(64), nullable=True),
        sa.Column("votes", sa.Integer(), nullable=False),
        sa.Column("agreeing", sa.Integer(), nullable=False),
        sa.Column("synced", sa.Integer(), nullable=False),
        sa.Column("sync_checked", sa.Integer(), nullable=False),
        sa.Column("settled_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("stage", "round", name="pk_rounds"),
    )
    op.create_table(
        "reputation_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("wallet_id", sa.String(20), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=True),
        sa.Column("round", sa.Integer(), nullable=True),
        sa.Column("delta", sa.Double(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["wallet_id"], ["wallets.wallet_id"], name="fk_reputation_events_wallet_id_wallets"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_reputation_events"),
    )
    op.create_index("ix_reputation_events_wallet_id", "reputation_events", ["wallet_id"])


def downgrade() -> None:
    for index, table in (
        ("ix_reputation_events_wallet_id", "reputation_events"),
        ("ix_evaluations_round", "evaluations"),
        ("ix_nonces_expires_at", "nonces"),
        ("ix_receipts_stage_round", "receipts"),
        ("ix_peers_stage_heartbeat", "peers"),
    ):
        op.drop_index(index, table_name=table)
    for table in (
        "reputation_events",
        "rounds",
        "hash_votes",
        "evaluations",
        "nonces",
        "receipts",
        "peers",
        "wallets",
    ):
        op.drop_table(table)
