"""Models whose code we never see: a torch.export program (.pt2) and ONNX files from any
framework fold with the same exactness; malicious or damaged files give clear errors."""

from __future__ import annotations

import contextlib
import json
import pickle
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from converters import (
    NotAnOnnxModelError,
    NotAProgramError,
    OnlineNormError,
    export_onnx,
    fold_norms,
    fold_onnx,
    load_program,
)
from converters.export import op_histogram
from edge_un.models import VisionTransformer

from .fold_helpers import foreign_model, norm_free_twin, relative_diff

TOLERANCE = 1e-5
EXPECTED = {
    "stem_norm": ("folded_backward", ("stem",)),
    "blocks.0.ln": ("folded_forward", ("blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v",
                                       "blocks.0.fc_in")),
    "blocks.1.ln": ("folded_forward", ("blocks.1.attn.q", "blocks.1.attn.k", "blocks.1.attn.v",
                                       "blocks.1.fc_in")),
    "final": ("folded_forward", ("head",)),
}  # fmt: skip


def save_program(model: torch.nn.Module, x: torch.Tensor, path: Path) -> Path:
    batch = torch.export.Dim("batch")
    torch.export.save(torch.export.export(model, (x,), dynamic_shapes=({0: batch},)), path)
    return path


def ort_run(model: onnx.ModelProto | Path, x: torch.Tensor) -> np.ndarray:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


@pytest.mark.parametrize("kind", ["un", "bn", "on"])
def test_pt2_program_folds_exactly(tmp_path: Path, kind: str) -> None:
    model = foreign_model(kind).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    program = load_program(save_program(model, x, tmp_path / "foreign.pt2"))
    folded, report = fold_norms(program)
    assert {n.name: (n.action, n.into) for n in report.norms} == EXPECTED
    bigger = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    assert relative_diff(model(bigger), folded(bigger)) <= 1e-10


def test_pt2_program_exports_clean_onnx(tmp_path: Path) -> None:
    model = foreign_model("mabn")
    x = torch.randn(2, 3, 8, 8)
    folded, report = fold_norms(load_program(save_program(model, x, tmp_path / "f.pt2")))
    info = export_onnx(folded, (x,), tmp_path / "f.onnx")
    into = {name for n in report.norms for name in n.into}
    twin = export_onnx(norm_free_twin(model, into), (x,), tmp_path / "twin.onnx")
    assert info.op_histogram == twin.op_histogram
    assert relative_diff(model(x), ort_run(info.path, x)) <= TOLERANCE


def test_foreign_onnx_folds_like_the_torch_route(tmp_path: Path) -> None:
    """The unfolded model exported by torch, folded at ONNX level, gives the same graph as
    folding in torch first, and the same outputs."""
    model = foreign_model("rbn")
    x = torch.randn(3, 3, 8, 8)
    plain = export_onnx(model, (x,), tmp_path / "plain.onnx")
    folded_onnx, report = fold_onnx(plain.path)
    assert {n.name: (n.action, n.into) for n in report.norms} == EXPECTED
    folded_torch, _ = fold_norms(model, (x,))
    via_torch = export_onnx(folded_torch, (x,), tmp_path / "via_torch.onnx")
    assert op_histogram(folded_onnx) == via_torch.op_histogram
    assert relative_diff(model(x), ort_run(folded_onnx, x)) <= TOLERANCE


def _init(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(array.astype(np.float32), name)


def hand_built_onnx(rng: np.random.Generator) -> onnx.ModelProto:
    """No torch, no metadata: the kind of graph another framework writes.

    x -> Mul,Add (norm A) -> MatMul W0 (no bias)          : A folds forward, creates a bias
      -> MatMul W1 -> Add b1 -> Mul,Div,Sub (norm B)       : B folds backward into W1
      -> Relu -> Mul,Sub,Mul (norm C) -> Sigmoid and Add   : C cannot fold: one Mul + Add
      -> Mul,Add (norm D) -> ReduceMean(axis 1) -> Gemm    : D folds through the mean
    """
    c, h = 6, 8
    vec = lambda n, lo=0.5, hi=2.0: rng.uniform(lo, hi, n)  # noqa: E731
    inits = [
        _init("sA", vec(c)), _init("tA", rng.normal(size=c)), _init("W0", rng.normal(size=(c, h))),
        _init("W1", rng.normal(size=(h, h))), _init("b1", rng.normal(size=h)),
        _init("sB", vec(h)), _init("dB", vec(h)), _init("tB", rng.normal(size=h)),
        _init("sC", vec(h)), _init("tC", rng.normal(size=h)), _init("uC", vec(h)),
        _init("sD", vec(h)), _init("tD", rng.normal(size=h)), _init("axes", np.array([1])),
        _init("Wg", rng.normal(size=(3, h))), _init("bg", rng.normal(size=3)),
    ]  # fmt: skip
    inits[13] = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    nodes = [
        helper.make_node("Mul", ["x", "sA"], ["a1"]),
        helper.make_node("Add", ["a1", "tA"], ["a2"]),
        helper.make_node("MatMul", ["a2", "W0"], ["m0"]),
        helper.make_node("MatMul", ["m0", "W1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["m2"]),
        helper.make_node("Mul", ["m2", "sB"], ["b1x"]),
        helper.make_node("Div", ["b1x", "dB"], ["b2x"]),
        helper.make_node("Sub", ["b2x", "tB"], ["b3x"]),
        helper.make_node("Relu", ["b3x"], ["r"]),
        helper.make_node("Mul", ["r", "sC"], ["c1"]),
        helper.make_node("Sub", ["c1", "tC"], ["c2"]),
        helper.make_node("Mul", ["c2", "uC"], ["c3"]),
        helper.make_node("Sigmoid", ["c3"], ["g"]),
        helper.make_node("Add", ["c3", "g"], ["res"]),
        helper.make_node("Mul", ["res", "sD"], ["d1"]),
        helper.make_node("Add", ["d1", "tD"], ["d2"]),
        helper.make_node("ReduceMean", ["d2", "axes"], ["pooled"], keepdims=0),
        helper.make_node("Gemm", ["pooled", "Wg", "bg"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "foreign",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5, c])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        inits,
    )
    # IR version 10: onnx 1.23 writes 14 by default, which ORT 1.31 cannot read yet
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def test_hand_built_onnx_from_another_framework(tmp_path: Path) -> None:
    model = hand_built_onnx(np.random.default_rng(0))
    path = tmp_path / "foreign.onnx"
    onnx.save(model, str(path))
    folded, report = fold_onnx(path)
    actions = [(n.name, n.action, n.into) for n in report.norms]
    assert actions == [
        ("a2", "folded_forward", ("MatMul(m0)",)),
        ("b3x", "folded_backward", ("MatMul(m1)",)),
        ("c3", "scale_shift", ()),
        ("d2", "folded_forward", ("Gemm(y)",)),
    ], str(report)
    assert "Sigmoid" in report.kept[0].reason
    before, after = op_histogram(model), op_histogram(folded)
    # A: -Mul -Add, +1 bias Add on W0; B: its chain starts at b1's Add: -Add -Mul -Div -Sub,
    # +1 bias Add on W1; C: Mul, Sub, Mul -> one Mul + one Add; D: -Mul -Add (through the mean)
    assert after == {"MatMul": 2, "Add": 4, "Relu": 1, "Mul": 1, "Sigmoid": 1, "ReduceMean": 1,
                     "Gemm": 1}, after  # fmt: skip
    assert before["Mul"] == 5
    x = torch.from_numpy(np.random.default_rng(1).normal(size=(4, 5, 6)).astype(np.float32))
    expected = torch.from_numpy(ort_run(model, x))
    assert relative_diff(expected, ort_run(folded, x)) <= TOLERANCE


def test_layernorm_onnx_is_refused(tmp_path: Path) -> None:
    model = VisionTransformer(img_size=8, patch_size=4, dim=8, depth=1, heads=2, norm="ln").eval()
    info = export_onnx(model, (torch.randn(2, 1, 8, 8),), tmp_path / "ln.onnx")
    assert "LayerNormalization" in info.op_histogram
    with pytest.raises(OnlineNormError, match="LayerNormalization"):
        fold_onnx(info.path)
    _, report = fold_onnx(info.path, allow_online=True)
    assert not report.fully_integer


@pytest.mark.parametrize(
    "content", [b"", b"not an onnx model at all", bytes(range(256)) * 8, "truncated"]
)
def test_damaged_onnx_is_a_clear_error(tmp_path: Path, content: bytes | str) -> None:
    path = tmp_path / "bad.onnx"
    if content == "truncated":
        good = hand_built_onnx(np.random.default_rng(0)).SerializeToString()
        content = good[: len(good) // 2]
    path.write_bytes(content)  # type: ignore[arg-type]
    with pytest.raises(NotAnOnnxModelError, match=r"bad\.onnx"):
        fold_onnx(path)


def test_damaged_program_is_a_clear_error(tmp_path: Path) -> None:
    not_zip = tmp_path / "a.pt2"
    not_zip.write_bytes(b"hello")
    with pytest.raises(NotAProgramError, match=r"a\.pt2"):
        load_program(not_zip)
    good = save_program(foreign_model(), torch.randn(2, 3, 8, 8), tmp_path / "good.pt2")
    truncated = tmp_path / "cut.pt2"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(NotAProgramError, match=r"cut\.pt2"):
        load_program(truncated)


class _Payload:
    """Unpickling this creates a file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _rewrite(source: Path, target: Path, replace: dict[str, bytes]) -> None:
    """Copy a .pt2 archive, replacing the entries whose name ends with a key."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for item in old.infolist():
            data = old.read(item)
            for suffix, content in replace.items():
                if item.filename.endswith(suffix):
                    data = content
            new.writestr(item, data)


def test_malicious_program_runs_no_code(tmp_path: Path) -> None:
    good = save_program(foreign_model(), torch.randn(2, 3, 8, 8), tmp_path / "good.pt2")
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Payload(marker))

    # 1. A crafted sample-inputs pickle: torch.export.load falls back to unsafe unpickling.
    evil_inputs = tmp_path / "evil_inputs.pt2"
    _rewrite(good, evil_inputs, {"sample_inputs/model.pt": evil})
    with contextlib.suppress(Exception):  # it fails after the payload already ran
        torch.export.load(evil_inputs)
    assert marker.exists(), "the file is not malicious after all: the test proves nothing"
    marker.unlink()
    program = load_program(evil_inputs)  # loads, the bad sample inputs are dropped
    assert not marker.exists()
    assert not program.example_inputs or not program.example_inputs[0]

    # 2. A weight marked as pickled: refused outright.
    with zipfile.ZipFile(good) as archive:
        config_name = next(n for n in archive.namelist() if n.endswith("model_weights_config.json"))
        config = json.loads(archive.read(config_name))
    first = next(iter(config["config"].values()))
    first["use_pickle"] = True
    evil_weight = tmp_path / "evil_weight.pt2"
    _rewrite(good, evil_weight, {
        "model_weights_config.json": json.dumps(config).encode(),
        f"weights/{first['path_name']}": evil,
    })  # fmt: skip
    with pytest.raises(NotAProgramError, match="unsafe unpickling"):
        load_program(evil_weight)
    assert not marker.exists()
