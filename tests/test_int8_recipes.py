"""The int8 recipe ladder of the QDQ ONNX targets and its bias correction, on the bundled
trained UN ViT and its own data (random weights hide quantization trouble).

A target whose pure int8 file misses the drift bars tries its next recipe before any 16-bit
tensor (cpu: biases corrected, then u8 weights in 8 bits), says which one the shipped file
uses, and keeps the file pure int8 and within the target's rules. tda4vm corrects its biases in
its first recipe and takes them as calibrated in its second.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.calibrate import load_tensors_data

from edge_un import examples
from quant.errors import RuleViolation
from quant.measure.bars import DEFAULT_MAX_DRIFT, DEFAULT_MIN_AGREEMENT, Bars
from quant.measure.drift import Drift, measure_drift, onnx_runner
from quant.measure.saved_tensors import SavedTensors
from quant.ort.attention import calibrated_absmax, signed_operand_sources
from quant.ort.bias_correction import bias_sites, channel_means
from quant.ort.quantize import preprocess_for_quantization, preprocess_once, quantize_onnx
from quant.ort.search import TriedRecipe, kept_recipe
from quant.ort.target import build_onnx_target
from quant.pipeline import convert
from quant.samples import Samples
from quant.targets import PROFILES, TargetProfile
from quant.targets.builder import TargetJob
from quant.targets.rules import check_onnx_artifact

CPU, TDA4VM = PROFILES["cpu"], PROFILES["tda4vm"]
# tda4vm as it was before its biases were always corrected: a pure int8 target whose ladder
# has one step, for the ladder's own tests
UNCORRECTED = dataclasses.replace(TDA4VM, bias_correction=False)
LADDERED = dataclasses.replace(UNCORRECTED, int8_ladder=("bias_correction",))


@pytest.fixture(scope="module")
def vit(vit_onnx: dict) -> dict:
    """The bundled trained UN ViT (conftest's ``vit_onnx``): ``test`` its whole test split."""
    return vit_onnx


def quantized(vit: dict, profile: TargetProfile, name: str) -> Path:
    out = vit["dir"] / name
    quantize_onnx(vit["fp32"][profile.name], out, profile, vit["calibration"])
    return out


def initializers(path: Path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}


def test_the_ladders_add_bias_correction_then_u8_weights_and_keep_the_rest() -> None:
    cpu = CPU.int8_recipes
    assert [(r.weight_type, r.weight_bits, r.bias_correction) for r in cpu] == [
        ("int8", 7, False), ("int8", 7, True), ("uint8", 8, True),
    ]  # fmt: skip
    # tda4vm corrects its biases in its first recipe, as TIDL's own calibration does, and takes
    # them as calibrated in its second
    assert [(r.bias_correction, r.power_of_two_scales) for r in TDA4VM.int8_recipes] == [
        (True, True), (False, True)
    ]  # fmt: skip
    laddered = LADDERED.int8_recipes
    assert [r.bias_correction for r in laddered] == [False, True]
    assert all(r.power_of_two_scales and r.symmetric_activations for r in laddered)
    # every rung is its target otherwise, pure int8, no ladder of its own
    for rungs in (cpu, laddered):
        assert len({r.recipe for r in rungs}) == len(rungs)
        assert all(r.int8_ladder == () and r.name == rungs[0].name for r in rungs)
    assert [len(p.int8_recipes) for p in (PROFILES["imx93"], PROFILES["imx8mp"])] == [1, 1]
    assert any("int32 bias corrected" in rule for rule in TDA4VM.rules)
    assert any("U8U8" in rule for rule in CPU.rules)


def test_bias_correction_cancels_the_mean_error_it_measures_and_lowers_the_held_out_shift(
    vit: dict, tmp_path: Path
) -> None:
    plain = quantized(vit, UNCORRECTED, "tda4vm_plain.onnx")
    corrected = quantized(vit, TDA4VM, "tda4vm_corrected.onnx")
    check_onnx_artifact(corrected, TDA4VM)  # power-of-two scales, symmetric: the rules still hold
    before, after = initializers(plain), initializers(corrected)
    assert before.keys() == after.keys()
    changed = {name for name in before if not np.array_equal(before[name], after[name])}
    # only int32 biases of integer kernels moved: every weight and every scale is the plain
    # file's; the patch Conv, the 4 Linears of each of the 4 blocks and the head: 18
    model = onnx.load(str(corrected))
    dequantized = {
        n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear"
    }
    biases = {
        dequantized[n.input[2]]
        for n in model.graph.node
        if n.op_type in ("Conv", "Gemm") and len(n.input) > 2 and n.input[2] in dequantized
    }
    assert len(changed) == 18 and changed <= biases
    assert all(after[name].dtype == np.int32 for name in changed)
    # each bias was measured with every bias before it corrected (one walk through the graph,
    # not one pass each): run whole, every corrected output's mean error on the calibration
    # data is under half a step of its bias, the int32 rounding, in every channel
    fp32 = onnx.load(str(preprocess_for_quantization(vit["fp32"]["tda4vm"], TDA4VM, tmp_path)))
    sites = bias_sites(model, {out for node in fp32.graph.node for out in node.output})
    assert len(sites) == 18
    int8_means = channel_means(model, {s.output: s.channel_axis for s in sites}, vit["calibration"])
    fp32_means = channel_means(
        fp32, {s.reference: s.channel_axis for s in sites}, vit["calibration"]
    )
    for site in sites:
        residual = np.abs(int8_means[site.output] - fp32_means[site.reference])
        step = np.broadcast_to(after[site.scale], residual.shape)
        assert np.all(residual <= 0.5 * step + 1e-6), (site.bias, (residual / step).max())

    def logits(path: Path, samples: Samples) -> np.ndarray:
        return onnx_runner(path, exact=True)(samples.inputs)

    calibration, evaluation = vit["calibration"], vit["test"]
    reference = onnx_runner(vit["fp32"]["tda4vm"])(calibration.inputs)
    # the logits are the last bias corrected: their mean error on the calibration data is gone,
    # to a tenth of a step of the int8 output's rounding; uncorrected it is over half a step
    # (0.63 of its 0.25 when written), the same shift on every sample
    quantized_logits = dequantized[model.graph.output[0].name]
    (logits_q,) = [n for n in model.graph.node if n.output[0] == quantized_logits]
    step = float(after[logits_q.input[1]])
    mean_before = np.abs((logits(plain, calibration) - reference).mean(axis=0)).max()
    mean_after = np.abs((logits(corrected, calibration) - reference).mean(axis=0)).max()
    assert mean_before > 0.5 * step and mean_after < 0.1 * step, (mean_before, mean_after, step)
    # and on the held-out test split the shift is smaller too (the logits' RMS error is about
    # the same: with the weights rounded once from fp32, most of the error left is noise)
    reference = onnx_runner(vit["fp32"]["tda4vm"])(evaluation.inputs)
    shift = [
        np.abs((logits(p, evaluation) - reference).mean(axis=0)).max() for p in (plain, corrected)
    ]
    assert shift[1] < shift[0], shift  # 0.097 -> 0.074 when written


def test_channel_means_leave_out_the_rows_a_fixed_batch_is_padded_with(tmp_path: Path) -> None:
    """Batch fixed at 4, six samples: the last run holds two real samples and two copies."""
    weight = np.arange(6, dtype=np.float32).reshape(3, 2)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"])],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    means = channel_means(model, {"y": -1}, Samples({"x": x}, None, "test"))
    np.testing.assert_allclose(means["y"], (x @ weight).mean(axis=0), rtol=1e-5)


def drift(agreement: float, drop: float) -> Drift:
    return Drift(0.96, 0.96 - drop / 100, drop, agreement, 0.998, 0.5, 1000)


def test_the_kept_recipe_is_the_first_within_the_bars_else_the_closest_to_them() -> None:
    bars = Bars(DEFAULT_MAX_DRIFT, DEFAULT_MIN_AGREEMENT)
    a, b, c = CPU.int8_recipes
    passing = [TriedRecipe(a, drift(0.985, 0.3)), TriedRecipe(b, drift(0.990, 0.0))]
    assert kept_recipe(passing, bars).profile is b
    missing = [
        TriedRecipe(a, drift(0.985, 0.3)),
        TriedRecipe(b, drift(0.988, 0.6)),
        TriedRecipe(c, drift(0.988, 0.1)),
    ]
    assert kept_recipe(missing, bars).profile is c  # same agreement, smaller drop
    tied = [TriedRecipe(a, drift(0.988, 0.1)), TriedRecipe(b, drift(0.988, 0.1))]
    assert kept_recipe(tied, bars).profile is a  # a tie: the earlier, cheaper recipe


def job(
    vit: dict, tmp_path: Path, bars: Bars, evaluation: Samples, profile: TargetProfile = TDA4VM
) -> TargetJob:
    fp32 = vit["fp32"]["tda4vm"]
    target_dir = tmp_path / "tda4vm"
    target_dir.mkdir()
    return TargetJob(
        profile=profile, fp32_path=fp32, target_dir=target_dir, out_dir=tmp_path,
        calibration=vit["calibration"], evaluation=evaluation,
        reference=onnx_runner(fp32)(evaluation.feeds), bars=bars,
        stage=lambda name, fraction, detail=None: None, latency_runs=2,
    )  # fmt: skip


def test_a_file_within_the_bars_keeps_the_first_recipe(vit: dict, tmp_path: Path) -> None:
    bars = Bars(DEFAULT_MAX_DRIFT, DEFAULT_MIN_AGREEMENT)
    result = build_onnx_target(job(vit, tmp_path, bars, vit["test"]))
    assert result.drift is not None and result.drift.within_bar
    assert result.int8_recipe == TDA4VM.recipe
    assert [t.recipe for t in result.recipes_tried] == [TDA4VM.recipe]
    assert not any("int8 recipe" in warning for warning in result.warnings)


def test_a_file_over_the_bars_tries_the_next_recipe_and_says_which_it_ships(
    vit: dict, tmp_path: Path
) -> None:
    bars = Bars(DEFAULT_MAX_DRIFT, 1.01)  # no file can meet it: every recipe is tried
    evaluation = vit["evaluation"]  # 300 test samples
    result = build_onnx_target(job(vit, tmp_path, bars, evaluation, LADDERED))
    tried = result.recipes_tried
    assert [t.recipe for t in tried] == [r.recipe for r in LADDERED.int8_recipes]
    assert not any(t.within_bar for t in tried)
    best = max(tried, key=lambda t: (t.agreement, -(t.top1_drop_pts or 0.0)))
    assert result.int8_recipe == best.recipe and result.drift is not None
    assert (result.drift.agreement, result.drift.top1_drop_pts) == (
        best.agreement,
        best.top1_drop_pts,
    )  # fmt: skip
    # the file shipped is the one measured for that recipe
    shipped = measure_drift(
        onnx_runner(vit["fp32"]["tda4vm"])(evaluation.feeds),
        onnx_runner(tmp_path / "tda4vm" / "model_int8.onnx", exact=True)(evaluation.feeds),
        evaluation.labels,
    )
    assert (shipped.agreement, shipped.top1_drop_pts) == (best.agreement, best.top1_drop_pts)
    assert result.int16_tensors == [] and result.pure_int8_drift is None  # tda4vm stays int8
    if best.recipe != tried[0].recipe:
        (warning,) = [w for w in result.warnings if "first int8 recipe" in w]
        assert tried[0].recipe in warning and best.recipe in warning


def test_the_cpu_rules_refuse_weights_that_can_saturate_without_vnni(vit: dict) -> None:
    u8u8 = CPU.int8_recipes[2]
    path = quantized(vit, u8u8, "cpu_u8u8.onnx")
    check_onnx_artifact(path, u8u8)
    weights = [v for v in initializers(path).values() if v.dtype in (np.int8, np.uint8)]
    assert weights and all(v.dtype == np.uint8 for v in weights)
    with pytest.raises(RuleViolation, match="the target's weights are u8"):
        check_onnx_artifact(quantized(vit, CPU, "cpu_7bit.onnx"), u8u8)
    eight_bit = quantized(vit, dataclasses.replace(CPU, weight_bits=8), "cpu_8bit.onnx")
    with pytest.raises(RuleViolation, match="exceeds 7 bits"):
        check_onnx_artifact(eight_bit, CPU)


def test_a_shared_preparation_makes_each_recipe_s_file_byte_for_byte(
    vit: dict, tmp_path: Path
) -> None:
    """The cpu ladder quantizes one fp32 file three times: with one preparation (ORT's
    pre-processed graph and calibration ranges, measured once) each recipe's file is the one
    it makes alone, and the later recipes read the ranges, not measure them again; the third
    takes the fp32 channel means the second's bias correction measured."""
    fp32, calibration = vit["fp32"]["cpu"], vit["calibration"]
    shared = preprocess_once(fp32, CPU, calibration, tmp_path)
    written = None
    for number, recipe in enumerate(CPU.int8_recipes):
        alone = quantize_onnx(fp32, tmp_path / f"alone_{number}.onnx", recipe, calibration)
        together = tmp_path / f"shared_{number}.onnx"
        quantize_onnx(fp32, together, recipe, calibration, (), shared)
        assert together.read_bytes() == alone.read_bytes(), recipe.recipe
        stamp = shared.ranges.stat().st_mtime_ns
        assert written in (None, stamp)  # ORT writes its cache only when it calibrates
        written = stamp
        assert bool(shared.fp32_means) == (number > 0)  # kept from the first correction on
    with pytest.raises(ValueError, match="cannot serve"):  # other data: other ranges
        other = Samples(dict(calibration.feeds), None, "other")
        quantize_onnx(fp32, tmp_path / "other.onnx", CPU, other, (), shared)


def test_tda4vm_s_second_recipe_is_the_file_its_first_made_before_correcting_its_biases(
    vit: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tda4vm's ladder corrects its biases, then takes them as calibrated: with one
    preparation the second rung's file is copied from the first rung's state before its
    correction (no second quantization: ORT's quantizer, only counted, is not called), and it
    is byte for byte the file that recipe makes alone."""
    import quant.ort.quantize as quantize_module

    fp32, calibration = vit["fp32"]["tda4vm"], vit["calibration"]
    corrected, calibrated = TDA4VM.int8_recipes
    shared = preprocess_once(fp32, corrected, calibration, tmp_path)
    quantize_onnx(fp32, tmp_path / "first.onnx", corrected, calibration, (), shared)
    alone = quantize_onnx(fp32, tmp_path / "alone.onnx", calibrated, calibration)
    calls = []
    quantize_static = quantize_module.quantize_static
    monkeypatch.setattr(quantize_module, "quantize_static",
                        lambda *a, **k: calls.append(a) or quantize_static(*a, **k))  # fmt: skip
    second = quantize_onnx(fp32, tmp_path / "second.onnx", calibrated, calibration, (), shared)
    assert second.read_bytes() == alone.read_bytes() and not calls
    assert (tmp_path / "first.onnx").read_bytes() != alone.read_bytes()  # the correction's


def test_the_attention_operands_bound_is_their_calibrated_absolute_maximum(
    vit: dict, tmp_path: Path
) -> None:
    """The s8 right operands' bounds, read off ORT's calibration ranges, are each tensor's
    largest absolute value on the calibration data, as a pass of the prepared graph run as
    written computes it."""
    fp32, calibration = vit["fp32"]["cpu"], vit["calibration"]
    shared = preprocess_once(fp32, CPU, calibration, tmp_path)
    quantized = onnx.load(
        str(quantize_onnx(fp32, tmp_path / "q.onnx", CPU, calibration, (), shared))
    )
    sources = signed_operand_sources(quantized, 0)
    assert sources  # every attention's K^T and V
    bounds = calibrated_absmax(load_tensors_data(shared.ranges), sources)
    assert bounds.keys() == set(sources)
    run = SavedTensors(shared.graph, tmp_path / "augmented.onnx")
    largest = dict.fromkeys(sources, 0.0)
    for batch in calibration.batches(8):
        for name, value in run(batch, sources).items():
            largest[name] = max(largest[name], float(np.abs(value).max()))
    assert bounds == largest


def test_tda4vm_takes_its_biases_as_calibrated_where_the_correction_misses_the_bars(
    tmp_path: Path,
) -> None:
    """The bundled text-rt-ln-to-un: its biases corrected, 98.8 % of its test sentences agree
    with fp32 on tda4vm; as calibrated, 99.6 %."""
    report = convert(examples.path("text-rt-ln-to-un"), "tda4vm", out_dir=tmp_path, latency_runs=3)
    tda4vm = report.targets["tda4vm"]
    first, second = tda4vm.recipes_tried
    assert not first.within_bar and second.within_bar
    assert tda4vm.status == "ok" and tda4vm.int8_recipe == TDA4VM.int8_recipes[1].recipe
    assert tda4vm.drift.within_bar and not tda4vm.int16_tensors
