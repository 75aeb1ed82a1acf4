"""Fraud proofs of two kinds (issue 17): a segment whose replay failed, and a sender whose signed
round log contradicts a header it signed (verifier.segmentcheck.SenderFraudProof). Rows kept
before are segment proofs.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fraud_proofs") as batch:
        batch.add_column(sa.Column("kind", sa.String(16), nullable=False, server_default="segment"))


def downgrade() -> None:
    with op.batch_alter_table("fraud_proofs") as batch:
        batch.drop_column("kind")
