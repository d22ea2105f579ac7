"""The TFLite layer for real: onnx2tf in its tool environment, LiteRT, Vela. No mocks.

Two tiny conversions (~15 s each) are shared by every test through module-scoped fixtures: an
RGB ViT (the input kind that makes onnx2tf reach for the network) and a TextTransformer (int64
token ids, the input onnx2tf cannot quantize itself).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from converters import export_onnx, fold_norms
from edge_un.models import TextTransformer, VisionTransformer
from quant.deadline import NO_DEADLINE, STOPPED, Deadline
from quant.measure.bars import Bars
from quant.measure.drift import onnx_runner
from quant.samples import Samples
from quant.targets import PROFILES
from quant.targets.builder import TargetJob
from quant.tflite import onnx2tf, toolenv
from quant.tflite.flatbuffer import NotFullIntegerError, check_full_integer, inspect_tflite
from quant.tflite.litert import (
    aligned_tensors,
    latency_tflite,
    onnx_names,
    run_tflite,
    tensor_sqnr_tflite,
    tensor_values,
)
from quant.tflite.onnx2tf import TfliteArtifacts, convert_int16x8, convert_tflite
from quant.tflite.target import wide_drift, wide_fits
from quant.tflite.tool_sandbox import TfliteConversionError
from quant.tflite.vela import compile_vela

from .deadlines import StartsButCannotRun
from .servers import missing


def _export(model: torch.nn.Module, example: torch.Tensor, path: Path) -> Path:
    """Fold and export like the TFLite route needs: opset 20 (one Gelu node), static batch 1."""
    folded, _ = fold_norms(model.eval())
    export_onnx(folded, (example,), path, opset=20, dynamic_batch=False)
    return path


def _onnx_outputs(path: Path, inputs: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate(
        [session.run(None, {name: inputs[i : i + 1]})[0] for i in range(len(inputs))]
    )


@pytest.fixture(scope="module")
def rgb(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, TfliteArtifacts]:
    """An RGB ViT converted inside a network namespace with no network at all, where the
    kernel allows one (``unshare -rn``; the test of that isolation skips, or fails under CI=true,
    where it does not: the other tests of this file need the files, not the namespace)."""
    root = tmp_path_factory.mktemp("rgb")
    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=32, in_chans=3, patch_size=8, dim=32, depth=1, heads=2, num_classes=10, norm="un"
    )
    onnx_path = _export(model, torch.randn(1, 3, 32, 32), root / "model.onnx")
    calib = np.random.default_rng(0).standard_normal((32, 3, 32, 32)).astype(np.float32)
    return onnx_path, calib, convert_tflite(onnx_path, calib, root / "tflite")


@pytest.fixture(scope="module")
def rgb_16x8(rgb) -> TfliteArtifacts:
    """The RGB ViT's 16x8 file, made afterwards from the saved_model its conversion kept (as a
    target whose int8 file misses the bars asks for it)."""
    return convert_int16x8(rgb[2])


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, TfliteArtifacts]:
    root = tmp_path_factory.mktemp("text")
    torch.manual_seed(0)
    model = TextTransformer(vocab_size=50, max_len=8, dim=16, depth=1, heads=2)
    onnx_path = _export(model, torch.randint(1, 50, (1, 8)), root / "model.onnx")
    ids = np.random.default_rng(0).integers(1, 50, (48, 8))
    ids[::3, 5:] = 0  # padding, so the mask path is calibrated too
    return onnx_path, ids, convert_tflite(onnx_path, ids, root / "tflite")


def test_rgb_model_converts_without_network(rgb) -> None:
    unshare = shutil.which("unshare")
    probe = unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=30)
    if not probe or probe.returncode != 0:
        missing("`unshare -rn` does not work here (no unshare, or user namespaces are disabled)")
    assert rgb[2].network_isolated  # onnx2tf ran in a namespace with no network interface


def test_rgb_model_converts_to_full_int8(rgb) -> None:
    onnx_path, calib, artifacts = rgb
    info = inspect_tflite(artifacts.int8)
    check_full_integer(info, io_dtype="int8")
    assert info.input_dtypes == ("int8",) and info.output_dtypes == ("int8",)
    assert info.inputs[0].shape == (1, 32, 32, 3)  # onnx2tf made it channels-last
    assert {"FULLY_CONNECTED", "BATCH_MATMUL", "SOFTMAX", "GELU"} <= set(info.ops)
    # a small model's two files from one TensorFlow process, which logged each; no 16x8 file
    # until one is asked for
    log = artifacts.quantize_log.read_text()
    assert artifacts.quantize_log.name == "tf_convert_float32_int8.log"
    assert all(f"wrote {mode}: " in log for mode in ("float32", "int8")) and "int16x8" not in log
    assert artifacts.int16x8 is None
    assert (artifacts.saved_model / "saved_model.pb").is_file() and artifacts.calibration.is_file()
    # the int8 file computes what the fp32 ONNX model computes (random weights and inputs give
    # tiny logits, so the int8 output step is coarse: measured 0.93, a loose bound)
    reference = _onnx_outputs(onnx_path, calib[:16])
    int8 = run_tflite(artifacts.int8, calib[:16])
    cosine = np.sum(int8 * reference) / (np.linalg.norm(int8) * np.linalg.norm(reference))
    assert cosine > 0.8


def test_the_16x8_file_is_made_on_demand_from_the_kept_saved_model(rgb, rgb_16x8) -> None:
    """In a TensorFlow process of its own, which neither touches the int8 file nor the float32
    one: int8 weights, int16 activations and I/O, no float left."""
    _, _, artifacts = rgb
    assert rgb_16x8.int16x8 == artifacts.int8.with_name("model_16x8.tflite")
    wide = inspect_tflite(rgb_16x8.int16x8)
    check_full_integer(wide, io_dtype="int16")
    assert wide.int16_tensors and not wide.float_ops
    log = (artifacts.int8.parent / "tf_convert_int16x8.log").read_text()
    assert "# exit code 0" in log and log.count("wrote ") == 1 and "wrote int16x8: " in log
    assert sorted(p.name for p in artifacts.int8.parent.glob("*.tflite")) == [
        "model_16x8.tflite",
        "model_float32.tflite",
        "model_int8.tflite",
    ]
    assert (rgb_16x8.int8, rgb_16x8.float32, rgb_16x8.notes) == (
        artifacts.int8,
        artifacts.float32,
        artifacts.notes,
    )


def test_the_float32_file_is_the_float_model_the_int8_conversion_quantized(
    rgb, tmp_path: Path
) -> None:
    """One TensorFlow conversion writes both files: its float32 file computes, tensor by tensor,
    what the saved_model converted to float32 alone computes (the float32 file is LiteRT's
    reference for the per-tensor SQNR, paired with the int8 file by tensor name)."""
    _, calib, artifacts = rgb
    alone = tmp_path / "alone.tflite"
    subprocess.run(
        [
            str(toolenv.ONNX2TF.python(toolenv.ONNX2TF.require())),
            str(onnx2tf.TF_CONVERT_SCRIPT),
            str(artifacts.saved_model),
            str(artifacts.calibration),
            f"float32={alone}",
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=300,
    )
    kept, converted = inspect_tflite(artifacts.float32), inspect_tflite(alone)
    assert kept.ops == converted.ops and kept.input_dtypes == ("float32",)
    samples = calib[:4]
    kept_values, converted_values = (
        tensor_values(path, samples) for path in (artifacts.float32, alone)
    )
    assert kept_values.keys() == converted_values.keys()
    for name, values in converted_values.items():
        np.testing.assert_allclose(kept_values[name], values, rtol=0, atol=1e-6, err_msg=name)
    assert set(aligned_tensors(artifacts.int8, artifacts.float32)) == set(
        aligned_tensors(artifacts.int8, alone)
    )


def test_inspect_finds_float_ops_so_the_check_can_fail(rgb, rgb_16x8) -> None:
    _, _, artifacts = rgb
    info = inspect_tflite(artifacts.float32)
    assert info.float_ops and info.float_tensors
    assert {op.op for op in info.float_ops} >= {"FULLY_CONNECTED", "SOFTMAX"}
    with pytest.raises(NotFullIntegerError, match=r"float ops \(.*FULLY_CONNECTED.*output"):
        check_full_integer(info)
    with pytest.raises(NotFullIntegerError, match=r"output '.+' is int16"):
        check_full_integer(inspect_tflite(rgb_16x8.int16x8), io_dtype="int8")


def test_vela_places_every_op_of_the_int8_file_on_the_npu(rgb, tmp_path: Path) -> None:
    _, _, artifacts = rgb
    result = compile_vela(artifacts.int8, tmp_path / "vela")
    assert result.path.is_file() and result.path.name == "model_int8_vela.tflite"
    assert (result.accelerator, result.system_config, result.memory_mode) == (
        "ethos-u65-256",
        "Ethos_U65_High_End",
        "Dedicated_Sram_384KB",
    )
    assert result.all_on_npu and result.cpu_ops == () and result.npu_ops > 0
    assert result.cycles >= result.npu_cycles > 0
    assert result.est_ms == pytest.approx(result.cycles / 1e6, rel=1e-3)  # 1 GHz clock
    assert result.sram_kib > 0 and result.dram_kib > 0 and result.macs > 0
    # the compiled file is one Ethos-U custom op (plus nothing on the CPU)
    assert set(inspect_tflite(result.path).ops) == {"CUSTOM:ethos-u"}


def test_vela_names_what_falls_back_to_the_cpu(rgb_16x8, tmp_path: Path) -> None:
    """16-bit activations: Vela 5.2 runs neither int16 BATCH_MATMUL nor int16 GELU."""
    result = compile_vela(rgb_16x8.int16x8, tmp_path / "vela16")
    assert not result.all_on_npu
    assert set(result.cpu_op_types) == {"BATCH_MATMUL", "GELU"}
    assert any(op.startswith("GELU ") for op in result.cpu_ops)
    assert any("Int16" in reason for reason in result.cpu_reasons)


def test_litert_tensors_sqnr_and_latency(rgb) -> None:
    onnx_path, calib, artifacts = rgb
    values = tensor_values(artifacts.int8, calib[:4])
    assert values and all(v.shape[0] == 4 and v.dtype == np.float32 for v in values.values())
    rows = tensor_sqnr_tflite(artifacts.int8, artifacts.float32, calib[:8])
    assert len(rows) == len(values)  # every activation paired with its fp32 twin
    assert [r[2] for r in rows] == sorted(r[2] for r in rows)
    # ONNX names: the mapped tensors exist in the ONNX graph (best effort, most of them)
    names = onnx_names(list(values), artifacts.tensor_map)
    graph_tensors = {o for node in onnx.load(str(onnx_path)).graph.node for o in node.output}
    assert len(names) >= len(values) // 2 and set(names.values()) <= graph_tensors
    timing = latency_tflite(artifacts.int8, calib[:1], threads=1, warmup=2, runs=10)
    assert timing.runs == 10 and 0 < timing.p50_ms <= timing.p90_ms <= timing.p99_ms


def _every_tensor_by_hand(path: Path, samples: np.ndarray) -> dict[str, np.ndarray]:
    """Each tensor of a one-input TFLite file on every sample, read with a bare LiteRT
    interpreter (builtin kernels, all tensors kept) and dequantized here as
    (q - zero_point) * scale: {name: (N, *shape)}, names held by one tensor only."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    interp = Interpreter(
        model_path=str(path),
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        experimental_preserve_all_tensors=True,
    )
    interp.allocate_tensors()
    (given,) = interp.get_input_details()
    feed = np.moveaxis(samples, 1, -1)  # NCHW -> the file's NHWC
    assert tuple(feed.shape[1:]) == tuple(given["shape"][1:])
    if np.dtype(given["dtype"]) == np.int8:
        scale, zero_point = given["quantization"]
        feed = np.clip(np.round(feed / scale) + zero_point, -128, 127).astype(np.int8)
    details = interp.get_tensor_details()
    counts: dict[str, int] = {}
    for detail in details:
        counts[detail["name"]] = counts.get(detail["name"], 0) + 1
    values: dict[str, list[np.ndarray]] = {}
    for sample in feed:
        interp.set_tensor(given["index"], sample[None].astype(given["dtype"]))
        interp.invoke()
        for detail in details:
            if counts[detail["name"]] > 1:
                continue
            try:
                value = interp.get_tensor(detail["index"]).astype(np.float64)
            except ValueError:  # a tensor the interpreter holds no data for
                continue
            scale, zero_point = detail["quantization"]
            if scale != 0 and np.dtype(detail["dtype"]).kind != "f":
                value = (value - zero_point) * scale
            values.setdefault(detail["name"], []).append(value)
    return {name: np.stack(v) for name, v in values.items() if len(v) == len(feed)}


def test_streamed_tflite_sqnr_equals_all_samples_at_once(rgb) -> None:
    """tensor_sqnr_tflite runs one sample at a time and keeps only sums per tensor: the same
    SQNR as 10 log10(sum ref^2 / sum (ref - int8)^2) over the tensors of all 8 samples at
    once, read here with a bare interpreter (8 samples, so 8 runs are summed)."""
    _, calib, artifacts = rgb
    streamed = tensor_sqnr_tflite(artifacts.int8, artifacts.float32, calib[:8])
    quantized = _every_tensor_by_hand(artifacts.int8, calib[:8])
    reference = _every_tensor_by_hand(artifacts.float32, calib[:8])
    pairs = aligned_tensors(artifacts.int8, artifacts.float32)
    assert len(streamed) > 10
    assert [row[2] for row in streamed] == sorted(row[2] for row in streamed)  # worst first
    checked = 0
    for name, op, db in streamed:
        assert op == pairs[name][0]
        if name not in quantized or pairs[name][1] not in reference:
            continue
        ref, q = reference[pairs[name][1]], quantized[name]
        assert ref.shape == q.shape == (8, *ref.shape[1:]), name
        signal, noise = float(np.sum(ref**2)), float(np.sum((ref - q) ** 2))
        expected = math.inf if noise == 0 else 10 * math.log10(signal / noise)
        assert db == pytest.approx(expected, rel=1e-6, abs=1e-6), name
        checked += 1
    assert checked >= len(streamed) - 2, (checked, len(streamed))


def test_a_layernorm_model_converts(tmp_path: Path) -> None:
    """onnx2tf builds an ONNX LayerNormalization as a Keras layer with variables (gamma, beta):
    the saved_model must track them, else saving fails ("an 'untracked' resource")."""
    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=16, in_chans=1, patch_size=8, dim=16, depth=1, heads=2, num_classes=4, norm="ln"
    )
    path = tmp_path / "ln.onnx"
    export_onnx(model.eval(), (torch.randn(1, 1, 16, 16),), path, opset=20, dynamic_batch=False)
    assert "LayerNormalization" in {node.op_type for node in onnx.load(str(path)).graph.node}
    calib = np.random.default_rng(0).standard_normal((16, 1, 16, 16)).astype(np.float32)
    artifacts = convert_tflite(path, calib, tmp_path / "tflite")
    assert artifacts.notes == ()  # the int8 file ran in LiteRT (its 16x8 file would abort it)
    check_full_integer(inspect_tflite(artifacts.int8), io_dtype="int8")
    reference = _onnx_outputs(path, calib)
    int8 = run_tflite(artifacts.int8, calib)
    assert np.sum(int8 * reference) / (np.linalg.norm(int8) * np.linalg.norm(reference)) > 0.8


def test_a_model_onnx2tf_builds_right_only_in_strict_mode_is_built_again(tmp_path: Path) -> None:
    """onnx2tf first builds without its strict mode (BERT-base's build script: 55-60 s instead
    of 77-91 s) and the model is checked against ONNX Runtime. This one (16 tokens of 16
    channels) comes out wrong fast (measured 0.000445 off logits of 0.000737) and right in
    strict mode: the strict build ships, and the tensor map is that build's alone."""
    torch.manual_seed(0)
    model = TextTransformer(vocab_size=50, max_len=16, dim=16, depth=1, heads=2)
    onnx_path = _export(model, torch.randint(1, 50, (1, 16)), tmp_path / "square.onnx")
    ids = np.random.default_rng(0).integers(1, 50, (48, 16))
    artifacts = convert_tflite(onnx_path, ids, tmp_path / "tflite")
    log = artifacts.onnx2tf_log.read_text()
    assert "the fast build disagrees with ONNX Runtime (output 0 is " in log  # and strict mode
    assert log.count("Model conversion started") == 2
    assert "the TensorFlow model agrees with ONNX Runtime" in log
    reference = _onnx_outputs(onnx_path, ids)
    float32 = run_tflite(artifacts.float32, ids)
    assert np.abs(float32 - reference).max() <= 1e-3 * np.abs(reference).max()
    # one build's names: the first build's Keras names (other counters) are not kept
    nodes = len(onnx.load(str(onnx_path)).graph.node)
    tensor_map = json.loads(artifacts.tensor_map.read_text())
    assert 0 < len(tensor_map) <= nodes, (len(tensor_map), nodes)


def test_the_fast_build_ships_where_it_agrees(rgb, text) -> None:
    for _, _, artifacts in (rgb, text):
        log = artifacts.onnx2tf_log.read_text()
        assert log.count("Model conversion started") == 1
        assert "the TensorFlow model agrees with ONNX Runtime" in log


def test_int64_token_ids_take_the_saved_model_route(text) -> None:
    onnx_path, ids, artifacts = text
    info = inspect_tflite(artifacts.int8)
    assert info.input_dtypes == ("int64",) and info.output_dtypes == ("int8",)
    assert info.inputs[0].scale is None  # an index, not a quantized value
    assert "GATHER" in info.ops
    # The padding bias is a select of two constants and the mean pool a softmax of it: nothing
    # is left in float (a bool->float cast and a DIV were, before), and the int64 input is fine.
    check_full_integer(info)
    assert not info.float_ops and "DIV" not in info.ops
    # TensorFlow has no 16x8 path for an int64 input (it fails after a calibration pass): not
    # tried (no TensorFlow process started), said, not fatal
    wide = convert_int16x8(artifacts)
    assert wide.int16x8 is None and not (artifacts.int8.parent / "tf_convert_int16x8.log").exists()
    (note,) = wide.notes
    assert note.startswith(
        "int16x8 conversion skipped: TensorFlow has no 16x8 path for integer input(s) "
    )
    reference = _onnx_outputs(onnx_path, ids)
    assert np.mean(run_tflite(artifacts.int8, ids).argmax(1) == reference.argmax(1)) >= 0.9


def test_missing_tool_env_is_one_clear_line(
    rgb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    onnx_path, calib, _ = rgb
    monkeypatch.setenv(toolenv.ONNX2TF.env_var, str(tmp_path / "nowhere"))
    with pytest.raises(toolenv.ToolEnvMissingError) as missing:
        convert_tflite(onnx_path, calib, tmp_path / "out")
    assert str(missing.value) == (
        "the ONNX -> TFLite converter (onnx2tf, TensorFlow) environment is missing at "
        f"{tmp_path / 'nowhere'}: run `python -m quant.tflite.toolenv onnx2tf`"
    )


def test_failures_are_one_line_and_keep_the_log(rgb, tmp_path: Path) -> None:
    onnx_path, calib, _ = rgb
    with pytest.raises(TfliteConversionError, match="input 'images' takes"):
        convert_tflite(onnx_path, calib[:, :1], tmp_path / "shape")
    # 0.5 s: far below what onnx2tf can take (starting Python and importing TensorFlow alone
    # took 2.7 s here; the step ~10 s), far above what runs before it starts (~30 ms)
    with pytest.raises(TfliteConversionError, match=r"onnx2tf timed out after \d+ s") as slow:
        convert_tflite(onnx_path, calib, tmp_path / "slow", timeout_s=0.5)
    assert "\n" not in str(slow.value)
    assert (tmp_path / "slow" / "onnx2tf.log").read_text().startswith("$ ")


def test_tool_env_built_from_other_pins_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").touch()
    (env / toolenv.MARKER).write_text('{"pins_hash": "an-older-set"}')
    monkeypatch.setenv(toolenv.ONNX2TF.env_var, str(env))
    assert not toolenv.ONNX2TF.is_ready()
    with pytest.raises(toolenv.ToolEnvMissingError, match="built from other pins"):
        toolenv.ONNX2TF.require()


def test_tool_env_never_deletes_a_directory_that_is_not_a_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "precious.txt").write_text("not a venv")
    monkeypatch.setenv(toolenv.ONNX2TF.env_var, str(tmp_path))
    with pytest.raises(toolenv.ToolEnvError, match="is not a virtual environment"):
        toolenv.ONNX2TF.ensure()
    assert (tmp_path / "precious.txt").is_file()


def test_the_16x8_drift_pass_is_costed_first_and_stopped_when_time_is_up(
    rgb, rgb_16x8, tmp_path: Path
) -> None:
    """LiteRT runs a 16x8 file far slower than its int8 file, so a target times one sample of
    it before its drift pass: with no time for the pass it is not run; started, it stops at
    its first sample past its deadline; with time it measures the file."""
    onnx_path, calib, _ = rgb
    (name,) = [i.name for i in ort.InferenceSession(str(onnx_path)).get_inputs()]
    evaluation = Samples({name: calib[:8]}, None, "test")
    imx93, reference = PROFILES["imx93"], onnx_runner(onnx_path)(evaluation.feeds)

    def job(deadline: Deadline) -> TargetJob:
        return TargetJob(
            profile=imx93, fp32_path=onnx_path, target_dir=tmp_path, out_dir=tmp_path,
            calibration=evaluation, evaluation=evaluation, reference=reference, bars=Bars(0.0, 1.0),
            stage=lambda stage, fraction, detail=None: None, latency_runs=3, deadline=deadline,
        )  # fmt: skip

    wide = rgb_16x8.int16x8
    assert wide is not None
    stopped: list[str] = []
    assert wide_drift(wide, job(Deadline(time.time() + 3600)), 1e6, stopped) is None
    (note,) = stopped
    assert note.startswith(STOPPED) and "the 16x8 file's drift pass would take about" in note
    stopped.clear()
    assert wide_drift(wide, job(StartsButCannotRun(time.time() + 3600)), 0.0, stopped) is None
    (note,) = stopped
    assert "the 16x8 file's drift pass was stopped part way" in note
    stopped.clear()
    measured = wide_drift(wide, job(NO_DEADLINE), 0.0, stopped)
    assert measured is not None and measured.samples == len(evaluation) and stopped == []


def test_the_16x8_file_is_costed_before_it_is_converted(rgb, rgb_16x8, tmp_path: Path) -> None:
    """The 16x8 conversion is not started when the file's drift pass could not end in the job's
    time: that is costed beforehand, from one sample of the float32 file the int8 conversion
    made. An evaluation set of 10^8 samples (one sample broadcast: no memory) cannot be run in
    an hour, whatever the host; 8 samples can."""
    onnx_path, calib, _ = rgb
    (name,) = [i.name for i in ort.InferenceSession(str(onnx_path)).get_inputs()]

    def job(samples: np.ndarray) -> TargetJob:
        evaluation = Samples({name: samples}, None, "test")
        return TargetJob(
            profile=PROFILES["imx93"], fp32_path=onnx_path, target_dir=tmp_path,
            out_dir=tmp_path, calibration=evaluation, evaluation=evaluation,
            reference=np.empty(0, np.float32),
            bars=Bars(0.0, 1.0), stage=lambda stage, fraction, detail=None: None,
            latency_runs=3, deadline=Deadline(time.time() + 3600),
        )  # fmt: skip

    stopped: list[str] = []
    endless = np.broadcast_to(calib[:1], (10**8, *calib.shape[1:]))
    assert not wide_fits(rgb_16x8, job(endless), 0.0, stopped)
    (note,) = stopped
    assert note.startswith(STOPPED)
    assert "the 16x8 file (its conversion and drift pass) would take about" in note
    stopped.clear()
    assert wide_fits(rgb_16x8, job(calib[:8]), 0.0, stopped) and stopped == []
