"""A stage's vocabulary schedule: when the publisher grows the tokenizer, the verifier names the
vocabulary the stage's embedding or head grows to and the round it does so from (verifier.vocab),
served in the stage's member list (MemberList.vocab_size, vocab_from_round). 0, 0: the network
definition's vocabulary, never grown.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("stage_epochs") as batch:
        batch.add_column(sa.Column("vocab_size", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("vocab_from_round", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("stage_epochs") as batch:
        batch.drop_column("vocab_from_round")
        batch.drop_column("vocab_size")
