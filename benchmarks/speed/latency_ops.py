"""Operation counts and peak graphs for benchmarks.speed.latency: model MACs from an ONNX graph,
and the large matrix products that measure this machine's fp32 and int8 peak."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from converters.opset import with_static_batch

PEAK_SIZE = 1024


def count_macs(path: Path) -> int:
    """Multiply-accumulates of one batch-1 inference: MatMul, Gemm and Conv, from the shapes."""
    model = with_static_batch(onnx.load(str(path)))
    shapes = {}
    for value in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = [d.dim_value for d in dims]
    for init in model.graph.initializer:
        shapes[init.name] = list(init.dims)
    macs = 0
    for node in model.graph.node:
        out = shapes.get(node.output[0])
        if node.op_type not in ("MatMul", "Gemm", "Conv") or not out or 0 in out:
            continue
        if node.op_type == "Conv":
            weight = shapes[node.input[1]]
            macs += int(np.prod(out)) * int(np.prod(weight[1:]))
        elif node.op_type == "Gemm":
            a = shapes[node.input[0]]
            trans = next((attr.i for attr in node.attribute if attr.name == "transA"), 0)
            macs += int(np.prod(out)) * (a[0] if trans else a[1])
        else:
            macs += int(np.prod(out)) * shapes[node.input[0]][-1]
    return macs


def peak_graphs(work: Path) -> dict[str, tuple[Path, Path, str]]:
    """1024^3 matrix products with constant weights: fp32 MatMul, u8 x s8 MatMulInteger and
    QLinearMatMul (ORT's fast int8 path on x86: u8 activations, s8 weights)."""
    n, rng = PEAK_SIZE, np.random.default_rng(0)
    work.mkdir(parents=True, exist_ok=True)
    graphs: dict[str, tuple[Path, Path, str]] = {}

    def save(
        name: str, nodes: list, inits: list, a: np.ndarray, a_type: int, out_type: int, dtype: str
    ) -> None:
        graph = helper.make_graph(
            nodes,
            name,
            [helper.make_tensor_value_info("A", a_type, [1, n, n])],
            [helper.make_tensor_value_info("Y", out_type, [1, n, n])],
            inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
        path, inputs = work / f"{name}.onnx", work / f"{name}.npy"
        onnx.save_model(model, str(path))
        np.save(inputs, a)
        graphs[name] = (path, inputs, dtype)

    const = numpy_helper.from_array
    w8 = rng.integers(-127, 128, (n, n), dtype=np.int8)
    a8 = rng.integers(0, 256, (1, n, n), dtype=np.uint8)
    save(
        "fp32 MatMul",
        [helper.make_node("MatMul", ["A", "B"], ["Y"])],
        [const(rng.standard_normal((n, n), dtype=np.float32), "B")],
        rng.standard_normal((1, n, n), dtype=np.float32),
        TensorProto.FLOAT,
        TensorProto.FLOAT,
        "fp32",
    )
    save(
        "int8 MatMulInteger",
        [helper.make_node("MatMulInteger", ["A", "B", "az", "bz"], ["Y"])],
        [const(w8, "B"), const(np.array(128, np.uint8), "az"), const(np.array(0, np.int8), "bz")],
        a8,
        TensorProto.UINT8,
        TensorProto.INT32,
        "int8",
    )
    save(
        "int8 QLinearMatMul",
        [helper.make_node("QLinearMatMul", ["A", "as", "az", "B", "bs", "bz", "ys", "yz"], ["Y"])],
        [
            const(w8, "B"),
            const(np.array(0.02, np.float32), "as"),
            const(np.array(128, np.uint8), "az"),
            const(np.array(0.01, np.float32), "bs"),
            const(np.array(0, np.int8), "bz"),
            const(np.array(1.0, np.float32), "ys"),
            const(np.array(128, np.uint8), "yz"),
        ],
        a8,
        TensorProto.UINT8,
        TensorProto.UINT8,
        "int8",
    )
    return graphs
