"""Indexes for the reads that look for the latest rounds.

`max(receipts.round)` and the latest round's reported loss (the headline of
/api/training/verify), and the newest (stage, round)s of /api/training/history, scanned every
receipt and every hash vote: 90 ms and 120 ms at 1,000 wallets x 200 rounds on PostgreSQL,
6 ms and 25 ms with these indexes (measured on bench_verifier's bulk seed, issue 15).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_receipts_round", "receipts", ["round"])
    op.create_index("ix_hash_votes_round_stage", "hash_votes", ["round", "stage"])


def downgrade() -> None:
    op.drop_index("ix_hash_votes_round_stage", table_name="hash_votes")
    op.drop_index("ix_receipts_round", table_name="receipts")
