"""quant.sources: the module of the user's model behind a graph's tensor names.

On hand-made graphs (each way a file records modules, and the neighbour rule for nodes that
record none), and on the bundled text example's real export: every node gets its module, the
attention softmax is ``blocks.N.attn.softmax`` and a Linear's MatMul is its own path. The worst
layers of a whole conversion (ONNX and TFLite) are checked in tests/test_report_html.py, on the
conversion it makes anyway.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import onnx
import pytest
from onnx import helper

from quant.sources import (
    CLASS_HIERARCHY,
    NAME_SCOPES,
    NAMESPACE,
    Source,
    derived_sources,
    infer,
    onnx_sources,
    placed_ops,
    program_module_paths,
    scoped_sources,
)


def node(op: str, inputs: list[str], output: str, name: str = "", **metadata: str):
    made = helper.make_node(op, inputs, [output], name=name or f"node_{output}")
    for key, value in metadata.items():
        entry = made.metadata_props.add()
        entry.key, entry.value = key, value
    return made


def dynamo(scopes: list[str], classes: list[str]) -> dict[str, str]:
    return {NAME_SCOPES: repr(scopes), CLASS_HIERARCHY: repr(classes)}


def model(*nodes) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "g", [], [])
    return helper.make_model(graph)


def test_each_way_a_file_records_its_modules() -> None:
    linear = [
        "Model",
        "Block",
        "Attention",
        "torch.nn.modules.linear.Linear",
        "aten.linear.default",
    ]
    sources = onnx_sources(model(
        node("MatMul", ["x", "w"], "val_6",
             **dynamo(["", "blocks.3", "blocks.3.attn", "blocks.3.attn.qkv", "linear"], linear)),
        node("Softmax", ["val_6"], "softmax_3",
             **dynamo(["", "blocks.3", "blocks.3.attn", "softmax_3"],
                      ["Model", "Block", "Attention", "aten.softmax.int"])),
        node("Add", ["softmax_3", "x"], "add",
             **{NAMESPACE: ": Model/blocks.3: Block/add: aten.add.Tensor"}),
        node("Mul", ["add", "x"], "legacy", name="/blocks.3/mlp/Mul"),
        node("Reshape", ["legacy", "s"], "view_2",
             **dynamo(["", "blocks.3", "blocks.3.attn", "_unsafe_view_2"],
                      ["Model", "Block", "Attention", "aten._unsafe_view.default"])),
    ))  # fmt: skip
    assert sources["val_6"] == Source("blocks.3.attn.qkv", "linear", leaf=True)
    assert sources["val_6"].label() == "blocks.3.attn.qkv"  # a Linear is its own path
    assert sources["softmax_3"].label() == "blocks.3.attn.softmax"
    assert sources["add"].label() == "blocks.3.add"
    assert sources["legacy"].label() == "blocks.3.mlp.mul"
    assert sources["view_2"].label() == "blocks.3.attn.view"  # torch's internal variant


def test_a_node_without_a_module_stack_takes_its_neighbours_module() -> None:
    attn = ["Model", "Block", "Attention", "aten.softmax.int"]
    sources = onnx_sources(model(
        node("Softmax", ["x"], "softmax_3",
             **dynamo(["", "blocks.3", "blocks.3.attn", "softmax_3"], attn)),
        node("Reshape", ["softmax_3", "s"], "view_9",  # its own name only: no stack
             **dynamo(["view_9"], ["aten.view.default"])),
        node("MatMul", ["view_9", "v"], "matmul_3",
             **dynamo(["", "blocks.3", "blocks.3.attn", "matmul_3"], attn)),
        node("Relu", ["matmul_3"], "bad",  # metadata no literal can parse: no record, no crash
             **{NAME_SCOPES: "{[1]: 2}", CLASS_HIERARCHY: "-" * 10000 + "1"}),
    ))  # fmt: skip
    assert sources["view_9"] == Source("blocks.3.attn", "reshape", leaf=False)
    assert sources["bad"].label() == "blocks.3.attn.relu"


def test_unrecorded_nodes_take_their_neighbours_module() -> None:
    known = {
        "qkv": Source("blocks.0.attn.qkv", "linear", True),
        "q": Source("blocks.0.attn", "view", False),
        "k": Source("blocks.0.attn", "view", False),
    }
    graph = [
        ("Split", ["qkv"], ["s0", "s1"]),  # between the qkv Linear and the attention's views
        ("Reshape", ["s0"], ["q"]),
        ("Reshape", ["s1"], ["k"]),
        ("Transpose", ["k"], ["t1"]),  # a chain of two unrecorded nodes
        ("Transpose", ["t1"], ["t2"]),
        ("Cast", ["input"], ["lonely"]),  # nothing recorded anywhere near
    ]
    found = infer(graph, known)
    assert found["s0"].label() == found["s1"].label() == "blocks.0.attn.split"
    assert found["t1"].label() == found["t2"].label() == "blocks.0.attn.transpose"
    assert "lonely" not in found
    assert infer(graph, {}) == {}  # a file that records nothing gets no names
    # a derived graph (renamed tensors, inserted ops) and the ops a target leaves to the CPU
    tflite = [("FULLY_CONNECTED", ["x"], ["fc;add"]), ("SPLIT", ["fc;add"], ["sp0", "sp1"]),
              ("RESHAPE", ["sp0"], ["rq"]), ("RESHAPE", ["sp1"], ["rk"])]  # fmt: skip
    renamed = {"fc;add": "qkv", "rq": "q", "rk": "k"}
    derived = derived_sources(tflite, known, renamed)
    assert derived["sp0"].label() == "blocks.0.attn.split"
    assert placed_ops(tflite, derived, {"SPLIT"}) == [("SPLIT", "sp0", "blocks.0.attn.split")]


@pytest.fixture(scope="module")
def text_export(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    from converters.fold_and_export import export_folded, load_and_fold
    from edge_un import examples

    path = tmp_path_factory.mktemp("sources") / "text.onnx"
    export_folded(load_and_fold(examples.path("text-rt-un")), path, opset=20, dynamic_batch=False)
    return onnx.load(str(path))


def test_every_node_of_a_real_export_names_its_module(text_export) -> None:
    sources = onnx_sources(text_export)
    outputs = [out for n in text_export.graph.node for out in n.output if out]
    assert outputs and all(out in sources for out in outputs), set(outputs) - set(sources)
    softmaxes = [sources[n.output[0]].label() for n in text_export.graph.node
                 if n.op_type == "Softmax"]  # fmt: skip
    assert softmaxes[:2] == ["blocks.0.attn.softmax", "blocks.1.attn.softmax"], softmaxes
    matmuls = {sources[n.output[0]].label() for n in text_export.graph.node if n.op_type == "MatMul"
               and n.input[1] in {i.name for i in text_export.graph.initializer}}  # fmt: skip
    assert "blocks.0.attn.qkv" in matmuls and "blocks.0.mlp.fc1" in matmuls


def program_node(*stack: tuple[str, str]) -> SimpleNamespace:
    """A torch program's node as far as its module stack goes: (path, class) from the root."""
    return SimpleNamespace(meta={"nn_module_stack": {f"k{i}": e for i, e in enumerate(stack)}})


def test_litert_torch_scopes_name_the_module_paths() -> None:
    """litert-torch's names keep each module's class and last attribute (``Block_3``), not the
    container (``blocks``): the program's own stacks give the path back, a wrapper's attribute
    dropped; a chain two modules share names neither and falls back to the scopes alone."""
    root, block, attn = ("", "Wrapper"), "m.Block", "m.Attention"
    nodes = [
        program_node(root, ("model.blocks.3", block)),
        program_node(root, ("model.blocks.3", block), ("model.blocks.3.attn", attn)),
        program_node(root, ("model.enc.0", block)),
        program_node(root, ("model.dec.0", block)),
    ]
    paths = program_module_paths(nodes, drop="model.")
    assert paths == {f"{block}_3": "blocks.3", f"{block}_3/{attn}_attn": "blocks.3.attn"}
    graph = [
        ("SOFTMAX", [], [f"Wrapper/{block}_3/{attn}_attn;2"]),
        ("ADD", [], [f"Wrapper/{block}_0;1"]),
        ("MUL", [], ["Converter/Wrapper/m.Block_3;;other"]),  # a converter's own wrapper
        ("SLICE", [], ["Wrapper;4"]),
    ]
    labels = {name: s.label() for name, s in scoped_sources(graph, paths).items()}
    assert labels == {
        f"Wrapper/{block}_3/{attn}_attn;2": "blocks.3.attn.softmax",
        f"Wrapper/{block}_0;1": "Block[0].add",
        "Converter/Wrapper/m.Block_3;;other": "blocks.3.mul",
        "Wrapper;4": "slice",
    }
    assert scoped_sources(graph)[graph[0][2][0]].label() == "Block[3].attn.softmax"


def test_the_target_builders_load_no_torch() -> None:
    """quant.sources takes its metadata keys from converters (converters.onnx_metadata), yet runs
    in every target's builder process, which must not pay for torch: a fresh interpreter that
    imports both builders has loaded neither torch nor onnx_ir."""
    code = (
        "import sys, quant.ort.target, quant.tflite.target\n"
        "print(sorted({'torch', 'onnx_ir'} & set(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.stdout.splitlines()[-1:] == ["[]"], result.stdout + result.stderr
