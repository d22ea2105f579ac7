"""Attention masks int8 can carry (converters.attention_masks): a Hugging Face BERT's
float32-min padding mask, as torch's two exporters write it, becomes one Equal + Where with a
-30 penalty; the model computes the same; a mask that is already bounded is left alone."""

from __future__ import annotations

import contextlib
import io
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

import edge_un
from converters.attention_masks import MASK_PENALTY, bound_attention_masks
from converters.fold_and_export import export_folded, load_and_fold
from edge_un import examples

LENGTH = 16


@pytest.fixture(scope="module")
def bert_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small random HF BERT with UN, exported as users do: torch.onnx.export's default
    (dynamo) and the legacy exporter, batch 1, inputs input_ids and attention_mask."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=LENGTH, num_labels=2,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config).eval()
    edge_un.swap_layernorm(model, kind="un")
    model.eval()
    ids = torch.randint(1, 100, (1, LENGTH))
    mask = torch.ones(1, LENGTH, dtype=torch.long)
    directory = tmp_path_factory.mktemp("bert")
    names = ["input_ids", "attention_mask"]
    with contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(model, (ids, mask), directory / "dynamo.onnx", input_names=names,
                          external_data=False)  # fmt: skip
        torch.onnx.export(model, (ids, mask), directory / "legacy.onnx", dynamo=False,
                          input_names=names, opset_version=17)  # fmt: skip
    return {"dynamo": directory / "dynamo.onnx", "legacy": directory / "legacy.onnx"}


def outputs(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, feed)[0] for feed in feeds])


def padded_batches(count: int = 24) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    feeds = []
    for length in rng.integers(1, LENGTH + 1, count):
        ids = rng.integers(1, 100, (1, LENGTH))
        mask = (np.arange(LENGTH) < length)[None].astype(np.int64)
        feeds.append({"input_ids": ids * mask, "attention_mask": mask})
    return feeds


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_a_bert_padding_mask_becomes_one_integer_select_and_computes_the_same(
    bert_exports: dict[str, Path], exporter: str
) -> None:
    original = onnx.load(str(bert_exports[exporter]))
    model = onnx.load(str(bert_exports[exporter]))
    before = Counter(node.op_type for node in model.graph.node)
    rewritten = bound_attention_masks(model)
    rewrites = rewritten.masks
    onnx.checker.check_model(model, full_check=True)
    after = Counter(node.op_type for node in model.graph.node)
    assert rewrites and all(r.canonical and r.source == "attention_mask" for r in rewrites)
    assert "Where(attention_mask == 0, -30, 0)" in str(rewrites[0])
    # what HF's mask and SDPA's NaN guard were made of is gone; one Equal tests for padding
    assert after["IsNaN"] == 0 < before["IsNaN"] == rewritten.nan_guards and after["Equal"] >= 1
    assert after["GatherND"] == 0 and after["Expand"] <= before["Expand"]
    constants = [onnx.numpy_helper.to_array(i) for i in model.graph.initializer]
    finite = [c for c in constants if c.dtype.kind == "f" and c.size == 1]
    assert min(float(c) for c in finite) == MASK_PENALTY  # no float32-min, no -inf left
    feeds = padded_batches()
    np.testing.assert_allclose(outputs(model, feeds), outputs(original, feeds), atol=1e-5)


def test_a_mask_that_is_already_bounded_is_left_alone(tmp_path: Path) -> None:
    """edge_un's own text model adds -30 at padding: nothing to do, nothing changed."""
    path = tmp_path / "text.onnx"
    export_folded(load_and_fold(examples.path("text-rt-un")), path, opset=20)
    model = onnx.load(str(path))
    nodes = len(model.graph.node)
    assert not bound_attention_masks(model)
    assert len(model.graph.node) == nodes
