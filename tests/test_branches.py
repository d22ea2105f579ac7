"""The branches users hit when something is off, each through its public interface: a target
that fails and every target failing (the pipeline, the CLI, a service job), evaluation data
without labels, the guards on negative arguments, the refusals of the two folders with their
reasons, and the HTTP answers around artifacts (Range, If-None-Match: *, 409 before a job has
files) and a graceful shutdown that puts the running job back without counting the attempt.

The models are built here, small and by hand: an ONNX classifier whose Pad (changed in opset
18) cannot be written for the opset-17 TIDL target, and one that casts through int4 (opset 21),
which no opset below 21 can hold.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import psutil
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from converters import ConversionError, OnlineNormError, fold_norms, fold_onnx
from edge_un.norms import UnifiedNorm
from quant.errors import QuantError
from quant.pipeline import convert
from quant.report import Report
from quant.targets import parse_targets
from service import jobs as job_records
from service.db import session_scope
from testbed.live import LiveServer, ServiceMode, wait_for

from .service_live import hold_hook, is_problem, job_processes, submit_parts

PAD_REASON = "cannot write opset 17: Pad changed in opset 18"


# -- small models and their data ------------------------------------------------------------
def classifier(path: Path, tail: str = "pad") -> Path:
    """x (batch, 8) -> MatMul -> Relu -> ``tail`` -> MatMul -> 10 logits, fp32, no norm.

    ``pad``: a Pad at opset 18 (every target but tda4vm takes it); ``int4``: a round trip
    through int4 at opset 21 (no opset below 21 has int4)."""
    rng = np.random.default_rng(0)
    width = 18 if tail == "pad" else 16
    inits = [
        numpy_helper.from_array((rng.normal(size=(8, 16)) / 3).astype(np.float32), "W1"),
        numpy_helper.from_array((rng.normal(size=(width, 10)) / 4).astype(np.float32), "W2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="act"),
    ]
    if tail == "pad":
        inits.append(numpy_helper.from_array(np.array([0, 1, 0, 1], np.int64), "pads"))
        nodes.append(helper.make_node("Pad", ["r", "pads"], ["p"], name="pad"))
    else:
        nodes += [
            helper.make_node("Cast", ["r"], ["q"], name="to_int4", to=TensorProto.INT4),
            helper.make_node("Cast", ["q"], ["p"], name="from_int4", to=TensorProto.FLOAT),
        ]
    nodes.append(helper.make_node("MatMul", ["p", "W2"], ["y"], name="head"))
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    opset = 18 if tail == "pad" else 21
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def fp32_logits(path: Path, inputs: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": inputs})[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The Pad classifier, 64 calibration samples, 150 evaluation samples labelled by the fp32
    model (so its top-1 is 100 %), and the same 150 without labels."""
    folder = tmp_path_factory.mktemp("branches")
    model = classifier(folder / "classifier.onnx")
    inputs = np.random.default_rng(1).normal(size=(214, 8)).astype(np.float32)
    labels = fp32_logits(model, inputs).argmax(-1)
    np.savez(folder / "calib.npz", inputs=inputs[:64])
    np.savez(folder / "eval.npz", inputs=inputs[64:], labels=labels[64:])
    np.savez(folder / "unlabelled.npz", inputs=inputs[64:])
    return {
        "model": model,
        "int4": classifier(folder / "int4.onnx", "int4"),
        "calib": folder / "calib.npz",
        "eval": folder / "eval.npz",
        "unlabelled": folder / "unlabelled.npz",
    }


def run(data: dict[str, Path], out: Path, targets: str, **kwargs) -> Report:
    kwargs = {"model": data["model"], "eval": data["eval"], **kwargs}
    report = convert(
        targets=parse_targets(targets), calib=data["calib"], out_dir=out, latency_runs=3, **kwargs
    )  # fmt: skip
    # what the caller got is what was written
    assert (out / "report.json").read_text() == report.model_dump_json(indent=2) + "\n"
    return report


# -- the pipeline --------------------------------------------------------------------------
def test_a_target_that_fails_is_reported_with_its_reason_and_the_others_complete(
    data, tmp_path: Path
) -> None:
    report = run(data, tmp_path / "out", "cpu,tda4vm")
    tda4vm, cpu = report.targets["tda4vm"], report.targets["cpu"]
    assert (tda4vm.status, tda4vm.error) == ("failed", PAD_REASON)
    assert tda4vm.drift is None and tda4vm.artifacts == []
    assert cpu.status in ("ok", "over_bar") and cpu.error is None and cpu.drift.samples == 150
    assert all((tmp_path / "out" / a.name).is_file() for a in cpu.artifacts)
    summary = (tmp_path / "out" / "report.md").read_text()
    assert f"| tda4vm | failed | - | - | - | - | {PAD_REASON} |" in summary
    assert report.outcome() == "partial"
    assert report.failures() == f"1 of 2 targets failed: tda4vm: {PAD_REASON}"


def test_every_target_failing_before_its_export_still_gives_the_fp32_reference(
    data, tmp_path: Path
) -> None:
    """No target exported anything: the fp32 model is exported once more, at opset 18, for
    the reference top-1 of the report."""
    report = run(data, tmp_path / "out", "tda4vm")
    assert [(t.status, t.error) for t in report.targets.values()] == [("failed", PAD_REASON)]
    assert report.reference.top1_fp32 == 1.0 and report.reference.samples == 150
    assert (tmp_path / "out" / "fp32" / "model_opset18_dynamic.onnx").is_file()
    assert not any(note.startswith("no fp32 reference") for note in report.notes)
    assert report.outcome() == "failed"
    assert report.failures() == f"every target failed: tda4vm: {PAD_REASON}"


def test_when_no_fp32_export_works_the_report_says_why(data, tmp_path: Path) -> None:
    report = run(data, tmp_path / "out", "tda4vm", model=data["int4"])
    (tda4vm,) = report.targets.values()
    assert tda4vm.status == "failed"
    assert tda4vm.error.startswith("cannot convert opset 21 to 18: ") and "'Cast'" in tda4vm.error
    assert "\n" not in tda4vm.error
    assert report.reference.top1_fp32 is None
    assert report.notes[-1] == f"no fp32 reference: the fp32 export failed ({tda4vm.error})"
    assert (tmp_path / "out" / "report.md").is_file()


def test_evaluation_data_without_labels_is_measured_by_agreement_only(data, tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = run(data, out, "cpu", eval=data["unlabelled"])
    assert report.reference.top1_fp32 is None and report.reference.samples == 150
    cpu = report.targets["cpu"]
    drift = cpu.drift
    assert (drift.top1_fp32, drift.top1_int8, drift.top1_drop_pts) == (None, None, None)
    # agreement of the shipped file, recomputed: its exact arithmetic against the source
    inputs = np.load(data["unlabelled"])["inputs"]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    int8 = ort.InferenceSession(str(out / drift.artifact), options).run(None, {"x": inputs})[0]
    agreement = float((int8.argmax(-1) == fp32_logits(data["model"], inputs).argmax(-1)).mean())
    assert drift.agreement == pytest.approx(agreement, abs=1e-9)
    assert drift.within_bar == (drift.agreement >= report.min_agreement)
    assert cpu.status == ("ok" if drift.within_bar else "over_bar")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_drift": -0.1}, "max_drift must be >= 0 points, got -0.1"),
        ({"recalibrate_batches": -1}, "recalibrate_batches must be >= 0, got -1"),
    ],
)
def test_negative_bars_are_refused_before_any_work(
    data, tmp_path: Path, kwargs: dict, message: str
) -> None:
    with pytest.raises(QuantError) as refused:
        convert(data["model"], targets=parse_targets("cpu"), out_dir=tmp_path / "out", **kwargs)
    assert str(refused.value) == message
    assert not (tmp_path / "out").exists()


def test_the_cli_exits_3_when_some_targets_failed_and_1_when_every_one_did(
    data, tmp_path: Path
) -> None:
    """The rule the service's job states follow (``Report.outcome``), as convert's exit code;
    a conversion whose targets all built exits 0."""
    from service.cli.app import main

    def convert(targets: str, out: str) -> int:
        data_files = ["--calib", str(data["calib"]), "--eval", str(data["eval"])]
        return main(["convert", str(data["model"]), "--target", targets, *data_files,
                     "-o", str(tmp_path / out)])  # fmt: skip

    assert convert("cpu,tda4vm", "some") == 3
    assert convert("tda4vm", "every") == 1
    assert convert("cpu", "none") == 0


def test_the_cli_refuses_a_negative_drift_bar_in_one_line(
    data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli.app import main

    out = tmp_path / "out"
    code = main(["convert", str(data["model"]), "--target", "cpu", "--max-drift", "-1",
                 "-o", str(out)])  # fmt: skip
    assert code == 1
    assert capsys.readouterr().err == (
        "edge-un convert: error: max_drift must be >= 0 points, got -1.0\n"
    )
    assert not out.exists()


# -- folding refusals: torch ---------------------------------------------------------------
class TanhNorm(UnifiedNorm):
    """A user's norm that squashes its output: not an affine in eval."""

    def forward(self, x, pad_mask=None):
        return torch.tanh(super().forward(x, pad_mask))


class ResidualNorm(UnifiedNorm):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) + x


class TwoOutputNorm(UnifiedNorm):
    def forward(self, x, pad_mask=None):
        y = super().forward(x, pad_mask)
        return y, 2 * y


class PositionScaledNorm(UnifiedNorm):
    """Scales by a constant per position and channel: not per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.register_buffer("position", torch.rand(3, channels) + 0.5)

    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) * self.position


class Host(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(4, 4), norm, nn.Linear(4, 2)

    def forward(self, x):
        y = self.norm(self.fc(x))
        return self.head(y[0] + y[1] if isinstance(y, tuple) else y)


@pytest.mark.parametrize(
    ("norm", "message"),
    [
        (TanhNorm, "norm norm: aten.tanh.default is not a per-channel affine op"),
        (ResidualNorm, "norm norm is not a per-channel affine (exported in eval?)"),
        (TwoOutputNorm, "norm norm has 2 outputs in the graph, expected 1"),
        (PositionScaledNorm, "norm norm: constant of shape (3, 4) is not per-channel"),
    ],
)
def test_a_norm_that_is_not_an_affine_in_eval_is_refused_by_name(norm, message: str) -> None:
    with pytest.raises(ConversionError) as refused:
        fold_norms(Host(norm(4)).eval(), (torch.randn(2, 3, 4),))
    assert str(refused.value) == message


def test_a_model_torch_cannot_trace_is_one_line() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else x  # data-dependent control flow

    with pytest.raises(ConversionError) as refused:
        fold_norms(Branchy().eval(), (torch.randn(2, 4),))
    assert str(refused.value).startswith("cannot trace Branchy: ")
    assert "data-dependent" in str(refused.value) and "\n" not in str(refused.value)


def test_functional_online_norms_are_found_by_op_and_named_by_their_module() -> None:
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.weight = nn.Linear(4, 4), nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.fc(F.layer_norm(x, (4,), self.weight))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return F.rms_norm(self.inner(x), (4,))

    model, x = Outer().eval(), torch.randn(2, 4)
    with pytest.raises(OnlineNormError) as refused:
        fold_norms(model, (x,))
    assert str(refused.value).startswith(
        "online norms cannot fold: inner (Inner), the model's forward (Outer); migrate the model"
    )
    folded, report = fold_norms(model, (x,), allow_online=True)
    assert report.online_norms == ("inner (Inner)", "the model's forward (Outer)")
    assert not report.fully_integer and torch.allclose(folded(x), model(x))


# -- folding refusals: ONNX from any framework ---------------------------------------------
C = 4


def _onnx_case(
    before: list, after: list, inputs: dict[str, list], outputs: list[str], constants: dict
) -> onnx.ModelProto:
    """x -> ``before`` -> n0 -> Mul s -> Add t (the norm: n2) -> ``after``."""
    rng = np.random.default_rng(7)
    inits = [
        numpy_helper.from_array(rng.uniform(0.5, 2.0, C).astype(np.float32), "s"),
        numpy_helper.from_array(rng.normal(size=C).astype(np.float32), "t"),
        *(numpy_helper.from_array(value, name) for name, value in constants.items()),
    ]
    nodes = [
        *before,
        helper.make_node("Mul", ["n0", "s"], ["n1"], name="norm_mul"),
        helper.make_node("Add", ["n1", "t"], ["n2"], name="norm_add"),
        *after,
    ]
    graph = helper.make_graph(
        nodes,
        "case",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    typed = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.output}
    for value in model.graph.output:
        value.CopyFrom(typed[value.name])
    onnx.checker.check_model(model, full_check=True)
    return model


def _w(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).normal(size=shape).astype(np.float32)


def _node(op: str, inputs: list[str], output: str, name: str, **attributes) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=name, **attributes)


IDENTITY = _node("Identity", ["x"], "n0", "copy")
SIGMOID = _node("Sigmoid", ["n2"], "y", "sig")
GRAPH_INPUT = "backward: its input x is a graph input"
ONNX_REFUSALS = {
    "model output": (
        [IDENTITY], [], {"x": ["b", C]}, ["n2"], {},
        ["forward: n2 is a model output", GRAPH_INPUT],
    ),
    "MatMul weight not constant": (
        [IDENTITY], [_node("MatMul", ["n2", "w"], "y", "mm")], {"x": ["b", C], "w": [C, 3]},
        ["y"], {}, ["forward: mm has no constant 2-D weight", GRAPH_INPUT],
    ),
    "Gemm transA reads it": (
        [IDENTITY], [_node("Gemm", ["n2", "Wg"], "y", "gemm", transA=1)], {"x": [6, C]}, ["y"],
        {"Wg": _w(6, 3)}, ["forward: gemm is Gemm", GRAPH_INPUT],
    ),
    "Gemm transA makes it": (
        [_node("Gemm", ["x", "Wp"], "n0", "gemm", transA=1)], [SIGMOID], {"x": [6, 3]}, ["y"],
        {"Wp": _w(6, C)},
        ["forward: it feeds sig (Sigmoid) does not commute", "backward: gemm is Gemm"],
    ),
    "Gemm weight shared": (
        [IDENTITY], [_node("Gemm", ["n2", "Ws"], "y", "g1"), _node("Gemm", ["x", "Ws"], "z", "g2")],
        {"x": ["b", C]}, ["y", "z"], {"Ws": _w(C, C)},
        ["forward: g1 has no constant weight of its own", GRAPH_INPUT],
    ),
    "Reshape moves channels": (
        [IDENTITY],
        [_node("Reshape", ["n2", "shape"], "r", "flat"), _node("MatMul", ["r", "Wr"], "y", "mm")],
        {"x": [2, 3, C]}, ["y"], {"shape": np.array([2, 3 * C], np.int64), "Wr": _w(3 * C, 2)},
        ["forward: it feeds flat (Reshape) moves the channel axis", GRAPH_INPUT],
    ),
    "ReduceMean over channels": (
        [IDENTITY],
        [_node("ReduceMean", ["n2", "axes"], "r", "pool"), _node("MatMul", ["r", "W1"], "y", "mm")],
        {"x": ["b", 3, C]}, ["y"], {"axes": np.array([-1], np.int64), "W1": _w(1, 2)},
        ["forward: it feeds pool (ReduceMean) acts on the channel axis", GRAPH_INPUT],
    ),
    "Slice of channels": (
        [IDENTITY], [_node("Slice", ["n2", "starts", "ends", "axes"], "r", "cut"),
                     _node("MatMul", ["r", "W2"], "y", "mm")],
        {"x": ["b", C]}, ["y"],
        {"starts": np.array([0], np.int64), "ends": np.array([2], np.int64),
         "axes": np.array([1], np.int64), "W2": _w(2, 2)},
        ["forward: it feeds cut (Slice) acts on the channel axis", GRAPH_INPUT],
    ),
    "read as a second input": (
        [IDENTITY],
        [_node("Concat", ["x", "n2"], "r", "cat", axis=0), _node("MatMul", ["r", "W3"], "y", "mm")],
        {"x": ["b", C]}, ["y"], {"W3": _w(C, 2)},
        ["forward: it feeds cat (Concat) reads it as something other than data", GRAPH_INPUT],
    ),
    "input read elsewhere": (
        [_node("MatMul", ["x", "Wq"], "n0", "fc")], [_node("Add", ["n2", "n0"], "y", "res")],
        {"x": ["b", 3]}, ["y"], {"Wq": _w(3, C)},
        ["forward: it feeds res (Add) adds it to another tensor (a residual or a mask)",
         "backward: its input n0 is also read elsewhere"],
    ),
    "input from an activation": (
        [_node("Relu", ["x"], "n0", "act")], [SIGMOID], {"x": ["b", C]}, ["y"], {},
        ["forward: it feeds sig (Sigmoid) does not commute with a per-channel affine",
         "backward: its input comes from act"],
    ),
    "Reshape splits channels": (
        [_node("MatMul", ["x", "Wm"], "h", "fc"), _node("Reshape", ["h", "shape"], "n0", "split")],
        [SIGMOID], {"x": [2, 8]}, ["y"], {"Wm": _w(8, 8), "shape": np.array([2, 2, C], np.int64)},
        ["backward: split (Reshape) mixes the channel axis"],
    ),
    "Conv weight not constant": (
        [_node("Conv", ["x", "k"], "c", "conv"),
         _node("Transpose", ["c"], "n0", "nhwc", perm=[0, 2, 3, 1])],
        [SIGMOID], {"x": [1, 2, 3, 3], "k": [C, 2, 1, 1]}, ["y"], {},
        ["backward: conv has no constant weight"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ONNX_REFUSALS))
def test_an_onnx_chain_that_cannot_fold_stays_one_mul_add_and_says_why(case: str) -> None:
    before, after, inputs, outputs, constants, reasons = ONNX_REFUSALS[case]
    model = _onnx_case(before, after, inputs, outputs, constants)
    folded, report = fold_onnx(model)
    (norm,) = report.norms
    assert norm.action == "scale_shift" and norm.into == (), str(report)
    for reason in reasons:
        assert reason in norm.reason, norm.reason
    rng = np.random.default_rng(3)
    feeds = {
        name: rng.normal(size=[2 if isinstance(d, str) else d for d in shape]).astype(np.float32)
        for name, shape in inputs.items()
    }
    expected = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    actual = ort.InferenceSession(folded.SerializeToString()).run(None, feeds)
    for want, got in zip(expected, actual, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_gemm_without_transa_takes_the_fold_the_transposed_one_refuses() -> None:
    """The control of the transA cases: the same graph with a plain Gemm folds forward, and
    still computes the same; a fold into the transposed one would scale its rows instead."""
    model = _onnx_case(
        [IDENTITY], [_node("Gemm", ["n2", "Wg"], "y", "gemm")], {"x": [6, C]}, ["y"],
        {"Wg": _w(C, 3)},
    )  # fmt: skip
    folded, report = fold_onnx(model)
    assert [(n.action, n.into) for n in report.norms] == [("folded_forward", ("gemm",))]
    x = np.random.default_rng(3).normal(size=(6, C)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    actual = ort.InferenceSession(folded.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


# -- the service ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def service(tmp_path_factory, service_mode: ServiceMode):
    """A server whose job processes wait, once started, while ``hold`` exists (not at first)."""
    root = tmp_path_factory.mktemp("service")
    env, hold = hold_hook(root / "hook")
    hold.unlink()
    server = service_mode.server(root / "data", **env).start()
    yield server, hold
    hold.unlink(missing_ok=True)
    server.stop()


def submit(client, data: dict[str, Path], targets: str, parts=("model", "calib", "eval")):
    files = {part: (data[part].name, data[part].read_bytes()) for part in parts}
    return submit_parts(client, files, targets)["id"]


@pytest.fixture(scope="module")
def one_failed(service, data) -> tuple[str, str]:
    """(token, job id) of a job whose tda4vm target failed and whose cpu target did not."""
    server, _ = service
    token = server.token("one-failed")
    with server.client(token) as client:
        job_id = submit(client, data, "cpu,tda4vm")
        wait_for(client, job_id, ("partial",), timeout=300)
    return token, job_id


def test_a_job_with_a_failed_target_is_partial_and_says_why(service, one_failed):
    """Some targets failed, the others were built: the job is partial (the rule convert's exit
    code 3 follows), its error names the failed target, and its files are published."""
    server, _ = service
    token, job_id = one_failed
    with server.client(token) as client:
        job = client.get(f"/v1/conversions/{job_id}").json()
        report = client.get(f"/v1/conversions/{job_id}/report").json()
    assert job["state"] == "partial"
    assert job["error"] == f"1 of 2 targets failed: tda4vm: {PAD_REASON}"
    tda4vm = report["targets"]["tda4vm"]
    assert (tda4vm["status"], tda4vm["error"]) == ("failed", PAD_REASON)
    assert report["targets"]["cpu"]["status"] in ("ok", "over_bar")


def test_a_job_whose_every_target_fails_is_failed_with_each_reason(service, data):
    """The int4 model: no opset below 21 holds it, so tda4vm (17) and imx93 (20) both fail."""
    server, _ = service
    with server.client(server.token("all-failed")) as client:
        job_id = submit(client, {**data, "model": data["int4"]}, "tda4vm,imx93")
        failed = wait_for(client, job_id, ("failed",), timeout=300)
        reasons = failed["error"].removeprefix("every target failed: ").split("; ")
        assert failed["error"].startswith("every target failed: ") and len(reasons) == 2
        assert reasons[0].startswith("tda4vm: cannot convert opset 21 to "), reasons
        assert reasons[1].startswith("imx93: cannot convert opset 21 to 20: "), reasons
        report = client.get(f"/v1/conversions/{job_id}/report")  # written all the same
        assert report.status_code == 200
        assert [t["status"] for t in report.json()["targets"].values()] == ["failed", "failed"]


def test_range_requests_get_the_bytes_asked_or_a_problem(service, one_failed):
    server, _ = service
    token, job_id = one_failed
    url = f"/v1/conversions/{job_id}/artifacts/cpu/model_int8.onnx"
    with server.client(token) as client:
        whole = client.get(url).content
        size = len(whole)
        part = client.get(url, headers={"Range": "bytes=0-9"})
        assert part.status_code == 206 and part.content == whole[:10]
        for header, status in (
            (f"bytes={size}-", 416),  # starts past the end
            ("bytes=5-2", 416),  # ends before it starts
            ("items=0-1", 400),  # not a byte range at all
        ):
            problem = is_problem(client.get(url, headers={"Range": header}), status)
            assert problem["detail"] == (
                f"the Range header {header!r} does not fit the file of {size} bytes; "
                "send bytes=START-END, or no Range for the whole file"
            )


def test_if_none_match_star_is_not_modified_and_another_tag_gets_the_file(service, one_failed):
    server, _ = service
    token, job_id = one_failed
    url = f"/v1/conversions/{job_id}/artifacts/report.json"
    with server.client(token) as client:
        full = client.get(url)
        star = client.get(url, headers={"If-None-Match": "*"})
        assert star.status_code == 304 and star.content == b""
        assert star.headers["etag"] == full.headers["etag"]
        other = client.get(url, headers={"If-None-Match": '"0000", "1111"'})
        assert other.status_code == 200 and other.content == full.content


def test_a_job_that_failed_before_its_report_has_no_artifacts(service, data):
    server, _ = service
    with server.client(server.token("no-data")) as client:
        job_id = submit(client, data, "cpu", parts=("model",))  # an ONNX model, no data
        failed = wait_for(client, job_id, ("failed",), timeout=300)
        assert "records no data set: give calibration data" in failed["error"]
        for route in ("report", "artifacts", "artifacts/report.json", "bundle.zip"):
            problem = is_problem(client.get(f"/v1/conversions/{job_id}/{route}"), 409)
            assert problem["title"] == "No artifacts", route
            assert problem["detail"] == (
                f"the conversion failed: {failed['error']}; it has no report or artifacts"
            )


def test_an_unfinished_job_has_no_artifacts_yet(service, data):
    """Held once started (the hold hook), so the answers below meet it running, and the job
    after it queued behind it (one job at a time)."""
    server, hold = service
    hold.touch()
    try:
        with server.client(server.token("unfinished")) as client:
            running = submit(client, data, "cpu")
            wait_for(client, running, ("running",), stage_not_in=("starting", None))
            queued = submit(client, data, "cpu")
            for job_id, state in ((running, "running (load, 1 %)"),
                                  (queued, "queued (waiting, 0 %)")):  # fmt: skip
                for route in ("report", "artifacts/report.json", "bundle.zip"):
                    answer = client.get(f"/v1/conversions/{job_id}/{route}")
                    problem = is_problem(answer, 409)
                    assert problem["title"] == "Not finished", route
                    assert problem["detail"] == (
                        f"the conversion is {state}; poll it until it has finished"
                    )
            for job_id in (queued, running):
                assert client.delete(f"/v1/conversions/{job_id}").json()["state"] == "cancelled"
    finally:
        hold.unlink(missing_ok=True)


def test_a_graceful_shutdown_queues_the_running_job_again_without_using_an_attempt(
    tmp_path: Path, data
):
    """Local queue: SIGTERM to the server stops the job process and puts its job back at its
    place, attempts as before the run; the next start runs it as its first attempt. (Held once
    started, by the hold hook: the shutdown meets it running, however fast the machine.)"""
    env, _ = hold_hook(tmp_path / "hook")  # held while the file exists: all along here
    server = LiveServer(tmp_path / "data", **env).start()
    try:
        token = server.token()
        with server.client(token) as client:
            job_id = submit(client, data, "cpu")
            wait_for(client, job_id, ("running",), stage_not_in=("starting", None))
        (pid,) = job_processes(server, job_id)
        process = psutil.Process(pid)
        server.stop()
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
        with session_scope(server.settings) as session:
            assert job_records.state_of(session, job_id) == ("queued", 0)
            assert job_records.stage_of(session, job_id) is None
        restarted = LiveServer(tmp_path / "data", **env).start()
        try:
            with restarted.client(token) as client:
                again = wait_for(client, job_id, ("running",), stage_not_in=("starting", None))
                assert again["attempts"] == 1
                client.delete(f"/v1/conversions/{job_id}")  # done: no need to convert it
            assert "recovered jobs" not in restarted.log()  # nothing was left running
        finally:
            restarted.stop()
    finally:
        server.stop()
