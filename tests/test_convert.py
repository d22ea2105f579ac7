"""The conversion job on the bundled examples: files, report, and the test-split check."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

import edge_un
from converters import ConversionError, OnlineNormError, export_onnx
from converters.fold_and_export import convert
from edge_un import examples


@pytest.fixture(scope="module")
def vit_conversion(tmp_path_factory: pytest.TempPathFactory):
    stages = []
    result = convert(
        examples.path("vit-mnist-un"),
        tmp_path_factory.mktemp("vit"),
        progress=lambda event: stages.append((event.stage, event.fraction)),
    )
    return result, stages


def test_folded_onnx_classifies_the_test_split_like_the_trained_model(vit_conversion) -> None:
    result, _ = vit_conversion
    _, info = edge_un.load_checkpoint(examples.path("vit-mnist-un"))
    check = result.test_split
    assert check is not None and check.samples == info.metadata["split"]["sizes"]["test"]
    assert check.top1_agreement >= 0.999
    assert abs(check.onnx_accuracy - info.metadata["test_accuracy"]) <= 0.001
    assert check.max_abs_diff < 1e-3


def test_writes_model_and_reports(vit_conversion) -> None:
    result, stages = vit_conversion
    report = json.loads(result.report_path.read_text())
    assert report["fold"]["fully_integer"] is True
    assert len(report["fold"]["norms"]) == 9  # 4 blocks x 2 + final
    assert all(n["action"] != "scale_shift" for n in report["fold"]["norms"])
    # (ReduceMean stays: this example pools by mean over tokens.)
    assert not {"LayerNormalization", "Sqrt", "Pow", "Reciprocal"} & set(report["op_histogram"])
    onnx.checker.check_model(str(result.onnx_path), full_check=True)
    summary = result.summary_path.read_text()
    assert "fully integer-ready (no online norm left): yes" in summary
    assert "| blocks.3.norm2 | un | folded_forward | blocks.3.mlp.fc1 |" in summary
    assert [s for s, _ in stages][-1] == "done"
    assert [f for _, f in stages] == sorted(f for _, f in stages)


def test_static_batch_opset17_for_npu_targets(tmp_path: Path) -> None:
    result = convert(examples.path("vit-mnist-un"), tmp_path, opset=17, dynamic_batch=False)
    proto = onnx.load(str(result.onnx_path))
    assert {o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")} == {17}
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 1, 28, 28]
    assert result.test_split is not None and result.test_split.top1_agreement >= 0.999


def test_layernorm_model_is_refused_unless_allowed(tmp_path: Path) -> None:
    with pytest.raises(OnlineNormError, match=r"blocks\.0\.norm1 \(LayerNorm\)"):
        convert(examples.path("vit-mnist-ln"), tmp_path / "refused")
    result = convert(examples.path("vit-mnist-ln"), tmp_path / "allowed", allow_online=True)
    assert not result.fold.fully_integer
    assert "fully integer-ready (no online norm left): NO" in result.summary_path.read_text()


def test_an_onnx_file_from_elsewhere_is_folded_at_graph_level(tmp_path: Path) -> None:
    model, _ = edge_un.load_checkpoint(examples.path("vit-mnist-un"))
    unfolded = tmp_path / "unfolded.onnx"
    export_onnx(model, (edge_un.data.checkpoint_split(
        edge_un.load_checkpoint(examples.path("vit-mnist-un"))[1], "test")[0][:2],),
        unfolded)  # fmt: skip
    result = convert(unfolded, tmp_path / "out")
    assert len(result.fold.folded) == 9
    assert result.export is None and result.test_split is None
    assert "max abs diff" in result.notes[0]
    assert float(result.notes[0].rsplit(" ", 1)[1]) < 1e-4


def test_bad_sources_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="no such file"):
        convert(tmp_path / "missing.safetensors", tmp_path / "out")
    garbage = tmp_path / "model.onnx"
    garbage.write_bytes(b"\x08\x01garbage")
    with pytest.raises(ConversionError) as error:
        convert(garbage, tmp_path / "out")
    assert "\n" not in str(error.value) and "model.onnx" in str(error.value)
    bad_checkpoint = tmp_path / "model.safetensors"
    bad_checkpoint.write_bytes(b"garbage")
    with pytest.raises(edge_un.NotACheckpointError):
        convert(bad_checkpoint, tmp_path / "out")
