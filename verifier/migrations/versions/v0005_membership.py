"""Membership with a price (issue 19): each wallet's standing per stage, the stages' membership
epochs, and the operator's signed rosters.

Existing wallets with a peer entry become admitted members of their stage (they were counted
in every round before), so an upgraded verifier changes nobody's standing.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "memberships",
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("wallet_id", sa.String(20), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("streak", sa.Integer(), nullable=False),
        sa.Column("checks_passed", sa.Integer(), nullable=False),
        sa.Column("last_round", sa.Integer(), nullable=True),
        sa.Column("since", sa.Double(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["wallet_id"], ["wallets.wallet_id"], name="fk_memberships_wallet_id_wallets"
        ),
        sa.PrimaryKeyConstraint("stage", "wallet_id", name="pk_memberships"),
    )
    op.create_index("ix_memberships_stage_status", "memberships", ["stage", "status"])
    op.create_table(
        "stage_epochs",
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("changed_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("stage", name="pk_stage_epochs"),
    )
    op.create_table(
        "rosters",
        sa.Column("version", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        sa.Column("received_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("version", name="pk_rosters"),
    )
    now = time.time()
    op.execute(
        sa.text(
            "INSERT INTO memberships (stage, wallet_id, status, streak, checks_passed, last_round, since, reason) "
            "SELECT stage, wallet_id, 'admitted', 0, 0, NULL, :now, 'member before membership was tracked' "
            "FROM peers"
        ).bindparams(now=now)
    )


def downgrade() -> None:
    op.drop_table("rosters")
    op.drop_table("stage_epochs")
    op.drop_index("ix_memberships_stage_status", table_name="memberships")
    op.drop_table("memberships")
