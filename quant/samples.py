"""Calibration and evaluation data: a user's ``.npz`` or a checkpoint's own split, checked.

A model takes one or more named inputs (``pixel_values``; ``input_ids`` and ``attention_mask``).
An ``.npz`` holds one array per input, named as the model names it, batch first, plus optional
``labels`` (int class ids); for a model with one input the array may also be called ``inputs``.
It is read with ``allow_pickle=False``: an object array (a pickle) is refused, never loaded.
Every problem is a :class:`DataFileError` whose one line says what was wrong and what to do.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataFileError

MIN_CALIBRATION_SAMPLES = 16
MIN_EVALUATION_SAMPLES = 100
CALIBRATION_SAMPLES = 256  # drawn from a checkpoint's training split (seeded)
CALIBRATION_SEED = 0
SINGLE_INPUT_NAME = "inputs"  # what a one-input model's array may be called in an .npz
LABELS_NAME = "labels"
# Hugging Face text models' inputs, made from token ids when a checkpoint's data set is used
HF_TEXT_INPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids"})
PAD_ID = 0  # edge_un.data's padding id, the one its text data sets use

Feeds = dict[str, np.ndarray]  # one batch-first array per model input, by input name


@dataclass(frozen=True)
class InputSpec:
    """One model input: its name, the shape of one sample (no batch axis), a numpy dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def is_integer(self) -> bool:
        return np.issubdtype(np.dtype(self.dtype), np.integer)

    def describe(self) -> str:
        return f"{self.name} {self.batch_shape()} {self.dtype}"

    def batch_shape(self) -> str:
        """``(N, 1, 28, 28)``; a dimension the model leaves open is ``?``."""
        dims = ["N", *(str(d) if d >= 0 else "?" for d in self.shape)]
        return f"({', '.join(dims)})"

    def fits(self, shape: tuple[int, ...]) -> bool:
        """A batch of this input's shape (open dimensions take any size)."""
        sample = shape[1:]
        return (
            len(shape) >= 1
            and len(sample) == len(self.shape)
            and all(want < 0 or want == got for want, got in zip(self.shape, sample, strict=True))
        )


@dataclass(frozen=True)
class Samples:
    """Model inputs (one batch-first array per input, by name, all of one length) and optional
    labels; where they came from, for the report."""

    feeds: Feeds
    labels: np.ndarray | None
    source: str

    def __len__(self) -> int:
        return len(next(iter(self.feeds.values())))

    @property
    def inputs(self) -> np.ndarray:
        """The one array of a single-input model's samples."""
        if len(self.feeds) != 1:
            raise DataFileError(f"{len(self.feeds)} inputs ({', '.join(self.feeds)}): use feeds")
        return next(iter(self.feeds.values()))

    def rows(self, start: int, stop: int) -> Feeds:
        return {name: array[start:stop] for name, array in self.feeds.items()}

    def batches(self, size: int, *, pad: bool = False) -> Iterator[Feeds]:
        """Consecutive batches of ``size``; with ``pad`` the last one is filled up to ``size``
        with copies of its last row (for a model whose batch is fixed)."""
        for start in range(0, len(self), size):
            batch = self.rows(start, start + size)
            yield padded(batch, size) if pad else batch

    def head(self, count: int) -> Samples:
        labels = None if self.labels is None else self.labels[:count]
        return Samples(self.rows(0, count), labels, self.source)


def padded(feeds: Feeds, size: int) -> Feeds:
    """``feeds`` with their last row repeated up to ``size`` rows."""
    return {
        name: np.concatenate([array, np.repeat(array[-1:], size - len(array), axis=0)])
        if len(array) < size
        else array
        for name, array in feeds.items()
    }


def as_feeds(inputs: np.ndarray | Mapping[str, np.ndarray]) -> Feeds:
    """Named arrays as they are; a bare array is the one input of a single-input model."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    return {SINGLE_INPUT_NAME: np.asarray(inputs)}


def feed_for(names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> Feeds:
    """``feeds`` keyed by the model's input ``names``: by name, or, for a model with one input
    given one array, that array whatever it is called. KeyError names what is missing."""
    if len(names) == 1 and len(feeds) == 1:
        return {names[0]: next(iter(feeds.values()))}
    missing = [name for name in names if name not in feeds]
    if missing:
        raise KeyError(f"no data for model input(s) {', '.join(missing)} (got {', '.join(feeds)})")
    return {name: feeds[name] for name in names}


HEADER_READERS = {1: np.lib.format.read_array_header_1_0, 2: np.lib.format.read_array_header_2_0}


def sample_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """One sample's shape (no batch axis) of each array in an ``.npz`` but ``labels``, read
    from the array headers only; empty when the file cannot be read so (``load_npz`` then says
    what is wrong with it)."""
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.namelist():
                name = member.removesuffix(".npy")
                if name == LABELS_NAME or not member.endswith(".npy"):
                    continue
                with archive.open(member) as stream:
                    major, _ = np.lib.format.read_magic(stream)
                    read_header = HEADER_READERS.get(major)
                    if read_header is None:
                        return {}
                    shape, _, _ = read_header(stream)
                shapes[name] = tuple(int(d) for d in shape[1:])
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return {}
    return shapes


def load_npz(
    path: str | Path, specs: Sequence[InputSpec], *, purpose: str, minimum: int
) -> Samples:
    """Read and check one array per input of a model taking ``specs`` (+ ``labels``)."""
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
            f"numpy.savez(path, {_savez_arguments(specs)})"
        ) from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataFileError(
            f"{where}: a single .npy array, not an .npz archive; write one with "
            f"numpy.savez(path, {_savez_arguments(specs)})"
        )
    with archive:
        names = _array_names(archive.files, specs, where)
        feeds = {spec.name: _read(archive, names[spec.name], where) for spec in specs}
        labels = _read(archive, LABELS_NAME, where) if LABELS_NAME in archive.files else None
    return check_samples(
        Samples(feeds, labels, str(path)), specs, where=where, minimum=minimum, called=names
    )


def _savez_arguments(specs: Sequence[InputSpec]) -> str:
    return ", ".join([f"{spec.name}=..." for spec in specs] + [f"{LABELS_NAME}=..."])


def _array_names(files: list[str], specs: Sequence[InputSpec], where: str) -> dict[str, str]:
    """Model input name -> the archive's array for it; DataFileError for a missing or an extra
    array (an extra one is most likely a misnamed input)."""
    expected = "; the model takes " + ", ".join(spec.describe() for spec in specs)
    found = f" (found: {', '.join(files) or 'none'})"
    names = {}
    for spec in specs:
        if spec.name in files:
            names[spec.name] = spec.name
        elif len(specs) == 1 and SINGLE_INPUT_NAME in files:
            names[spec.name] = SINGLE_INPUT_NAME
        else:
            raise DataFileError(f"{where}: no array {spec.name!r}{found}{expected}")
    extra = sorted(set(files) - set(names.values()) - {LABELS_NAME})
    if extra:
        raise DataFileError(f"{where}: unexpected array {extra[0]!r}{found}{expected}")
    return names


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


def check_samples(
    samples: Samples,
    specs: Sequence[InputSpec],
    *,
    where: str,
    minimum: int,
    called: Mapping[str, str] | None = None,
) -> Samples:
    """Names, shapes, dtypes, count and finiteness against what the model takes; converts
    losslessly to each input's dtype. ``called``: input name -> the name the user gave its
    array (``inputs`` for a one-input model), for the messages."""
    called = called or {}
    feeds = {
        spec.name: _checked_input(
            samples.feeds[spec.name], spec, where, called.get(spec.name, spec.name)
        )
        for spec in specs
    }
    counts = {name: len(array) for name, array in feeds.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{name} {count}" for name, count in counts.items())
        raise DataFileError(f"{where}: the inputs have different sample counts ({listed})")
    count = next(iter(counts.values()))
    if count < minimum:
        raise DataFileError(f"{where}: {count} samples, at least {minimum} needed")
    labels = samples.labels
    if labels is not None:
        if labels.dtype.kind not in "iu" or labels.ndim != 1:
            raise DataFileError(
                f"{where}: 'labels' must be a 1-D integer array of class ids, got "
                f"{labels.dtype} with shape {tuple(labels.shape)}"
            )
        if len(labels) != count:
            raise DataFileError(
                f"{where}: {len(labels)} labels for {count} inputs; they must match"
            )
        labels = labels.astype(np.int64)
    return Samples(feeds, labels, samples.source)


def _checked_input(array: np.ndarray, spec: InputSpec, where: str, name: str) -> np.ndarray:
    if array.dtype.kind not in "biuf":
        raise DataFileError(f"{where}: {name!r} has dtype {array.dtype}, expected numbers")
    if not spec.fits(tuple(array.shape)):
        raise DataFileError(
            f"{where}: {name!r} has shape {tuple(array.shape)}, the model takes "
            f"{spec.batch_shape()}"
        )
    if spec.is_integer:
        if array.dtype.kind == "f" and not np.array_equal(array, np.round(array)):
            raise DataFileError(f"{where}: {name!r} must be integer token ids, got fractions")
        return np.ascontiguousarray(array.astype(spec.dtype))
    array = array.astype(spec.dtype)
    if not np.isfinite(array).all():
        bad = int((~np.isfinite(array)).sum())
        raise DataFileError(f"{where}: {name!r} has {bad} NaN/Inf values")
    return np.ascontiguousarray(array)


def checkpoint_samples(
    info: object,
    part: str,
    count: int | None = None,
    specs: Sequence[InputSpec] = (),
    seed: int = CALIBRATION_SEED,
) -> Samples:
    """Samples of the split an edge_un checkpoint was trained on: ``"train"`` for calibration
    (a random ``count`` of them, drawn with ``seed``: the default is the pipeline's draw),
    ``"test"`` for evaluation (all of it), as the feeds of a model taking ``specs`` (see
    ``dataset_feeds``; none given: one unnamed array)."""
    from edge_un import data as edge_data  # the data wheels are only needed on this path

    inputs, labels = edge_data.checkpoint_split(info, part)
    x, y = inputs.numpy(), labels.numpy().astype(np.int64)
    if count is not None and count < len(x):
        rows = np.random.default_rng(seed).permutation(len(x))[:count]
        x, y = x[rows], y[rows]
    feeds = dataset_feeds(np.ascontiguousarray(x), specs) if specs else as_feeds(x)
    return Samples(feeds, y, f"checkpoint {part} split")


def dataset_feeds(x: np.ndarray, specs: Sequence[InputSpec]) -> Feeds:
    """A data set's one array of samples as the feeds of a model taking ``specs``: the array
    itself for a one-input model; for a Hugging Face text model the token ids, their mask (1
    where a token is not padding) and zero token types, each in its input's dtype."""
    if len(specs) == 1:
        return {specs[0].name: x.astype(specs[0].dtype)}
    names = {spec.name for spec in specs}
    if "input_ids" in names and names <= HF_TEXT_INPUTS:
        made = {
            "input_ids": x,
            "attention_mask": (x != PAD_ID),
            "token_type_ids": np.zeros_like(x),
        }
        return {spec.name: made[spec.name].astype(spec.dtype) for spec in specs}
    listed = ", ".join(spec.describe() for spec in specs)
    raise DataFileError(
        f"the checkpoint's data set gives one array, the model takes {len(specs)} inputs "
        f"({listed}): give calibration and evaluation data as .npz files with one array per input"
    )
