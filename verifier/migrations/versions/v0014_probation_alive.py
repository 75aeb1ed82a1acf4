"""Probationers alive at a turn's start (verifier.members.next_turn): for each membership, the last
turn at whose start its replica of the stage had sent a recent heartbeat; in that turn it goes
ahead of the idle probationers. Nobody is marked until the next turn starts (or the turn's clock
restarts when nobody waits off the list, which reorders no names), so the lists' order and names
are unchanged by this upgrade and no epoch moves.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("memberships") as batch:
        batch.add_column(sa.Column("alive_turn", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("memberships") as batch:
        batch.drop_column("alive_turn")
