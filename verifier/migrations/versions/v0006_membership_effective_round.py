"""The round a stage's membership epoch takes effect from (issue 19): each epoch records the newest
round the stage had reported when it changed, so every replica switches member lists at the same
round (MemberList.effective_round) instead of whenever it happens to read the new list.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("stage_epochs") as batch:
        batch.add_column(sa.Column("changed_round", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("stage_epochs") as batch:
        batch.drop_column("changed_round")
