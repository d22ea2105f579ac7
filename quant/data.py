"""Calibration and evaluation data: a user's ``.npz`` or a checkpoint's own split, checked.

A ``.npz`` holds ``inputs`` (the model's input, batch first) and optionally ``labels`` (int class
ids). It is read with ``allow_pickle=False``: an object array (a pickle) is refused, never loaded.
Every problem is a :class:`DataFileError` whose one line says what was wrong and what to do.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataFileError

MIN_CALIBRATION_SAMPLES = 16
MIN_EVALUATION_SAMPLES = 100
CALIBRATION_SAMPLES = 256  # drawn from a checkpoint's training split (seeded)
CALIBRATION_SEED = 0


@dataclass(frozen=True)
class InputSpec:
    """What the model takes: the shape of one sample (no batch axis) and a numpy dtype name."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def is_integer(self) -> bool:
        return np.issubdtype(np.dtype(self.dtype), np.integer)


@dataclass(frozen=True)
class Samples:
    """Model inputs (batch first) and optional labels; where they came from, for the report."""

    inputs: np.ndarray
    labels: np.ndarray | None
    source: str

    def __len__(self) -> int:
        return len(self.inputs)

    def head(self, count: int) -> Samples:
        labels = None if self.labels is None else self.labels[:count]
        return Samples(self.inputs[:count], labels, self.source)


def load_npz(path: str | Path, spec: InputSpec, *, purpose: str, minimum: int) -> Samples:
    """Read and check ``inputs`` (+ ``labels``) for a model taking ``spec`` samples."""
    path = Path(path)
    where = f"{purpose} data {path.name}"
    try:
        archive = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise DataFileError(f"{where}: no such file") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as error:
        # numpy takes anything that is neither .npy nor a zip for a pickle: say so only if it is
        if "pickle" in str(error).lower() and _starts_like_a_pickle(path):
            raise DataFileError(
                f"{where}: holds a pickled object, which is never loaded; save plain numeric "
                "arrays with numpy.savez"
            ) from None
        raise DataFileError(
            f"{where}: not a readable .npz archive ({error}); write one with "
            "numpy.savez(path, inputs=..., labels=...)"
        ) from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataFileError(f"{where}: a single .npy array, not an .npz archive with 'inputs'")
    with archive:
        if "inputs" not in archive.files:
            raise DataFileError(
                f"{where}: no 'inputs' array (found: {', '.join(archive.files) or 'none'})"
            )
        inputs = _read(archive, "inputs", where)
        labels = _read(archive, "labels", where) if "labels" in archive.files else None
    return check_samples(Samples(inputs, labels, str(path)), spec, where=where, minimum=minimum)


def _starts_like_a_pickle(path: Path) -> bool:
    with path.open("rb") as stream:
        return stream.read(1) == b"\x80"  # PROTO: how every pickle since protocol 2 opens


def _read(archive: np.lib.npyio.NpzFile, key: str, where: str) -> np.ndarray:
    try:
        return archive[key]
    except ValueError as error:  # object arrays need allow_pickle, which stays off
        if "pickle" in str(error).lower():
            raise DataFileError(
                f"{where}: '{key}' is a pickled object array, which is never loaded; save "
                "plain numeric arrays"
            ) from None
        raise DataFileError(f"{where}: '{key}' cannot be read ({error})") from None


def check_samples(samples: Samples, spec: InputSpec, *, where: str, minimum: int) -> Samples:
    """Shape, dtype, count and finiteness against what the model takes; converts losslessly."""
    inputs, labels = samples.inputs, samples.labels
    if inputs.dtype.kind not in "biuf":
        raise DataFileError(f"{where}: 'inputs' has dtype {inputs.dtype}, expected numbers")
    if tuple(inputs.shape[1:]) != spec.shape:
        raise DataFileError(
            f"{where}: 'inputs' has shape {tuple(inputs.shape)}, the model takes "
            f"(N, {', '.join(map(str, spec.shape))})"
        )
    if len(inputs) < minimum:
        raise DataFileError(f"{where}: {len(inputs)} samples, at least {minimum} needed")
    if spec.is_integer:
        if inputs.dtype.kind == "f" and not np.array_equal(inputs, np.round(inputs)):
            raise DataFileError(f"{where}: 'inputs' must be integer token ids, got fractions")
        inputs = inputs.astype(spec.dtype)
    else:
        inputs = inputs.astype(spec.dtype)
        if not np.isfinite(inputs).all():
            bad = int((~np.isfinite(inputs)).sum())
            raise DataFileError(f"{where}: 'inputs' has {bad} NaN/Inf values")
    if labels is not None:
        if labels.dtype.kind not in "iu" or labels.ndim != 1:
            raise DataFileError(
                f"{where}: 'labels' must be a 1-D integer array of class ids, got "
                f"{labels.dtype} with shape {tuple(labels.shape)}"
            )
        if len(labels) != len(inputs):
            raise DataFileError(
                f"{where}: {len(labels)} labels for {len(inputs)} inputs; they must match"
            )
        labels = labels.astype(np.int64)
    return Samples(np.ascontiguousarray(inputs), labels, samples.source)


def checkpoint_samples(info: object, part: str, count: int | None = None) -> Samples:
    """Samples of the split an edge_un checkpoint was trained on: ``"train"`` for calibration
    (a seeded random ``count`` of them), ``"test"`` for evaluation (all of it)."""
    from edge_un import data as edge_data  # the data wheels are only needed on this path

    inputs, labels = edge_data.checkpoint_split(info, part)
    x, y = inputs.numpy(), labels.numpy().astype(np.int64)
    if count is not None and count < len(x):
        rows = np.random.default_rng(CALIBRATION_SEED).permutation(len(x))[:count]
        x, y = x[rows], y[rows]
    return Samples(np.ascontiguousarray(x), y, f"checkpoint {part} split")
