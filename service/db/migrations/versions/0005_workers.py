"""Celery mode: the workers' own records (``workers``): each worker's last sign of life, what
it holds and since when it holds nothing, so that a step a dead worker had received but not
started is sent again after the lease, not after the broker's visibility timeout.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("idle_since", sa.DateTime(), nullable=True),
        sa.Column("held", sa.JSON(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("workers")
