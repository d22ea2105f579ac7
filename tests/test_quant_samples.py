"""Calibration / evaluation .npz files: one array per model input, named as the model names it
('inputs' for a one-input model), and 'labels'; every bad input gets its own clear one-line
error naming the input and the shape it needs."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from quant.errors import DataFileError
from quant.samples import InputSpec, dataset_feeds, load_npz

IMAGE = InputSpec("images", (1, 28, 28), "float32")
TOKENS = InputSpec("token_ids", (16,), "int64")
BERT = (InputSpec("input_ids", (16,), "int64"), InputSpec("attention_mask", (16,), "int64"))


def write(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def images(count: int = 32) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((count, 1, 28, 28)).astype(np.float32)


def load(path: Path, spec: InputSpec | tuple[InputSpec, ...] = IMAGE, minimum: int = 16):
    specs = spec if isinstance(spec, tuple) else (spec,)
    return load_npz(path, specs, purpose="calibration", minimum=minimum)


def test_a_good_file_loads_with_labels(tmp_path: Path) -> None:
    labels = np.arange(32) % 10
    samples = load(write(tmp_path / "ok.npz", inputs=images(), labels=labels))
    assert samples.inputs.shape == (32, 1, 28, 28) and samples.inputs.dtype == np.float32
    assert np.array_equal(samples.labels, labels)


def test_float64_inputs_and_integral_float_token_ids_are_converted(tmp_path: Path) -> None:
    assert load(write(tmp_path / "a.npz", inputs=images().astype(np.float64))).inputs.dtype == (
        np.float32
    )
    ids = np.ones((32, 16), dtype=np.float32)
    assert load(write(tmp_path / "b.npz", inputs=ids), TOKENS).inputs.dtype == np.int64


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"inputs": images()[:, :, :27]}, "shape (32, 1, 27, 28), the model takes (N, 1, 28, 28)"),
        ({"inputs": images(4)}, "4 samples, at least 16 needed"),
        ({"data": images()},
         "no array 'images' (found: data); the model takes images (N, 1, 28, 28) float32"),
        ({"inputs": images(), "extra": images()}, "unexpected array 'extra'"),
        ({"inputs": np.array(["a"] * 32)}, "'inputs' has dtype <U1, expected numbers"),
        ({"inputs": np.where(np.arange(32)[:, None, None, None] == 3, np.nan, images())},
         "has 784 NaN/Inf values"),
        ({"inputs": images(), "labels": np.arange(31)}, "31 labels for 32 inputs"),
        ({"inputs": images(), "labels": np.zeros(32, np.float32)}, "'labels' must be a 1-D int"),
    ],
)  # fmt: skip
def test_bad_contents(tmp_path: Path, arrays: dict, message: str) -> None:
    with pytest.raises(DataFileError) as caught:
        load(write(tmp_path / "bad.npz", **arrays))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_fractional_token_ids_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DataFileError, match="must be integer token ids"):
        load(write(tmp_path / "t.npz", inputs=np.full((32, 16), 0.5)), TOKENS)


def test_a_pickled_object_array_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    objects = np.empty(32, dtype=object)
    objects[:] = [Payload() for _ in range(32)]
    np.savez(tmp_path / "evil.npz", inputs=objects)
    assert not marker.exists()
    with pytest.raises(DataFileError, match="pickled object array, which is never loaded"):
        load(tmp_path / "evil.npz")
    assert not marker.exists()
    # The same file does run code when unpickled: the test above could have failed.
    np.load(tmp_path / "evil.npz", allow_pickle=True)["inputs"]
    assert marker.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a readable .npz archive"),
        (b"PK\x03\x04 truncated zip", "not a readable .npz archive"),
        (pickle.dumps({"inputs": [1, 2]}), "pickled object"),
    ],
)
def test_files_that_are_not_npz(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "x.npz"
    path.write_bytes(content)
    with pytest.raises(DataFileError, match=message):
        load(path)


def test_a_plain_npy_file_and_a_missing_file(tmp_path: Path) -> None:
    np.save(tmp_path / "single.npy", images())
    with pytest.raises(DataFileError, match=r"a single \.npy array"):
        load(tmp_path / "single.npy")
    with pytest.raises(DataFileError, match="no such file"):
        load(tmp_path / "missing.npz")


def test_a_one_input_model_takes_its_array_by_its_name_or_as_inputs(tmp_path: Path) -> None:
    by_name = load(write(tmp_path / "a.npz", images=images()))
    generic = load(write(tmp_path / "b.npz", inputs=images()))
    assert by_name.feeds.keys() == generic.feeds.keys() == {"images"}
    assert np.array_equal(by_name.inputs, generic.inputs)


def tokens(count: int = 32, pad_from: int = 10) -> np.ndarray:
    ids = np.random.default_rng(0).integers(2, 100, (count, 16))
    ids[:, pad_from:] = 0
    return ids


def test_a_two_input_model_takes_one_named_array_per_input(tmp_path: Path) -> None:
    ids, mask = tokens(), (tokens() != 0).astype(np.int32)
    samples = load(write(tmp_path / "ok.npz", input_ids=ids, attention_mask=mask,
                         labels=np.arange(32) % 2), BERT)  # fmt: skip
    assert list(samples.feeds) == ["input_ids", "attention_mask"] and len(samples) == 32
    assert samples.feeds["attention_mask"].dtype == np.int64  # converted to the model's dtype
    with pytest.raises(ValueError, match="2 inputs"):
        samples.inputs  # noqa: B018  (the one-array view refuses a two-input model)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"input_ids": tokens()},
         "no array 'attention_mask' (found: input_ids); the model takes input_ids (N, 16) int64, "
         "attention_mask (N, 16) int64"),
        ({"inputs": tokens(), "attention_mask": tokens()}, "no array 'input_ids'"),
        ({"input_ids": tokens(), "attention_mask": tokens()[:, :8]},
         "'attention_mask' has shape (32, 8), the model takes (N, 16)"),
        ({"input_ids": tokens(), "attention_mask": tokens(31)},
         "different sample counts (input_ids 32, attention_mask 31)"),
        ({"input_ids": tokens(), "attention_mask": tokens(), "token_type_ids": tokens()},
         "unexpected array 'token_type_ids'"),
    ],
)  # fmt: skip
def test_bad_multi_input_files(tmp_path: Path, arrays: dict, message: str) -> None:
    with pytest.raises(DataFileError) as caught:
        load(write(tmp_path / "bad.npz", **arrays), BERT)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_an_open_dimension_takes_any_size(tmp_path: Path) -> None:
    spec = InputSpec("input_ids", (-1,), "int64")
    assert len(load(write(tmp_path / "a.npz", input_ids=tokens()), spec)) == 32
    with pytest.raises(DataFileError, match=r"the model takes \(N, \?\)"):
        load(write(tmp_path / "b.npz", input_ids=images()), spec)


def test_a_data_sets_token_ids_feed_a_hugging_face_text_model() -> None:
    ids = tokens(4, pad_from=5)
    specs = (*BERT, InputSpec("token_type_ids", (16,), "int64"))
    feeds = dataset_feeds(ids, specs)
    assert np.array_equal(feeds["input_ids"], ids)
    assert feeds["attention_mask"].tolist() == [[1] * 5 + [0] * 11] * 4
    assert not feeds["token_type_ids"].any()
    with pytest.raises(DataFileError, match="takes 2 inputs"):
        dataset_feeds(ids, (IMAGE, TOKENS))
