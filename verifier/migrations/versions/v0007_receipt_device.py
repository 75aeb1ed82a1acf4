"""Receipts state where and in what precision the inner steps ran (issue 14): the replay spot
check picks its acceptance from them (verifier.replaycheck.tolerance_for). Existing receipts
keep NULL: they came from CPU fp32 nodes.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("receipts") as batch:
        batch.add_column(sa.Column("device", sa.String(8), nullable=True))
        batch.add_column(sa.Column("precision", sa.String(8), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("receipts") as batch:
        batch.drop_column("precision")
        batch.drop_column("device")
