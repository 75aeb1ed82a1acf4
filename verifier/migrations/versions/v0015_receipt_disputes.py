"""Receipts name the micro-batches whose audit found the next stage's answers apart
(protocol.reports.Dispute): the replay checker holds each replier to its own signed round log and
replays the segment that stepped on the micro-batch (verifier.replaycheck). Existing receipts keep
NULL: none was reported before.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("receipts") as batch:
        batch.add_column(sa.Column("disputes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("receipts") as batch:
        batch.drop_column("disputes")
