"""How a job's upload directory is laid out: the server writes it (``server.intake``), the job
process reads it (``worker.job_process``).

Each file is stored under its form field's name, and a Hugging Face model's files (uploaded as
one .zip) are extracted into their own directory. The format of the model is the upload checks'
finding, recorded with the job, never a suffix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from converters.source import ModelFormat, ModelSource

FILE_FIELDS = ("model", "config", "calib", "eval")
HF_DIRECTORY = "model.hf"


def stored_model(upload_dir: Path, format: ModelFormat, label: str) -> ModelSource:
    """The checked model of a job, in the format its checks found, named after the file the
    user uploaded (``label``)."""
    path = upload_dir / (HF_DIRECTORY if format == "hf" else "model")
    return ModelSource(path, format, name=Path(label).stem or None)


def stored_file(
    upload_dir: Path, field: Literal["config", "calib", "eval"], label: str | None
) -> Path | None:
    """A job's uploaded config or data file, stored under its field's name; None when the user
    uploaded none (no ``label``)."""
    return upload_dir / field if label else None
