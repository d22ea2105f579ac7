"""Per-tensor figures computed batch by batch equal the same figures over all samples at once.

``tensor_sqnr`` and the power-of-two choice of ``quantize_onnx`` stream their activations (one
batch in memory, only sums kept): here they are checked against a direct computation that keeps
every activation of every sample, on a small model with more samples than one batch holds.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnxruntime.quantization.qdq_loss_debug import (
    collect_activations,
    create_activation_matching,
    modify_model_output_intermediate_tensors,
)

from quant.measure import drift, saved_tensors
from quant.measure.drift import sqnr_of_sums, square_sums, tensor_sqnr
from quant.ort import quantize
from quant.ort.bias_correction import channel_means, fp32_tensors, mean_sites
from quant.ort.pow2.scales import best_power_of_two, squared_error
from quant.ort.quantize import SamplesReader, quantize_onnx
from quant.samples import Samples, as_feeds
from quant.targets import PROFILES

FEATURES = 1024
SAMPLES = 10  # batches of STREAM_BATCH (4): 4 + 4 + 2, the last one short


def _model(path: Path) -> Path:
    """x -> h = x W1 -> s = h + x -> s W2: dynamic batch, so it streams in STREAM_BATCH."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((FEATURES, FEATURES)) / FEATURES).astype(np.float32)
    w2 = (rng.standard_normal((FEATURES, 8)) / 8).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Add", ["h", "x"], ["s"]),
            helper.make_node("MatMul", ["s", "w2"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", FEATURES])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return path


def _inputs() -> np.ndarray:
    """Uniform values in [-1, 1] and an outlier of 80 in the first and the last sample. For x,
    the power of two below its MinMax scale clips the outlier but halves the rounding step of
    everything else: the first and the last batch alone each prefer the higher power, all ten
    samples together the lower one, so only a correct sum over batches chooses right."""
    x = np.random.default_rng(1).uniform(-1, 1, (SAMPLES, FEATURES)).astype(np.float32)
    x[0, 0] = x[-1, 0] = 80.0
    return x


def _all_at_once(path: Path, inputs: np.ndarray, scratch: Path) -> dict[str, list[np.ndarray]]:
    """Every tensor of every sample in memory, ORT's way: one batch of all samples."""
    augmented = scratch / f"{path.stem}_all.onnx"
    modify_model_output_intermediate_tensors(str(path), str(augmented))
    reader = SamplesReader(["x"], Samples(as_feeds(inputs), None, "t"), len(inputs))
    return collect_activations(str(augmented), reader)


def _sqnr(reference: np.ndarray, actual: np.ndarray) -> float:
    reference, actual = reference.astype(np.float64), actual.astype(np.float64)
    return 10 * math.log10(np.sum(reference**2) / np.sum((reference - actual) ** 2))


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = tmp_path_factory.mktemp("stream")
    inputs = _inputs()
    assert saved_tensors.STREAM_BATCH < SAMPLES
    return {"dir": directory, "fp32": _model(directory / "fp32.onnx"), "inputs": inputs}


@pytest.mark.parametrize("large", [False, True], ids=["every-sample", "large-activations"])
def test_tensor_sqnr_streamed_equals_all_samples_at_once(
    mlp: dict, large: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamed = all at once; and a model whose activations are over the pass's budget of
    values is measured on fewer samples, exactly the first ones (here 6: a batch and a half)."""
    int8 = quantize_onnx(
        mlp["fp32"],
        mlp["dir"] / "cpu.onnx",
        PROFILES["cpu"],
        Samples(as_feeds(mlp["inputs"]), None, "t"),
    )
    used = SAMPLES
    if large:  # the budget holds 6 samples of s and y (1,032 values each)
        used = saved_tensors.STREAM_BATCH + 2
        monkeypatch.setattr(drift, "SQNR_VALUES", used * (FEATURES + 8))
        monkeypatch.setattr(drift, "MIN_SQNR_SAMPLES", 1)
    streamed = {
        e.name: e
        for e in tensor_sqnr(mlp["fp32"], int8, Samples(as_feeds(mlp["inputs"]), None, "t"))
    }
    fp32_acts = _all_at_once(mlp["fp32"], mlp["inputs"][:used], mlp["dir"])
    int8_acts = _all_at_once(int8, mlp["inputs"][:used], mlp["dir"])
    matching = create_activation_matching(int8_acts, fp32_acts)
    assert len(streamed) >= 2 and set(streamed) <= {"h", "s", "y"}  # op outputs, not input x
    for name, error in streamed.items():
        match = {key: np.concatenate(values) for key, values in matching[name].items()}
        # a batch's sums are float32 (quant.measure.drift.square_sums): ~1e-6 relative, 1e-5 dB
        assert error.sqnr_db == pytest.approx(_sqnr(match["float"], match["post_qdq"]), abs=1e-4)
        assert error.own_sqnr_db == pytest.approx(
            _sqnr(match["pre_qdq"], match["post_qdq"]), abs=1e-4
        )


def test_power_of_two_choice_sums_the_errors_of_every_batch(mlp: dict) -> None:
    tda4vm, calibration = PROFILES["tda4vm"], Samples(as_feeds(mlp["inputs"]), None, "t")
    minmax_profile = dataclasses.replace(tda4vm, power_of_two_scales=False)
    minmax = onnx.load(
        str(quantize_onnx(mlp["fp32"], mlp["dir"] / "mm.onnx", minmax_profile, calibration))
    )
    pow2 = onnx.load(str(quantize_onnx(mlp["fp32"], mlp["dir"] / "p2.onnx", tda4vm, calibration)))
    scales = {i.name: numpy_helper.to_array(i) for i in minmax.graph.initializer}
    chosen = {i.name: numpy_helper.to_array(i) for i in pow2.graph.initializer}
    every = _all_at_once(mlp["fp32"], mlp["inputs"], mlp["dir"])

    def best(tensor: np.ndarray, node: onnx.NodeProto) -> float:
        scale, zero_point = scales[node.input[1]], scales[node.input[2]]
        real = tensor.ravel()
        zero = zero_point.astype(np.float64)
        count = tda4vm.power_of_two_candidates
        return float(
            best_power_of_two(real, scale.astype(np.float64), zero, zero_point.dtype, count)[0]
        )

    checked = {}
    for node in minmax.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] in every:
            direct = best(np.concatenate(every[node.input[0]]), node)
            assert float(chosen[node.input[1]]) == direct, node.input[0]  # bit for bit
            checked[node.input[0]] = node
    assert {"x", "s"} <= set(checked)
    # the data needs the sum: the first batch alone, or the last, would choose the other one
    x = mlp["inputs"]
    for part in (x[: saved_tensors.STREAM_BATCH], x[-(SAMPLES % saved_tensors.STREAM_BATCH) :]):
        assert best(part, checked["x"]) == 2 * float(chosen["x_scale"])


@pytest.mark.parametrize("shape", [(), (3,), (2, 64, 48)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_squared_error_in_float32_is_the_float64_sum(shape: tuple, per_channel: bool) -> None:
    """An activation's candidate errors are computed in float32
    (quant.ort.pow2.scales.squared_error): the same sums as in float64 to float32's rounding of the
    last subtraction, per channel too, and for a tensor of one value."""
    rng = np.random.default_rng(1)
    real = (3 * rng.standard_normal(shape)).astype(np.float32)
    channels = shape[-1] if per_channel and shape else 1
    scale = np.exp2(rng.integers(-6, -2, channels)).reshape((1,) * (len(shape) - 1) + (-1,))
    scale = scale.reshape(()) if not per_channel or not shape else scale
    zero_point = np.zeros((), np.float64)
    info = np.iinfo(np.int8)
    quantized = np.clip(np.round(real.astype(np.float64) / scale), info.min, info.max)
    axes = tuple(i for i in range(real.ndim) if scale.ndim == 0 or scale.shape[i] == 1)
    exact = np.square(quantized * scale - real).sum(axis=axes, keepdims=True)
    found = squared_error(real, scale, zero_point, np.dtype(np.int8))
    assert found.shape == exact.shape and found.dtype == np.float64
    np.testing.assert_allclose(found, exact, rtol=1e-6)


@pytest.mark.parametrize(
    ("reference", "actual", "expected"),
    [
        (np.zeros(4), np.ones(4), 20 * math.log10(1e-30 / 2)),  # no signal: was log10(0)
        (np.full(4, -np.inf), np.full(4, -np.inf), -math.inf),  # an -inf mask: inf - inf
        (np.ones(4), np.ones(4), math.inf),  # computed exactly
        (np.ones(4), np.full(4, 1.1), 20.0),
    ],
)
def test_sqnr_is_never_a_math_error(
    reference: np.ndarray, actual: np.ndarray, expected: float
) -> None:
    """The one-input BERT's 'math domain error' (issue 19): SQNR of a zero tensor, or of one
    holding float32-min fills, is a number, not an exception."""
    signal_sq, noise_sq = square_sums(reference.astype(np.float32), actual.astype(np.float32))
    assert sqnr_of_sums(signal_sq, noise_sq) == pytest.approx(expected, abs=1e-3)


def test_square_sums_hold_float32_min_fills() -> None:
    """float32 sums, except where the squares overflow float32: a mask filled with float32-min
    against int8's clipped value is summed in float64, as finite as before."""
    fill = np.finfo(np.float32).min
    reference = np.array([[1.5, fill, fill], [0.25, -2.0, fill]], np.float32)
    actual = np.array([[1.5, -8.0, -8.0], [0.25, -2.0, -8.0]], np.float32)
    exact = reference.astype(np.float64)
    expected = [np.sum(exact**2), np.sum((exact - actual) ** 2)]
    sums = square_sums(reference, actual)
    assert np.isfinite(sums).all()
    assert sums == pytest.approx(expected, rel=1e-12)
    small = square_sums(reference[:, :1], actual[:, :1] + 0.5)  # no overflow: float32
    assert small == pytest.approx([1.5**2 + 0.25**2, 2 * 0.5**2], rel=1e-6)


def test_the_power_of_two_pass_hands_bias_correction_the_means_it_would_take(
    tmp_path: Path,
) -> None:
    """tda4vm's one fp32 pass (``quantize.calibration_pass``) chooses the power-of-two scales on
    the first samples and takes bias correction's fp32 channel means on all of them: the same
    means, bit for bit, as bias correction's own pass (``channel_means``), past the 32 samples
    the choice reads, at tda4vm's batch of 1."""
    rng = np.random.default_rng(2)
    inputs = rng.standard_normal((40, 64)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["o"]),
        helper.make_node("Add", ["o", "b2"], ["y"]),
    ]
    weights = {
        "w1": rng.standard_normal((64, 32)) / 8,
        "b1": rng.standard_normal(32),
        "w2": rng.standard_normal((32, 4)) / 6,
        "b2": rng.standard_normal(4),
    }
    graph = helper.make_graph(
        nodes,
        "linears",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()],
    )
    fp32_path = tmp_path / "linears.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, fp32_path)
    calibration = Samples({"x": inputs}, None, "t")
    minmax = dataclasses.replace(
        PROFILES["tda4vm"], power_of_two_scales=False, bias_correction=False
    )
    quantized = onnx.load(str(quantize_onnx(fp32_path, tmp_path / "q.onnx", minmax, calibration)))
    prepared_path = quantize.preprocess_for_quantization(fp32_path, minmax, tmp_path)
    prepared = onnx.load(str(prepared_path))

    sites = mean_sites(quantized, fp32_tensors(prepared))
    assert len(sites) == 2  # both Linears, fused into Gemm by ORT's pre-processing
    _, handed = quantize.calibration_pass(
        quantized, prepared, prepared_path, calibration, tmp_path, sites, 2, {}
    )
    own = channel_means(prepared, {name: axis for name, (axis, _) in sites.items()}, calibration)
    assert handed.keys() == own.keys()
    for name in own:
        np.testing.assert_array_equal(handed[name], own[name])
