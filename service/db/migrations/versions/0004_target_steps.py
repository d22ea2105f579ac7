"""Celery mode: a job's targets built on any workers. Each target of a run gets a record of its
own (``job_targets``: claimed, beaten and ended like a job), and a running job says which step
of its run it is at (``phase``) and the most runs one of its targets took (``target_attempts``).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("phase", sa.String(16), nullable=True))
        batch.add_column(
            sa.Column("target_attempts", sa.Integer(), nullable=False, server_default="0")
        )
    op.create_table(
        "job_targets",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("run", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("stage", sa.String(200), nullable=True),
        sa.Column("stage_detail", sa.String(200), nullable=True),
        sa.Column("fraction", sa.Float(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=True),
        sa.Column("dispatched_at", sa.DateTime(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("job_id", "run", "name", name="uq_job_targets_job_run_name"),
    )
    op.create_index("ix_job_targets_state", "job_targets", ["state"])


def downgrade() -> None:
    op.drop_index("ix_job_targets_state", table_name="job_targets")
    op.drop_table("job_targets")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("target_attempts")
        batch.drop_column("phase")
