"""A source is read, then folded once: a conversion reads its data by the input names the
source gives before any trace, and ``--recalibrate`` changes the loaded model before that one
fold (it used to fold, recalibrate, then fold again)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import converters.fold
from converters.errors import ConversionError
from converters.fold_and_export import fold_loaded
from converters.loaded_source import load_source
from converters.progress import ignore_progress
from edge_un import examples
from quant.prepare import prepare
from quant.request import conversion_request


@pytest.mark.parametrize(
    ("name", "inputs"),
    [
        ("text-rt-un", ("token_ids",)),  # an edge_un checkpoint: its forward's arguments
        ("hf-bert-rt-un", ("input_ids", "attention_mask")),  # a Hugging Face directory
    ],
)
def test_the_names_a_source_gives_are_the_ones_its_fold_takes(name: str, inputs: tuple) -> None:
    loaded = load_source(examples.path(name))
    assert loaded.input_names == inputs
    assert fold_loaded(loaded).input_names == inputs


def test_a_source_whose_names_are_not_its_graphs_is_refused_rather_than_read_wrongly() -> None:
    loaded = replace(load_source(examples.path("text-rt-un")), input_names=("images",))
    with pytest.raises(
        ConversionError, match=r"takes \['token_ids'\], not the inputs \['images'\]"
    ):
        fold_loaded(loaded)


def test_a_recalibrated_conversion_folds_the_model_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread
) -> None:
    """The fold still runs for real; its graph pass (every torch fold's) is only counted."""
    folds = []

    def counted(gm, **kwargs):
        folds.append(kwargs["source"])
        return fold_graph(gm, **kwargs)

    fold_graph = converters.fold.fold_graph
    monkeypatch.setattr(converters.fold, "fold_graph", counted)
    request = conversion_request(examples.path("vit-mnist-un"), "cpu", recalibrate_batches=2)
    prepared = prepare(request, tmp_path / "out", tmp_path / "work", ignore_progress)
    assert prepared.recalibration is not None and prepared.recalibration.batches == 2
    assert len(folds) == 1, folds
    assert len(prepared.fold["norms"]) == 9 and prepared.fold["fully_integer"]
