"""Initial schema: tokens, jobs, job_stages.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("secret_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
    )
    op.create_table(
        "jobs",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(32), nullable=False, unique=True),
        sa.Column(
            "token_id",
            sa.Integer(),
            sa.ForeignKey("tokens.id", ondelete="SET NULL"),
            nullable=True,
        ),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("stage", sa.String(200), nullable=True),
        sa.Column("percent", sa.Float(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("targets", sa.String(200), nullable=False),
        sa.Column("max_drift", sa.Float(), nullable=False),
        sa.Column("model_format", sa.String(16), nullable=False),
        sa.Column("model_label", sa.String(255), nullable=False),
        sa.Column("config_label", sa.String(255), nullable=True),
        sa.Column("calib_label", sa.String(255), nullable=True),
        sa.Column("eval_label", sa.String(255), nullable=True),
        sa.Column("upload_bytes", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_jobs_state_seq", "jobs", ["state", "seq"])
    op.create_index("ix_jobs_token_seq", "jobs", ["token_id", "seq"])
    op.create_table(
        "job_stages",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("stage", sa.String(64), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
    )
    op.create_index("ix_job_stages_job_id", "job_stages", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_job_stages_job_id", "job_stages")
    op.drop_table("job_stages")
    op.drop_index("ix_jobs_token_seq", "jobs")
    op.drop_index("ix_jobs_state_seq", "jobs")
    op.drop_table("jobs")
    op.drop_table("tokens")
