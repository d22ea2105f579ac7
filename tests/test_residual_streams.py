"""Residual streams (quant.ort.pow2.residual_streams) and their factors on the power-of-two grid
(quant.ort.pow2.grid): which tensors scale together, that scaling them leaves the fp32 model's
outputs as they were, what is refused, and that the search lowers the int8 logits' error of a
real model on data it never saw.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_un import examples
from quant.deadline import Deadline
from quant.measure.drift import onnx_runner
from quant.measure.saved_tensors import SavedTensors
from quant.ort.pow2 import grid as pow2_grid
from quant.ort.pow2.grid import FACTORS, align_streams, significantly_lower
from quant.ort.pow2.residual_streams import find_streams, scale_stream
from quant.ort.quantize import quantize_onnx
from quant.pipeline import convert
from quant.samples import CALIBRATION_SAMPLES, Samples, checkpoint_samples
from quant.targets import PROFILES
from quant.targets.rules import check_onnx_artifact

WIDTH, HIDDEN, CLASSES = 8, 16, 3
TDA4VM = PROFILES["tda4vm"]


def block_graph(extra_nodes=(), extra_outputs=(), head_weight="w_head") -> onnx.ModelProto:
    """x -> embed (Linear) -> h; h + MLP(h) -> r; head(r) -> logits: a one-block residual net,
    with ``extra_nodes`` reading its tensors."""
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "w_embed"], ["embed_mm"]),
        helper.make_node("Add", ["embed_mm", "b_embed"], ["h"]),
        helper.make_node("MatMul", ["h", "w1"], ["fc1_mm"]),
        helper.make_node("Add", ["fc1_mm", "b1"], ["fc1"]),
        helper.make_node("Relu", ["fc1"], ["act"]),
        helper.make_node("MatMul", ["act", "w2"], ["fc2_mm"]),
        helper.make_node("Add", ["fc2_mm", "b2"], ["fc2"]),
        helper.make_node("Add", ["h", "fc2"], ["r"]),  # the residual Add
        *extra_nodes,
        helper.make_node("MatMul", ["r", head_weight], ["head_mm"]),
        helper.make_node("Add", ["head_mm", "b_head"], ["logits"]),
    ]
    initializers = [
        weight("w_embed", WIDTH, WIDTH), weight("b_embed", WIDTH), weight("w1", WIDTH, HIDDEN),
        weight("b1", HIDDEN), weight("w2", HIDDEN, WIDTH), weight("b2", WIDTH),
        weight("w_head", WIDTH, CLASSES), weight("b_head", CLASSES),
    ]  # fmt: skip
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
               for name in ("logits", *extra_outputs)]  # fmt: skip
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, WIDTH])],
        outputs, initializers,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_a_residual_block_scales_as_one_stream_and_its_outputs_stay() -> None:
    model = block_graph()
    (stream,) = find_streams(model)
    assert stream.seed == "r"
    assert stream.tensors == {"embed_mm", "h", "fc2_mm", "fc2", "r"}
    # writers x c, readers / c; a weight both sides of the stream would be 0 and is left out
    assert dict(stream.powers) == {"w_embed": 1, "b_embed": 1, "w2": 1, "b2": 1, "w1": -1,
                                   "w_head": -1}  # fmt: skip
    x = np.random.default_rng(1).normal(size=(5, WIDTH)).astype(np.float32)
    scaled = onnx.ModelProto()
    scaled.CopyFrom(model)
    scale_stream(scaled, stream, 1.5)
    np.testing.assert_allclose(run(scaled, x)[0], run(model, x)[0], rtol=1e-5, atol=1e-5)
    inner = block_graph(extra_outputs=("r", "fc1"))
    scaled_inner = onnx.ModelProto()
    scaled_inner.CopyFrom(inner)
    scale_stream(scaled_inner, stream, 1.5)
    (r, fc1), (scaled_r, scaled_fc1) = run(inner, x)[1:], run(scaled_inner, x)[1:]
    np.testing.assert_allclose(scaled_r, 1.5 * r, rtol=1e-5)  # the stream moved by the factor
    np.testing.assert_allclose(scaled_fc1, fc1, rtol=1e-5, atol=1e-6)  # the MLP inside did not


@pytest.mark.parametrize(
    "nodes, outputs, head, why",
    [
        ([helper.make_node("Softmax", ["r"], ["probs"])], ("probs",), "w_head",
         "a Softmax does not commute with a factor"),
        ([], ("r",), "w_head", "a graph output's scale is the user's"),
        ([helper.make_node("MatMul", ["h", "w_embed"], ["again"])], ("again",), "w_head",
         "the embedding's weight is shared with a node that would see it scaled"),
        ([helper.make_node("Transpose", ["r"], ["rt"]),
          helper.make_node("MatMul", ["r", "rt"], ["gram"])], ("gram",), "w_head",
         "a product of two stream tensors scales by the factor squared"),
    ],
)  # fmt: skip
def test_a_stream_that_reaches_a_nonlinear_or_shared_use_is_not_scaled(
    nodes, outputs, head, why
) -> None:
    assert find_streams(block_graph(nodes, outputs, head)) == [], why


def test_a_shape_read_of_the_stream_does_not_stop_it() -> None:
    """The legacy exporter reads shapes of stream tensors for its reshapes."""
    shape = [helper.make_node("Shape", ["r"], ["r_shape"])]
    (stream,) = find_streams(block_graph(shape, ("r_shape",)))
    assert "r" in stream.tensors and "r_shape" not in stream.tensors


def test_a_product_with_a_tensor_outside_the_stream_carries_it_through() -> None:
    """Masked mean pooling, as the text models do it: (mask @ r) / count, then the head."""
    pooled = [
        helper.make_node("Mul", ["x", "x"], ["mask"]),  # computed from the input, not the stream
        helper.make_node("MatMul", ["mask", "r"], ["pooled_sum"]),
        helper.make_node("ReduceSum", ["x"], ["count"], keepdims=1),
        helper.make_node("Div", ["pooled_sum", "count"], ["pooled"]),
        helper.make_node("MatMul", ["pooled", "w_pool"], ["pool_mm"]),
    ]
    model = block_graph(pooled, ("pool_mm",))
    square = numpy_helper.from_array(np.eye(WIDTH, dtype=np.float32), "w_pool")
    model.graph.initializer.append(square)
    # "mask" is x * x (batch x WIDTH) and r is (batch x WIDTH): mask @ r needs batch == WIDTH
    (stream,) = find_streams(model)
    assert {"pooled_sum", "pooled"} <= stream.tensors
    assert dict(stream.powers)["w_pool"] == -1
    x = np.random.default_rng(2).normal(size=(WIDTH, WIDTH)).astype(np.float32)
    scaled = onnx.ModelProto()
    scaled.CopyFrom(model)
    scale_stream(scaled, stream, 1.25)
    for before, after in zip(run(model, x), run(scaled, x), strict=True):
        np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def vit(vit_onnx: dict) -> dict:
    """The bundled UN ViT's tda4vm export and the pipeline's calibration draw (256 samples)."""
    info = vit_onnx["fp32"].folded.info
    calibration = checkpoint_samples(info, "train", CALIBRATION_SAMPLES)
    return {**vit_onnx, "fp32_path": vit_onnx["fp32"]["tda4vm"], "calibration": calibration}


def quantizer(calibration: Samples):
    def quantize(fp32: Path, out: Path) -> Path:
        return quantize_onnx(fp32, out, TDA4VM.int8_recipes[0], calibration)

    return quantize


def test_the_bundled_vit_has_one_stream_whose_scaling_changes_no_output(vit: dict) -> None:
    model = onnx.load(str(vit["fp32_path"]))
    (stream,) = find_streams(model)  # the embedding, every block's two writes and the head
    scale_stream(model, stream, FACTORS[5])
    scaled = vit["dir"] / "scaled.onnx"
    onnx.save_model(model, str(scaled))
    samples = vit["evaluation"].head(64)
    before, after = (onnx_runner(path)(samples.feeds) for path in (vit["fp32_path"], scaled))
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4)
    one = samples.head(1).feeds  # the tda4vm file's static batch
    seed = SavedTensors(scaled, vit["dir"] / "augmented.onnx")(one, [stream.seed])
    original = SavedTensors(vit["fp32_path"], vit["dir"] / "augmented0.onnx")
    unscaled = original(one, [stream.seed])[stream.seed]
    np.testing.assert_allclose(seed[stream.seed], FACTORS[5] * unscaled, rtol=1e-4, atol=1e-4)


def test_a_factor_is_kept_only_for_a_gain_beyond_the_samples_noise() -> None:
    rng = np.random.default_rng(0)
    baseline = rng.exponential(1.0, 256)  # per-sample errors: heavy-tailed, as logits' are
    assert significantly_lower(0.8 * baseline, baseline)  # every sample better by 20 %
    noisy = baseline * rng.uniform(0.5, 1.4, 256)  # 5 % lower on average, sample by sample noise
    assert noisy.mean() < baseline.mean() and not significantly_lower(noisy, baseline)
    assert not significantly_lower(baseline, baseline)


def test_the_chosen_factor_lowers_the_held_out_logits_error(vit: dict) -> None:
    """The search sees the 256 calibration samples; the whole test split (1000) judges it."""
    scaled = vit["dir"] / "searched.onnx"
    grid = align_streams(vit["fp32_path"], scaled, quantizer(vit["calibration"]),
                         vit["calibration"])  # fmt: skip
    (found,) = grid.factors
    assert grid.note is None and grid.scaled and found.factor in FACTORS[1:]
    assert found.error < found.error_at_one
    test = vit["test"]
    reference = onnx_runner(vit["fp32_path"])(test.feeds)
    errors = {}
    for name, fp32 in (("unscaled", vit["fp32_path"]), ("scaled", scaled)):
        int8 = quantizer(vit["calibration"])(fp32, vit["dir"] / f"{name}_int8.onnx")
        check_onnx_artifact(int8, TDA4VM)  # TIDL's rules: symmetric s8, powers of two
        logits = onnx_runner(int8, exact=True)(test.feeds)
        errors[name] = float(np.mean(np.square(logits - reference)))
    assert errors["scaled"] < 0.95 * errors["unscaled"], errors


def test_no_search_past_the_deadline_or_over_the_budget(vit: dict, monkeypatch) -> None:
    out = vit["dir"] / "not_written.onnx"
    late = align_streams(vit["fp32_path"], out, quantizer(vit["calibration"]),
                         vit["calibration"], Deadline(0.0))  # fmt: skip
    assert late.factors == () and "time ran out" in late.note and not out.exists()
    # the bundled ViT's search: 8 candidates x 256 samples x 7.7 M multiply-adds, 1.6e10
    monkeypatch.setattr(pow2_grid, "MAX_SEARCH_MULTIPLY_ADDS", 1e10)
    large = align_streams(vit["fp32_path"], out, quantizer(vit["calibration"]),
                          vit["calibration"])  # fmt: skip
    assert large.factors == () and "would compute 1.6e+10 multiply-adds" in large.note
    assert not out.exists()


def test_convert_builds_a_callers_own_profile_as_given(tmp_path: Path) -> None:
    """The target's build runs in a process of its own: the profile it gets is the caller's,
    not the stock one of the same name."""
    plain = replace(TDA4VM, stream_factors=False)
    report = convert(examples.path("vit-mnist-un"), [plain], out_dir=tmp_path, latency_runs=2)
    target = report.targets["tda4vm"]
    assert target.status == "ok" and target.stream_factors == []
    assert target.int8_recipe == plain.recipe and "residual streams" not in target.int8_recipe
