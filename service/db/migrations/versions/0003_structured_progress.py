"""Typed job fields: the targets as a JSON list of names (was a comma-separated string), and
progress as it comes from the pipeline: the stage's name, the target it works for and its
detail in columns of their own (``stage`` held the three as one line).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

jobs = sa.table(
    "jobs",
    sa.column("seq", sa.Integer()),
    sa.column("targets", sa.String()),
    sa.column("target_names", sa.JSON()),
)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("target", sa.String(32), nullable=True))
        batch.add_column(sa.Column("stage_detail", sa.String(200), nullable=True))
        batch.add_column(sa.Column("target_names", sa.JSON(), nullable=True))
    connection = op.get_bind()
    for seq, text in connection.execute(sa.select(jobs.c.seq, jobs.c.targets)).all():
        names = [name.strip() for name in (text or "").split(",") if name.strip()]
        connection.execute(jobs.update().where(jobs.c.seq == seq).values(target_names=names))
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("targets")
        batch.alter_column(
            "target_names", new_column_name="targets", existing_type=sa.JSON(), nullable=False
        )


def downgrade() -> None:
    old = sa.table("jobs", sa.column("seq", sa.Integer()), sa.column("target_list", sa.String()))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("target_list", sa.String(200), nullable=True))
    connection = op.get_bind()
    rows = connection.execute(sa.text("SELECT seq, targets FROM jobs")).all()
    for seq, names in rows:
        names = json.loads(names) if isinstance(names, str) else names
        connection.execute(
            old.update().where(old.c.seq == seq).values(target_list=",".join(names or []))
        )
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("targets")
        batch.alter_column(
            "target_list", new_column_name="targets", existing_type=sa.String(200), nullable=False
        )
        batch.drop_column("stage_detail")
        batch.drop_column("target")
