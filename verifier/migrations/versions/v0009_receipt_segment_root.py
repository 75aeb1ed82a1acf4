"""Receipts commit to the root of the replica's segment log (issue 17): the segment spot check
(verifier.replaycheck, verifier.segmentcheck) holds the replica to it at every stage. Existing
receipts keep NULL: their nodes kept no segment log.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("receipts") as batch:
        batch.add_column(sa.Column("segment_root", sa.String(64), nullable=True))
        batch.add_column(sa.Column("segments", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("receipts") as batch:
        batch.drop_column("segments")
        batch.drop_column("segment_root")
