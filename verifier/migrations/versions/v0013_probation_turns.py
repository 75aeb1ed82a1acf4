"""Turns of the listed probationers (verifier.members.next_turn): the stage's current turn, when
it started and the stage's round then, and for each membership the last turn that named it. Only
the housekeeping sweep's `next_turn` moves them, so other changes of the stage's membership (a
new epoch) keep the turn's names. The lists' ranking changes with this upgrade, so every stage's
epoch moves on (nodes read the new list). A stage's round is now capped at 4 rounds
(members.REPORT_SLACK) past its settled ones: its `changed_round` is capped so (a far-off receipt
may have set it out of reach before), and its first turn starts from it.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("stage_epochs") as batch:
        batch.add_column(sa.Column("turn", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("turn_started_at", sa.Double(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("turn_round", sa.BigInteger(), nullable=False, server_default="0"))
    with op.batch_alter_table("memberships") as batch:
        batch.add_column(sa.Column("last_named_turn", sa.BigInteger(), nullable=True))
    settled_next = "COALESCE((SELECT MAX(r.round) + 1 FROM rounds r WHERE r.stage = stage_epochs.stage), 0)"
    capped = f"CASE WHEN changed_round < {settled_next} + 4 THEN changed_round ELSE {settled_next} + 4 END"
    op.execute(f"UPDATE stage_epochs SET changed_round = {capped}, turn_round = {capped}, epoch = epoch + 1")


def downgrade() -> None:
    with op.batch_alter_table("memberships") as batch:
        batch.drop_column("last_named_turn")
    with op.batch_alter_table("stage_epochs") as batch:
        batch.drop_column("turn_round")
        batch.drop_column("turn_started_at")
        batch.drop_column("turn")
