"""The power-of-two scale search (TIDL's simple calibration): which candidate wins, and what the
report records of it.

The search runs over the powers of two at and below each MinMax scale's ceiling, not only the two
around it: a tensor whose MinMax range is set by a rare outlier (attention scores) quantizes with
less error when more of its tail is clipped. Here the numbers are small enough to check by hand.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from converters.attention_masks import MASK_PENALTY
from quant.ort.pow2.record import recorded_choices, scale_choices
from quant.ort.pow2.scales import (
    SOFTMAX_FLOOR,
    best_power_of_two,
    fp32_constants,
    masked_softmax_inputs,
    power_of_two_candidates,
    smallest_error,
    softmax_visible_error,
    squared_error,
)
from quant.ort.quantize import preprocess_for_quantization, quantize_onnx
from quant.samples import Samples, as_feeds
from quant.targets import PROFILES, TargetProfile

INT8 = np.dtype(np.int8)
ZERO = np.zeros((), np.float64)
COUNT = PROFILES["tda4vm"].power_of_two_candidates  # what tda4vm's search weighs


def _outlier_tensor() -> tuple[np.ndarray, np.ndarray]:
    """200,000 values of a unit normal and one of 33, with the MinMax scale the outlier sets."""
    rng = np.random.default_rng(0)
    real = np.concatenate([rng.standard_normal(200_000), [33.0]]).astype(np.float32)
    return real, np.asarray(np.abs(real).max() / 127, np.float64)


def test_the_candidates_are_the_ceiling_and_the_powers_of_two_below_it() -> None:
    candidates = power_of_two_candidates(np.asarray([0.3, 0.25]), COUNT)
    assert len(candidates) == COUNT
    assert [list(c) for c in candidates[:3]] == [[0.5, 0.25], [0.25, 0.125], [0.125, 0.0625]]


def test_an_outlier_set_range_is_clipped_further_than_one_power_of_two() -> None:
    real, scale = _outlier_tensor()
    ceiling, below = power_of_two_candidates(scale, COUNT)[:2]
    chosen = best_power_of_two(real, scale, ZERO, INT8, COUNT)
    assert chosen == below / 2  # two powers of two under the ceiling (0.5 -> 0.125)
    error = squared_error(real, chosen, ZERO, INT8).item()
    # smaller than either power of two around the MinMax scale, the choice of a 2-way search
    assert error < min(squared_error(real, c, ZERO, INT8).item() for c in (ceiling, below))


def test_a_range_without_an_outlier_keeps_a_scale_next_to_its_minmax_one() -> None:
    real = np.linspace(-100, 100, 2001, dtype=np.float32)  # uniform: clipping only hurts
    scale = np.asarray(100 / 127, np.float64)
    assert best_power_of_two(real, scale, ZERO, INT8, COUNT) == power_of_two_candidates(scale, 2)[0]


def test_equal_errors_choose_the_larger_scale() -> None:
    candidates = (np.asarray([2.0, 2.0]), np.asarray([1.0, 1.0]), np.asarray([0.5, 0.5]))
    errors = (np.asarray([3.0, 5.0]), np.asarray([3.0, 4.0]), np.asarray([4.0, 4.0]))
    assert list(smallest_error(candidates, errors)) == [2.0, 1.0]


def test_the_record_counts_scales_clipped_by_more_than_one_power_of_two() -> None:
    """One activation rounded down two powers of two, one down by one, one up."""
    nodes, initializers = [], []
    for name in ("a", "b", "c"):
        initializers.append(numpy_helper.from_array(np.asarray(0.3, np.float32), f"{name}_scale"))
        nodes.append(helper.make_node("QuantizeLinear", [name, f"{name}_scale"], [f"{name}_q"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in "abc"],
        [helper.make_tensor_value_info(f"{n}_q", TensorProto.UINT8, [1]) for n in "abc"],
        initializers,
    )
    model = helper.make_model(graph)
    minmax = {f"{n}_scale": np.asarray(0.3) for n in "abc"}  # its ceiling: 0.5
    chosen = {"a_scale": np.asarray(0.125), "b_scale": np.asarray(0.25), "c_scale": np.asarray(0.5)}
    records = {r.tensor: r for r in scale_choices(model, minmax, chosen, {"a_scale", "b_scale"})}
    summary = {
        t: (r.channels_up, r.channels_down, r.channels_down_further, r.log2_scale)
        for t, r in records.items()
    }
    assert summary == {"a": (0, 1, 1, -3), "b": (0, 1, 0, -2), "c": (1, 0, 0, -1)}
    assert records["c"].chosen_by == "range" and records["a"].chosen_by == "own error"


def _attention_probabilities(path: Path) -> tuple[Path, np.ndarray]:
    """scores -> Softmax -> p -> p V, and 32 samples of scores whose probabilities are small
    (~1/48) but for one peaked row (0.9), the rare top of a range the op bounds."""
    rng = np.random.default_rng(0)
    shape = [1, 4, 48, 48]
    graph = helper.make_graph(
        [
            helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", "v"], ["y"]),
        ],
        "attention",
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", *shape[1:]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 48, 8])],
        [numpy_helper.from_array(rng.standard_normal((48, 8)).astype(np.float32), "v")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    scores = (0.5 * rng.standard_normal((32, *shape[1:]))).astype(np.float32)
    scores[0, 0, 0, 0] = 8.0
    return path, scores


def test_a_softmax_output_keeps_its_largest_probabilities(tmp_path: Path) -> None:
    """Its own squared error alone would clip the peaked row's 0.9 to an eighth of the range
    for finer steps everywhere else; a Softmax output weighs only the two powers of two
    around its MinMax scale (quant.ort.pow2.scales.BOUNDED_OPS)."""
    fp32, scores = _attention_probabilities(tmp_path / "attention.onnx")
    calibration = Samples(as_feeds(scores), None, "t")
    tda4vm = PROFILES["tda4vm"]
    minmax_profile = replace(tda4vm, power_of_two_scales=False, bias_correction=False)

    def p_scale(profile: TargetProfile, name: str) -> tuple[np.ndarray, Path]:
        path = quantize_onnx(fp32, tmp_path / name, profile, calibration)
        model = onnx.load(str(path))
        values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        (node,) = [
            n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "p"
        ]
        return values[node.input[1]].astype(np.float64), path

    minmax, _ = p_scale(minmax_profile, "minmax.onnx")
    chosen, path = p_scale(tda4vm, "tda4vm.onnx")
    ceiling = power_of_two_candidates(minmax, COUNT)[0]
    probabilities = np.exp(scores - scores.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    alone = best_power_of_two(probabilities, minmax, ZERO, INT8, COUNT)
    assert alone < ceiling / 2  # the squared error alone goes further down
    assert chosen >= ceiling / 2
    (record,) = [r for r in recorded_choices(path) if r.tensor == "p"]
    assert record.channels_down_further == 0


def _padding_mask(ids: str, name: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Where(ids == 0, -30, 0): the additive mask converters.attention_masks leaves in a model
    (made from an integer input and scalars); its nodes and constants."""
    nodes = [
        helper.make_node("Equal", [ids, f"{name}_zero_id"], [f"{name}_padding"]),
        helper.make_node("Where", [f"{name}_padding", f"{name}_penalty", f"{name}_zero"], [name]),
    ]
    constants = [
        numpy_helper.from_array(np.array(0, np.int64), f"{name}_zero_id"),
        numpy_helper.from_array(np.array(MASK_PENALTY, np.float32), f"{name}_penalty"),
        numpy_helper.from_array(np.array(0.0, np.float32), f"{name}_zero"),
    ]
    return nodes, constants


def _masked_attention(path: Path) -> tuple[Path, Samples]:
    """scores + mask -> Softmax -> p V, and 32 samples of unit-normal scores with the last 16 of
    48 keys padding, masked by -30, which sets the Softmax input's MinMax range."""
    rng = np.random.default_rng(0)
    mask, constants = _padding_mask("ids", "mask")
    graph = helper.make_graph(
        [
            *mask,
            helper.make_node("Add", ["scores", "mask"], ["masked"]),
            helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", "v"], ["y"]),
        ],
        "masked_attention",
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", 4, 48, 48]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 1, 1, 48]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 48, 8])],
        [*constants, numpy_helper.from_array(rng.standard_normal((48, 8)).astype(np.float32), "v")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    ids = np.where(np.arange(48) < 32, 7, 0).astype(np.int64).reshape(1, 1, 1, 48)
    feeds = {
        "scores": rng.standard_normal((32, 4, 48, 48)).astype(np.float32),
        "ids": np.repeat(ids, 32, axis=0),
    }
    return path, Samples(feeds, None, "t")


def _softmax_error(real: np.ndarray, scale: np.ndarray) -> float:
    """Squared error of the Softmax (last axis) of ``real`` quantized to s8 with ``scale``."""

    def softmax(x: np.ndarray) -> np.ndarray:
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    quantized = np.clip(np.round(real / scale), -128, 127) * scale
    return float(np.square(softmax(quantized) - softmax(real)).sum())


def test_a_softmax_input_is_judged_as_the_softmax_sees_it(tmp_path: Path) -> None:
    """Its own squared error keeps the mask's -30 in range, at a step coarse for the scores;
    as the Softmax sees it (values 16 below their row's maximum count as equal), the step is
    finer and the penalty clipped no further than the Softmax notices."""
    fp32, calibration = _masked_attention(tmp_path / "attention.onnx")
    path = quantize_onnx(fp32, tmp_path / "tda4vm.onnx", PROFILES["tda4vm"], calibration)
    model = onnx.load(str(path))
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    (node,) = [
        n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "masked"
    ]
    chosen = values[node.input[1]].astype(np.float64)
    masked = calibration.feeds["scores"] + np.where(calibration.feeds["ids"] == 0, MASK_PENALTY, 0)
    own = best_power_of_two(masked, np.asarray(np.abs(masked).max() / 127), ZERO, INT8, COUNT)
    assert chosen < own
    assert 128 * chosen >= SOFTMAX_FLOOR  # the penalty clipped to -16 or below
    assert _softmax_error(masked, chosen) < _softmax_error(masked, own) / 2
    visible = softmax_visible_error(masked, chosen, ZERO, INT8, -1)
    assert visible < squared_error(masked, chosen, ZERO, INT8)  # the clipped penalty is free
    (record,) = [r for r in recorded_choices(path) if r.tensor == "masked"]
    assert record.chosen_by == "softmax-visible error"


def test_unmasked_scores_are_judged_by_their_own_error() -> None:
    """Scores 16 or more below their row's maximum but above the mask's level (a trained ViT's
    tail) count as seen: the error as the Softmax sees it is the tensor's own."""
    scores = 4 * np.random.default_rng(1).standard_normal((8, 48)).astype(np.float32)
    scores[:, 0] = 6.0  # every row's maximum: its tail down to -14 is 16 or more below it
    for scale in power_of_two_candidates(np.asarray(np.abs(scores).max() / 127), COUNT):
        own = squared_error(scores, scale, ZERO, INT8)
        assert np.allclose(softmax_visible_error(scores, scale, ZERO, INT8, -1), own)


def test_the_rule_takes_a_masked_softmax_input_that_the_softmax_alone_reads() -> None:
    """a: masked, read by its Softmax alone; b: masked, read by a Relu too; c: no mask (a ViT's
    scores, judged by their own error)."""
    mask, constants = _padding_mask("ids", "mask")
    graph = helper.make_graph(
        [
            *mask,
            helper.make_node("Add", ["a", "mask"], ["a_masked"]),
            helper.make_node("Softmax", ["a_masked"], ["pa"], axis=1),
            helper.make_node("Add", ["b", "mask"], ["b_masked"]),
            helper.make_node("Softmax", ["b_masked"], ["pb"]),
            helper.make_node("Relu", ["b_masked"], ["rb"]),
            helper.make_node("Softmax", ["c"], ["pc"]),
        ],
        "g",
        [
            *(helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "abc"),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
        ],
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3])
            for n in ("pa", "pb", "rb", "pc")
        ],
        constants,
    )
    assert masked_softmax_inputs(helper.make_model(graph)) == {"a_masked": 1}


def _linear(path: Path) -> tuple[Path, np.ndarray, Samples]:
    """x @ w + b (ORT's pre-processing makes it a Gemm), with weights whose MinMax scales fall
    between powers of two, and 32 calibration samples."""
    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((64, 32)) / 8).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Add", ["h", "b"], ["y"]),
        ],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32])],
        [
            numpy_helper.from_array(weight, "w"),
            numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    samples = Samples({"x": rng.standard_normal((32, 64)).astype(np.float32)}, None, "t")
    return path, weight, samples


def _weight_of(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The int8 weight of the file's one Linear, and its scale shaped to divide it."""
    model = onnx.load(str(path))
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    (node,) = [
        n
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and values.get(n.input[0], np.int32(0)).dtype == INT8
    ]
    data, scale = values[node.input[0]], values[node.input[1]].astype(np.float64)
    axis = next(a.i for a in node.attribute if a.name == "axis")
    return data, scale.reshape([-1 if i == axis else 1 for i in range(data.ndim)])


def test_a_weight_is_quantized_to_its_power_of_two_from_its_fp32_values(tmp_path: Path) -> None:
    """Once, from the fp32 weights, not again from the int8 copy ORT's quantizer rounded to the
    MinMax scale's grid: that would add up to half a new step to a sixth of the weights here."""
    fp32, weight, calibration = _linear(tmp_path / "linear.onnx")
    tda4vm = PROFILES["tda4vm"]
    data, scale = _weight_of(quantize_onnx(fp32, tmp_path / "tda4vm.onnx", tda4vm, calibration))
    assert np.all(np.log2(scale) == np.round(np.log2(scale)))  # powers of two
    once = np.clip(np.round(weight / scale), -128, 127)
    np.testing.assert_array_equal(data, once)

    minmax_profile = replace(tda4vm, power_of_two_scales=False, bias_correction=False)
    minmax_data, minmax_scale = _weight_of(
        quantize_onnx(fp32, tmp_path / "minmax.onnx", minmax_profile, calibration)
    )
    twice = np.clip(np.round(minmax_data * minmax_scale / scale), -128, 127)
    assert np.mean(twice != once) > 0.1  # what rounding the int8 copy again would have made


def test_the_fp32_values_are_found_for_constants_only(tmp_path: Path) -> None:
    """The weight and the bias by ORT's naming of their quantized copies; no activation."""
    fp32, weight, calibration = _linear(tmp_path / "linear.onnx")
    minmax_profile = replace(PROFILES["tda4vm"], power_of_two_scales=False, bias_correction=False)
    quantized = onnx.load(
        str(quantize_onnx(fp32, tmp_path / "q.onnx", minmax_profile, calibration))
    )
    prepared = onnx.load(str(preprocess_for_quantization(fp32, minmax_profile, tmp_path)))
    found = fp32_constants(quantized, prepared)
    assert sorted(found) == ["b_quantized", "w_quantized"]
    np.testing.assert_array_equal(found["w_quantized"], weight)
