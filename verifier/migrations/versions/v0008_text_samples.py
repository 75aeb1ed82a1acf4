"""Text samples of the measured majority model (issue 14): the dashboard shows the latest one
beside the loss curve. The verifier writes one every few evaluations (verifier.evaluator).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "text_samples",
        sa.Column("round", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("max_new_tokens", sa.Integer(), nullable=False),
        sa.Column("temperature", sa.Double(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("round", name="pk_text_samples"),
    )


def downgrade() -> None:
    op.drop_table("text_samples")
