"""A user's own Hugging Face ViT and BERT (LayerNorm swapped for UN), exported the way torch
exports them today, load and fold: .pt2 returning a ModelOutput, ONNX from the dynamo exporter
(opset 20, native Gelu, weights in model.onnx.data) and from the legacy one (Erf, Shape nodes on
the hidden states), at opsets 17 to 21; HF ViT's ``[:, 0, :]`` becomes a slice, not a Gather."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import Tensor, nn

import edge_un
from converters import (
    FoldReport,
    NotAnOnnxModelError,
    export_onnx,
    fold_norms,
    fold_onnx,
    load_onnx,
    load_program,
)
from converters.export import op_histogram
from converters.fold import fold_graph
from converters.onnx_rewrites import fuse_erf_gelu, rewrite_model
from converters.opset import convert_opset
from converters.program import program_output_note

from .fold_helpers import randomize_norm_state, relative_diff
from .test_fold_foreign import _Payload, _rewrite

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5  # ONNX Runtime vs torch, relative to the logits' max abs value
EXACT = 1e-10  # float64 folding
VIT_LAYERS = 4  # 9 norms: two per layer and the final one
BERT_EXPECTED = {
    "bert.embeddings.LayerNorm": "folded_backward",  # into the embedding tables
    "bert.encoder.layer.0.attention.output.LayerNorm": "scale_shift",
    "bert.encoder.layer.0.output.LayerNorm": "scale_shift",
    "bert.encoder.layer.1.attention.output.LayerNorm": "scale_shift",
    "bert.encoder.layer.1.output.LayerNorm": "folded_forward",  # only the pooler reads it
}


def trained_looking(model: nn.Module, seed: int) -> nn.Module:
    """UN statistics and affines as after training, and biases that differ from each other
    (freshly initialised ones are all zero, and exporters merge equal initializers)."""
    randomize_norm_state(model, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


def hf_vit(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.ViTConfig(
        image_size=8, num_channels=3, patch_size=4, hidden_size=16,
        num_hidden_layers=VIT_LAYERS, num_attention_heads=2, intermediate_size=32, num_labels=3,
    )  # fmt: skip
    model = transformers.ViTForImageClassification(config)
    assert edge_un.swap_layernorm(model, kind="un") == 2 * VIT_LAYERS + 1
    return trained_looking(model, seed)


def hf_bert(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    assert edge_un.swap_layernorm(model, kind="un") == len(BERT_EXPECTED)
    return trained_looking(model, seed)


def images(batch: int = 3, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=dtype)


def text(batch: int = 3) -> tuple[Tensor, Tensor]:
    ids = torch.randint(1, 50, (batch, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # padding
    return ids, mask


def logits(model: nn.Module, *args: Tensor) -> Tensor:
    with torch.no_grad():
        out = model(*args)
    return out.logits if hasattr(out, "logits") else out


def ort_run(model: onnx.ModelProto | Path, *args: Tensor) -> np.ndarray:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args, strict=True)}
    return session.run(None, feeds)[0]


def quietly_export(model: nn.Module, args: tuple, path: Path, **kwargs) -> Path:
    """torch.onnx.export as a user calls it (defaults unless ``kwargs`` say otherwise)."""
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints progress lines
        torch.onnx.export(model, args, str(path), **kwargs)
    return path


def legacy_export(model: nn.Module, args: tuple, path: Path, names: list[str], **kwargs) -> Path:
    """The legacy exporter with a dynamic batch (what leaves Shape nodes on hidden states)."""
    axes = {name: {0: "batch"} for name in names}
    return quietly_export(
        model, args, path, dynamo=False, input_names=names, dynamic_axes=axes, **kwargs
    )


def actions(report: FoldReport) -> dict[str, str]:
    return {n.name: n.action for n in report.norms}


def kept_as_one_mul_add(model: onnx.ModelProto, channels: int) -> int:
    """How many per-channel Mul (by a (C,) constant) feed exactly one Add of a (C,) constant."""
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def per_channel(node: onnx.NodeProto) -> bool:
        return any(constants.get(n, np.zeros(0)).shape == (channels,) for n in node.input)

    return sum(
        node.op_type == "Mul"
        and per_channel(node)
        and [(r.op_type, per_channel(r)) for r in readers.get(node.output[0], [])]
        == [("Add", True)]
        for node in model.graph.node
    )


# -- 1. .pt2 returning a ModelOutput ---------------------------------------------------------


@pytest.fixture(scope="module")
def vit_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF ViT exported as is: its program returns an ImageClassifierOutput."""
    path = tmp_path_factory.mktemp("pt2") / "vit.pt2"
    model = hf_vit().double()
    batch = torch.export.Dim("batch")
    program = torch.export.export(
        model, (images(dtype=torch.float64),), dynamic_shapes=({0: batch},)
    )
    torch.export.save(program, path)
    return path


LOADS_WITHOUT_TRANSFORMERS = """
import sys
sys.modules["transformers"] = None  # any import of it now fails
import numpy as np, torch
from converters import fold_norms, load_program
from converters.program import program_output_note
program = load_program(sys.argv[1])
folded, report = fold_norms(program)
x = torch.from_numpy(np.load(sys.argv[2]))
np.save(sys.argv[3], folded(x).detach().numpy())
print(program_output_note(program))
print(sorted({n.action for n in report.norms}), len(report.norms), report.notes)
"""


def test_hf_program_loads_and_folds_without_transformers(vit_program: Path, tmp_path: Path) -> None:
    """torch can only load it with transformers imported (it registers ModelOutput); edge-un
    reads the output structure as JSON, keeps the logits and never imports the class."""
    x = images(5, torch.float64)
    np.save(tmp_path / "x.npy", x.numpy())
    result = subprocess.run(
        [sys.executable, "-c", LOADS_WITHOUT_TRANSFORMERS, str(vit_program),
         str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    note, summary = result.stdout.strip().splitlines()[-2:]
    assert "ImageClassifierOutput" in note and "'logits'" in note
    assert summary.startswith("['folded_forward'] 9") and "logits" in summary
    expected = logits(hf_vit().double(), x)
    assert relative_diff(expected, np.load(tmp_path / "y.npy")) <= EXACT


def test_hf_program_with_a_malicious_sample_input_runs_no_code(
    vit_program: Path, tmp_path: Path
) -> None:
    """Reading the output structure adds no unpickling: the safety of load_program stays."""
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt2"
    _rewrite(vit_program, evil, {"sample_inputs/model.pt": pickle.dumps(_Payload(marker))})
    with contextlib.suppress(Exception):  # torch's loader runs the payload, then fails
        torch.export.load(evil)
    assert marker.exists(), "the file is not malicious after all: the test proves nothing"
    marker.unlink()
    program = load_program(evil)
    assert not marker.exists() and "logits" in (program_output_note(program) or "")


class Structured(nn.Module):
    """A classifier returning ``structure`` around its logits and a hidden state."""

    def __init__(self, structure: str) -> None:
        super().__init__()
        self.structure = structure
        self.norm = edge_un.make_norm("un", 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Any:
        hidden = self.norm(x * 2)
        y = self.head(hidden).mean(1)
        if self.structure == "tuple":
            return y, hidden
        if self.structure == "hidden_first":
            return {"hidden_states": hidden, "logits": y}
        return {"extra": (hidden, {"logits": y, "pooled": hidden.mean(1)})}

    @staticmethod
    def logits(out: Any, structure: str) -> Tensor:
        if structure == "tuple":
            return out[0]
        return out["extra"][1]["logits"] if structure == "nested" else out["logits"]


def _rename_output_type(source: Path, target: Path, new_type: str) -> None:
    """The same archive with its output structure's class renamed to one nobody registered."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for item in old.infolist():
            data = old.read(item)
            if item.filename.endswith("models/model.json"):
                program = json.loads(data)
                root = program["graph_module"]["module_call_graph"][0]["signature"]
                protocol, spec = json.loads(root["out_spec"])
                spec["type"] = new_type
                root["out_spec"] = json.dumps([protocol, spec])
                data = json.dumps(program).encode()
            new.writestr(item, data)


@pytest.mark.parametrize(
    ("structure", "kept"),
    [("tuple", "[0]"), ("hidden_first", "logits"), ("nested", "extra.[1].logits"),
     ("unregistered", "logits")],
)  # fmt: skip
def test_any_output_structure_keeps_the_logits(tmp_path: Path, structure: str, kept: str) -> None:
    returns = "hidden_first" if structure == "unregistered" else structure
    model = randomize_norm_state(Structured(returns), 3).double()
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    path = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(model, (x,)), path)
    if structure == "unregistered":
        _rename_output_type(path, tmp_path / "u.pt2", "somewhere.else.UnknownOutput")
        path = tmp_path / "u.pt2"
        with pytest.raises(RuntimeError, match="deserializing"):
            torch.export.load(path)  # what a user sees without edge-un
    program = load_program(path)
    note = program_output_note(program)
    assert note is not None and repr(kept) in note
    folded, report = fold_norms(program)
    assert note in report.notes
    assert relative_diff(Structured.logits(model(x), returns), folded(x)) <= EXACT
    assert actions(report) == {"norm": "folded_forward"}


def test_hf_program_folds_like_the_live_model(vit_program: Path, tmp_path: Path) -> None:
    """Every norm of the .pt2 folds (cls pooling by aten.select does not block the final one)."""
    program = load_program(vit_program)
    folded, report = fold_norms(program)
    assert set(actions(report).values()) == {"folded_forward"} and len(report.norms) == 9
    assert report.norms[-1].into == ("classifier",)
    x = images(4, torch.float64)
    assert relative_diff(logits(hf_vit().double(), x), folded(x)) <= EXACT


def test_folded_hf_program_exports_without_gather(tmp_path: Path) -> None:
    """``[:, 0, :]`` exports as a Gather; export_onnx writes it as Slice + Squeeze instead."""
    model, x = hf_vit(), images(2)
    path = tmp_path / "vit.pt2"
    torch.export.save(torch.export.export(model, (x,)), path)
    folded, _ = fold_norms(load_program(path))
    info = export_onnx(folded, (x,), tmp_path / "vit.onnx", opset=20, dynamic_batch=False)
    assert "Gather" not in info.op_histogram and info.op_histogram.get("Gelu") == VIT_LAYERS
    assert {"Slice", "Squeeze"} <= set(info.op_histogram)
    assert relative_diff(logits(model, x), ort_run(info.path, x)) <= TOLERANCE


class NormHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = edge_un.make_norm("un", 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(x * 2))


def test_shape_only_uses_do_not_block_a_torch_fold() -> None:
    """A node that reads only the norm output's size (aten.sym_size) does not consume its
    values: the norm still folds, and the size is then read from the norm's input."""
    model = randomize_norm_state(NormHead(), 4).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    tokens = torch.export.Dim("tokens", min=2)
    gm = torch.export.export(model, (x,), dynamic_shapes=({1: tokens},)).module()
    linear = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    norm_out = linear.args[0]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        size = gm.graph.call_function(torch.ops.aten.sym_size.int, (norm_out, 1))
        scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (linear, size))
    output.args = ((scaled,),)
    gm.recompile()
    expected = gm(x)[0]
    report = fold_graph(gm, source="test")
    assert actions(report) == {"norm": "folded_forward"}, str(report)
    assert size.args[0] is not norm_out and size.args[0].op == "call_function"  # x * 2
    assert relative_diff(expected, gm(x)[0]) <= EXACT


# -- 2. ONNX from both exporters, opsets 17 to 21 ------------------------------------------------


@pytest.fixture(scope="module")
def hf_vit_onnx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF ViT as torch writes it: dynamo with defaults (opset 20, native Gelu, weights in
    vit.onnx.data) and legacy at opset 17 with a dynamic batch (Erf, Shape nodes)."""
    root = tmp_path_factory.mktemp("hf_vit_onnx")
    model, x = hf_vit(), images()
    (root / "dynamo").mkdir()
    (root / "legacy").mkdir()
    return {
        "dynamo": quietly_export(model, (x,), root / "dynamo" / "vit.onnx"),
        "legacy": legacy_export(
            model, (x,), root / "legacy" / "vit.onnx", ["pixel_values"], opset_version=17
        ),
    }


@pytest.mark.parametrize("source", ["dynamo", "legacy"])
def test_hf_vit_onnx_folds_every_norm(hf_vit_onnx: dict[str, Path], source: str) -> None:
    """All 9 norms fold, through the legacy exporter's Shape nodes too; the cls Gather is a
    Slice + Squeeze; the result has no external data; ORT gives the torch logits."""
    path = hf_vit_onnx[source]
    before = op_histogram(onnx.load(str(path), load_external_data=False))
    folded, report = fold_onnx(path)
    assert set(actions(report).values()) == {"folded_forward"} and len(report.norms) == 9, str(
        report
    )
    assert report.norms[0].name == "vit.layers.0.layernorm_before"
    assert report.norms[-1].into == ("classifier",)
    after = op_histogram(folded)
    assert after.get("Gather", 0) == before["Gather"] - 1  # only shape arithmetic keeps Gathers
    assert after["Slice"] == before.get("Slice", 0) + 1 and after["Squeeze"] == 1
    if source == "legacy":
        assert after["Shape"] == before["Shape"] > 0  # kept, reading the norms' inputs now
    assert not any(t.data_location == TensorProto.EXTERNAL for t in folded.graph.initializer)
    x = images()  # the dynamo export as users call it has a static batch
    assert relative_diff(logits(hf_vit(), x), ort_run(folded, x)) <= TOLERANCE


def test_dynamo_default_writes_external_data_and_loads(
    hf_vit_onnx: dict[str, Path], tmp_path: Path
) -> None:
    path = hf_vit_onnx["dynamo"]
    assert (path.parent / "vit.onnx.data").is_file()  # what torch 2.13 does by default
    moved = tmp_path / "weights"
    moved.mkdir()
    (moved / "vit.onnx.data").write_bytes((path.parent / "vit.onnx.data").read_bytes())
    (tmp_path / "vit.onnx").write_bytes(path.read_bytes())
    with pytest.raises(NotAnOnnxModelError, match=r"'vit\.onnx\.data'.*does not exist"):
        load_onnx(tmp_path / "vit.onnx")
    model = load_onnx(tmp_path / "vit.onnx", data_dir=moved)
    x = images()
    assert relative_diff(torch.from_numpy(ort_run(path, x)), ort_run(model, x)) <= 1e-6
    folded, _ = fold_onnx(model)
    onnx.save_model(folded, str(tmp_path / "folded.onnx"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folded.onnx", "vit.onnx", "weights"]


@pytest.mark.parametrize("source", ["dynamo", "legacy"])
@pytest.mark.parametrize("opset", [17, 18, 19, 20, 21])
def test_opsets_17_to_21_both_ways(hf_vit_onnx: dict[str, Path], source: str, opset: int) -> None:
    """Gelu (opset 20 from dynamo) goes down as its Erf formula; the legacy exporter's Erf
    pattern (opset 17) comes up as one Gelu node (TFLite's builtin GELU, not Flex Erf)."""
    folded, _ = fold_onnx(hf_vit_onnx[source])
    converted = convert_opset(folded, opset)
    onnx.checker.check_model(converted, full_check=True)
    assert next(o.version for o in converted.opset_import if o.domain in ("", "ai.onnx")) == opset
    ops = op_histogram(converted)
    if opset >= 20:
        assert ops.get("Gelu") == VIT_LAYERS and "Erf" not in ops, ops
    else:
        assert ops.get("Erf") == VIT_LAYERS and "Gelu" not in ops, ops
    x = images()
    assert relative_diff(torch.from_numpy(ort_run(folded, x)), ort_run(converted, x)) <= 1e-6


class TanhGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def test_tanh_gelu_lowers_to_its_formula(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = TanhGelu().eval(), torch.randn(4, 6) * 3
    path = quietly_export(model, (x,), tmp_path / "tanh.onnx", opset_version=20,
                          external_data=False)  # fmt: skip
    gelu = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "Gelu")
    assert helper.get_attribute_value(gelu.attribute[0]) == b"tanh"
    lowered = convert_opset(load_onnx(path), 18)
    ops = op_histogram(lowered)
    assert "Gelu" not in ops and ops["Tanh"] == 1 and "Erf" not in ops
    assert relative_diff(model(x), ort_run(lowered, x)) <= 1e-6


def erf_gelu_graph(grouping: str, argument: str, half: float = 0.5) -> onnx.ModelProto:
    """x -> MatMul -> GELU written out as Erf, in one of the forms exporters write."""
    rng = np.random.default_rng(0)
    scale = ("Div", 2**0.5) if argument == "div" else ("Mul", 2**-0.5)
    inits = [numpy_helper.from_array(rng.normal(size=(5, 5)).astype(np.float32), "w")] + [
        numpy_helper.from_array(np.array(v, dtype=np.float32), n)
        for n, v in (("c", scale[1]), ("one", 1.0), ("half", half))
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node(scale[0], ["h", "c"], ["s"]),
        helper.make_node("Erf", ["s"], ["e"]),
        helper.make_node("Add", ["one", "e"], ["a"]),
    ]
    nodes += {
        "(x*a)*0.5": [helper.make_node("Mul", ["h", "a"], ["m"]),
                      helper.make_node("Mul", ["m", "half"], ["y"])],
        "x*(a*0.5)": [helper.make_node("Mul", ["half", "a"], ["m"]),
                      helper.make_node("Mul", ["h", "m"], ["y"])],
        "(x*0.5)*a": [helper.make_node("Mul", ["h", "half"], ["m"]),
                      helper.make_node("Mul", ["a", "m"], ["y"])],
    }[grouping]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


@pytest.mark.parametrize("grouping", ["(x*a)*0.5", "x*(a*0.5)", "(x*0.5)*a"])
@pytest.mark.parametrize("argument", ["div", "mul"])
def test_erf_patterns_fuse_into_one_gelu(grouping: str, argument: str) -> None:
    model = erf_gelu_graph(grouping, argument)
    fused = rewrite_model(model, fuse_erf_gelu)
    onnx.checker.check_model(fused, full_check=True)
    assert op_histogram(fused) == {"MatMul": 1, "Gelu": 1}
    assert [o.name for o in fused.graph.output] == ["y"]
    x = torch.from_numpy(np.random.default_rng(1).normal(size=(7, 5)).astype(np.float32) * 3)
    assert relative_diff(torch.from_numpy(ort_run(model, x)), ort_run(fused, x)) <= 1e-6
    not_gelu = erf_gelu_graph(grouping, argument, half=0.6)
    assert rewrite_model(not_gelu, fuse_erf_gelu) is not_gelu  # unchanged


# -- 3. external data: every location checked ----------------------------------------------------


def _with_reference(source: Path, target_dir: Path, **fields: str) -> Path:
    """A copy of ``source`` (and its data file) whose first external tensor points elsewhere."""
    target_dir.mkdir(exist_ok=True)
    (target_dir / "vit.onnx.data").write_bytes((source.parent / "vit.onnx.data").read_bytes())
    model = onnx.load(str(source), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL)
    entries = {e.key: e.value for e in tensor.external_data} | fields
    del tensor.external_data[:]
    for key, value in entries.items():
        tensor.external_data.add(key=key, value=value)
    path = target_dir / "vit.onnx"
    path.write_bytes(model.SerializeToString())
    return path


BAD_REFERENCES = {
    "parent": ({"location": "../vit.onnx.data"}, "not a plain file name"),
    "absolute": ({"location": "{outside}"}, "not a plain file name"),
    "subdirectory": ({"location": "sub/vit.onnx.data"}, "not a plain file name"),
    "backslash": ({"location": "..\\vit.onnx.data"}, "not a plain file name"),
    "missing": ({"location": "missing.data"}, "does not exist"),
    "symlink out": ({"location": "link.data"}, "leads out of"),
    "offset past the end": ({"offset": "{size}"}, "bytes"),
    "length past the end": ({"length": "{size}"}, "bytes"),
    "negative offset": ({"offset": "-4"}, "bytes"),
    "wrong length": ({"length": "4"}, "the tensor needs"),
}


@pytest.mark.parametrize("case", BAD_REFERENCES)
def test_bad_external_data_is_refused_naming_it(
    hf_vit_onnx: dict[str, Path], tmp_path: Path, case: str
) -> None:
    outside = tmp_path / "outside.data"
    outside.write_bytes((hf_vit_onnx["dynamo"].parent / "vit.onnx.data").read_bytes())
    (tmp_path / "vit.onnx.data").write_bytes(outside.read_bytes())  # ../vit.onnx.data exists
    size = str(outside.stat().st_size)
    fields, problem = BAD_REFERENCES[case]
    fields = {k: v.format(outside=outside, size=size) for k, v in fields.items()}
    path = _with_reference(hf_vit_onnx["dynamo"], tmp_path / "model", **fields)
    (path.parent / "sub").mkdir()
    (path.parent / "sub" / "vit.onnx.data").write_bytes(outside.read_bytes())
    (path.parent / "link.data").symlink_to(outside)
    for load in (load_onnx, fold_onnx):
        with pytest.raises(NotAnOnnxModelError) as error:
            load(path)
        message = str(error.value)
        assert "\n" not in message and problem in message, message
        location = fields.get("location", "vit.onnx.data")
        assert repr(location) in message and message.startswith("vit.onnx: ")


def test_symlink_inside_the_directory_is_fine(hf_vit_onnx: dict[str, Path], tmp_path: Path) -> None:
    path = _with_reference(hf_vit_onnx["dynamo"], tmp_path, location="alias.data")
    (tmp_path / "alias.data").symlink_to(tmp_path / "vit.onnx.data")
    x = images()
    expected = torch.from_numpy(ort_run(hf_vit_onnx["dynamo"], x))
    assert relative_diff(expected, ort_run(load_onnx(path), x)) <= 1e-6


# -- 4. post-norm HF BERT: two inputs, one Mul + Add per norm that cannot fold --------------------


@pytest.fixture(scope="module")
def bert_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bert")
    model, args = hf_bert(), text()
    names = ["input_ids", "attention_mask"]
    batch = torch.export.Dim("batch")
    program = torch.export.export(model.double(), args, dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, root / "bert.pt2")
    model.float()
    for sub in ("dynamo", "legacy", "legacy18"):
        (root / sub).mkdir()
    return {
        "pt2": root / "bert.pt2",
        "dynamo": quietly_export(model, args, root / "dynamo" / "bert.onnx", input_names=names),
        "legacy": legacy_export(model, args, root / "legacy" / "bert.onnx", names,
                                opset_version=17),
        "legacy18": legacy_export(model, args, root / "legacy18" / "bert.onnx", names,
                                  opset_version=18),
    }  # fmt: skip


def test_bert_program_keeps_post_norms_as_one_mul_add(bert_files: dict[str, Path]) -> None:
    program = load_program(bert_files["pt2"])
    assert "SequenceClassifierOutput" in (program_output_note(program) or "")
    folded, report = fold_norms(program)
    assert actions(report) == BERT_EXPECTED, str(report)
    embeddings, pooled = report.folded
    tables = {f"bert.embeddings.{kind}_embeddings" for kind in ("word", "position", "token_type")}
    assert set(embeddings.into) == tables, str(report)
    assert pooled.into == ("bert.pooler.dense",)
    for norm in report.kept:
        assert "another tensor" in norm.reason, norm  # the residual Add
        ops = sorted(str(n.target) for n in folded.graph.nodes if _in_module(n, norm.name))
        assert ops == ["aten.add.Tensor", "aten.mul.Tensor"], (norm.name, ops)
    ids, mask = text(5)
    model = hf_bert().double()
    assert relative_diff(logits(model, ids, mask), folded(ids, mask)) <= EXACT


def _in_module(node: torch.fx.Node, path: str) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return node.op == "call_function" and bool(stack) and list(stack.values())[-1][0] == path


@pytest.mark.parametrize("source", ["dynamo", "legacy", "legacy18"])
def test_bert_onnx_keeps_post_norms_as_one_mul_add(
    bert_files: dict[str, Path], source: str
) -> None:
    folded, report = fold_onnx(bert_files[source])
    assert actions(report) == BERT_EXPECTED, str(report)
    embeddings, pooled = report.folded
    # the position (and, exported without token types, the type) rows are constants by then
    assert "bert.embeddings.word_embeddings" in embeddings.into, str(report)
    assert pooled.into == ("bert.pooler.dense",)
    assert all("another tensor" in norm.reason for norm in report.kept), str(report)
    assert kept_as_one_mul_add(folded, channels=16) == len(report.kept)
    ids, mask = text()  # static batch in the dynamo export
    expected = logits(hf_bert(), ids, mask)
    assert relative_diff(expected, ort_run(folded, ids, mask)) <= TOLERANCE
    for opset in (17, 20):  # TIDL's and the TFLite route's
        converted = convert_opset(folded, opset)
        assert relative_diff(expected, ort_run(converted, ids, mask)) <= TOLERANCE
        assert ("Gelu" in op_histogram(converted)) == (opset >= 20)
