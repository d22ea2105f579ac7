"""export_onnx: one checked file, ORT agrees with the original model, and the op census proves
the norms are gone (pre-norm) or are exactly one Mul + Add each (post-norm)."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import torch

from converters import OpsetError, export_onnx, fold_norms
from edge_un.models import VisionTransformer

from .fold_helpers import (
    build,
    histogram_difference,
    inputs_for,
    norm_free_twin,
    random_config,
    relative_diff,
)
from .test_fold import example_checkpoint

TOLERANCE = 1e-5  # max abs difference relative to the logits' max abs value
NORM_OPS = {"LayerNormalization", "ReduceMean", "Pow", "Sqrt", "Div", "Reciprocal"}


def ort_outputs(path: Path, x: torch.Tensor):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def folded_and_twin(model, tmp_path: Path, x: torch.Tensor, opset: int):
    folded, report = fold_norms(model)
    info = export_onnx(folded, (x,), tmp_path / "folded.onnx", opset=opset)
    into = {name for n in report.norms for name in n.into}
    twin = export_onnx(norm_free_twin(model, into), (x,), tmp_path / "twin.onnx", opset=opset)
    return report, info, twin


def test_prenorm_vit_has_no_norm_ops_at_all(tmp_path: Path) -> None:
    """cls pooling and opset 20 (native Gelu): nothing in the graph may divide, reduce or take
    a root, and there is no Gather (Ethos-U cannot run it)."""
    config = {"img_size": 12, "in_chans": 3, "patch_size": 4, "dim": 16, "depth": 3, "heads": 4}
    model = build("vit", config, 11)
    x = inputs_for(model)
    report, info, twin = folded_and_twin(model, tmp_path, x, opset=20)
    assert not NORM_OPS & set(info.op_histogram), info.op_histogram
    assert "Gather" not in info.op_histogram
    assert info.op_histogram == twin.op_histogram  # no leftover norm Mul/Add
    assert relative_diff(model(x), ort_outputs(info.path, x)) <= TOLERANCE
    assert info.opset == 20 and len(report.folded) == 7


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 5])
def test_random_models_export_exactly_and_cleanly(tmp_path: Path, seed: int) -> None:
    """Every folded norm leaves no op behind; every kept one is exactly one Mul + one Add.
    ReduceSum/Div of the text model's masked pooling and GELU's Div are in the twin too, so the
    comparison with the norm-free twin separates them from norms."""
    family, config = random_config(seed)
    model = build(family, config, seed)
    x = inputs_for(model)
    report, info, twin = folded_and_twin(model, tmp_path, x, opset=18)
    kept = len(report.kept)
    expected = {"Mul": kept, "Add": kept} if kept else {}
    assert histogram_difference(info.op_histogram, twin.op_histogram) == expected, str(report)
    assert relative_diff(model(x), ort_outputs(info.path, x)) <= TOLERANCE
    if family == "vit":
        assert "Gather" not in info.op_histogram
        assert kept == 0


def test_postnorm_text_keeps_one_mul_add_per_norm(tmp_path: Path) -> None:
    config = {"vocab_size": 40, "max_len": 8, "dim": 16, "depth": 2, "heads": 2,
              "norm_first": False, "bias": False}  # fmt: skip
    model = build("text", config, 4)
    x = inputs_for(model)
    report, info, twin = folded_and_twin(model, tmp_path, x, opset=18)
    assert len(report.kept) == 4 and not report.folded
    assert histogram_difference(info.op_histogram, twin.op_histogram) == {"Mul": 4, "Add": 4}
    assert not {"Sqrt", "Pow", "Reciprocal", "LayerNormalization", "ReduceMean"} & set(
        info.op_histogram
    )
    assert relative_diff(model(x), ort_outputs(info.path, x)) <= TOLERANCE


def test_export_info_and_self_contained_file(tmp_path: Path) -> None:
    model = build("vit", {"img_size": 8, "patch_size": 4, "dim": 8, "depth": 1, "heads": 2}, 2)
    x = inputs_for(model, batch=1)
    folded, _ = fold_norms(model)
    info = export_onnx(folded, (x,), tmp_path / "m.onnx")
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no external data file
    proto = onnx.load(str(info.path), load_external_data=False)
    assert all(t.data_location == onnx.TensorProto.DEFAULT for t in proto.graph.initializer)
    assert info.opset == 18 == proto.opset_import[0].version
    assert info.inputs[0].name == "images" and isinstance(info.inputs[0].shape[0], str)
    assert info.outputs[0].shape[1] == 10
    assert info.max_abs_diff <= TOLERANCE * float(model(x).detach().abs().max())
    assert sum(info.op_histogram.values()) == len(proto.graph.node)
    bigger = inputs_for(model, batch=5)  # batch 1 example, dynamic batch in the file
    assert relative_diff(model(bigger), ort_outputs(info.path, bigger)) <= TOLERANCE


def test_opset17_static_for_tidl(tmp_path: Path) -> None:
    """The exporter cannot write 17 itself: the file must really be opset 17, valid, static."""
    config = {"img_size": 8, "patch_size": 4, "dim": 8, "depth": 2, "heads": 2, "pool": "mean"}
    model = build("vit", config, 6)
    x = inputs_for(model, batch=1)
    folded, _ = fold_norms(model)
    info = export_onnx(folded, (x,), tmp_path / "tidl.onnx", opset=17, dynamic_batch=False)
    proto = onnx.load(str(info.path))
    assert info.opset == 17 == proto.opset_import[0].version
    onnx.checker.check_model(proto, full_check=True)
    assert info.inputs[0].shape == (1, 1, 8, 8)
    assert {"Split", "ReduceMean"} <= set(info.op_histogram)  # the two ops that changed in 18
    assert relative_diff(model(x), ort_outputs(info.path, x)) <= TOLERANCE


@pytest.mark.parametrize("opset", [16, 99])
def test_unsupported_opset_is_a_clear_error(tmp_path: Path, opset: int) -> None:
    model = VisionTransformer(img_size=8, patch_size=4, dim=8, depth=1, heads=2).eval()
    with pytest.raises(OpsetError, match=f"opset {opset} not supported"):
        export_onnx(model, (torch.randn(1, 1, 8, 8),), tmp_path / "x.onnx", opset=opset)


@pytest.mark.parametrize("name", ["vit-mnist-un", "text-rt-un"])
def test_example_models_export(tmp_path: Path, name: str) -> None:
    model = example_checkpoint(name)
    x = inputs_for(model, batch=4)
    report, info, twin = folded_and_twin(model, tmp_path, x, opset=18)
    kept = len(report.kept)
    expected = {"Mul": kept, "Add": kept} if kept else {}
    assert histogram_difference(info.op_histogram, twin.op_histogram) == expected
    assert relative_diff(model(x), ort_outputs(info.path, x)) <= TOLERANCE
    if name.startswith("vit"):
        assert "Gather" not in info.op_histogram
