"""Typed job fields: the targets as a JSON list of names (was a comma-separated string, "" for
every target), and progress as it comes from the pipeline: the stage's name, the target it
works for and its detail in columns of their own (``stage`` held the three as one line). The
uploads of jobs still to run move to the layout the job process now reads: each file under its
form field's name (they had the suffix of their format: ``model.onnx``, ``calib.npz``).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from alembic import context, op

from quant.targets import TARGET_NAMES

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

jobs = sa.table(
    "jobs",
    sa.column("seq", sa.Integer()),
    sa.column("id", sa.String()),
    sa.column("state", sa.String()),
    sa.column("model_format", sa.String()),
    sa.column("targets", sa.String()),
    sa.column("target_names", sa.JSON()),
)
# The uploads' names before this revision (``name.suffix``) and after it (``name``); a Hugging
# Face model's directory keeps its name.
SUFFIXES = {"config": "json", "calib": "npz", "eval": "npz"}


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("target", sa.String(32), nullable=True))
        batch.add_column(sa.Column("stage_detail", sa.String(200), nullable=True))
        batch.add_column(sa.Column("target_names", sa.JSON(), nullable=True))
    connection = op.get_bind()
    for seq, text in connection.execute(sa.select(jobs.c.seq, jobs.c.targets)).all():
        names = [name.strip() for name in (text or "").split(",") if name.strip()]
        names = names or list(TARGET_NAMES)  # "": every target
        connection.execute(jobs.update().where(jobs.c.seq == seq).values(target_names=names))
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("targets")
        batch.alter_column(
            "target_names", new_column_name="targets", existing_type=sa.JSON(), nullable=False
        )
    _rename_uploads(lambda name, fmt: (_suffixed(name, fmt), name))


def downgrade() -> None:
    _rename_uploads(lambda name, fmt: (name, _suffixed(name, fmt)))
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


def _suffixed(name: str, model_format: str) -> str:
    return f"model.{model_format}" if name == "model" else f"{name}.{SUFFIXES[name]}"


def _rename_uploads(names: Callable[[str, str], tuple[str, str]]) -> None:
    """Each upload of a job still to run (queued, or running: it runs again after a restart)
    from its old name to its new one, ``names(field, model_format) -> (old, new)``; nothing to
    do where the data directory is not known (a migration run by hand on the database)."""
    data_dir = context.config.attributes.get("data_dir")
    if data_dir is None:
        return
    waiting = sa.select(jobs.c.id, jobs.c.model_format).where(
        jobs.c.state.in_(("queued", "running"))
    )
    for job_id, model_format in op.get_bind().execute(waiting).all():
        folder = Path(data_dir) / "uploads" / job_id
        for field in ("model", *SUFFIXES):
            if field == "model" and model_format == "hf":
                continue  # its directory has the same name before and after
            old, new = names(field, model_format)
            if (folder / old).is_file() and not (folder / new).exists():
                (folder / old).rename(folder / new)
