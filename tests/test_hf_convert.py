"""A user's own Transformer converts: the bundled Hugging Face ViT and BERT (UN, trained on the
shipped data), exported the ways torch exports them today, reach every target.

Each export is made here as a user would: ``torch.export`` of the HF model as is (a ``.pt2``
whose output is a ``ModelOutput``), ``torch.onnx.export`` with its defaults (dynamo, opset 20,
weights in ``model.onnx.data``) and the legacy exporter (GELU as Erf, Shape nodes, a Gather for
the cls token). Calibration and evaluation ``.npz`` files hold one array per model input, named
as the model names it. The ViT is converted from all three (the default ONNX for the ONNX
Runtime targets only); the two-input BERT (``input_ids``, ``attention_mask``, HF's float32-min
mask) from the default ONNX through the CLI for every target and from the other two through the
library for the ONNX Runtime targets.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import edge_un
from edge_un import examples
from quant.pipeline import convert
from quant.report import Report
from quant.samples import InputSpec, checkpoint_samples
from quant.targets import TARGET_NAMES
from quant.tflite.flatbuffer import check_full_integer, inspect_tflite
from quant.tflite.litert import xnnpack_ops

CALIBRATION = 128
EVALUATION = {"vit": 1000, "bert": 500}  # the ViT's whole test split: its bar is 10 images
QUICK_TARGETS = ("cpu", "tda4vm")  # the ONNX Runtime targets: no TFLite conversion


def export_all(model: torch.nn.Module, feeds: dict[str, np.ndarray], directory: Path) -> dict:
    """The model exported as users do, from a batch of one: .pt2, ONNX default, ONNX legacy."""
    example = tuple(torch.from_numpy(array[:1]) for array in feeds.values())
    names = list(feeds)
    torch.export.save(torch.export.export(model, example), directory / "model.pt2")
    with contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(model, example, directory / "model.onnx", input_names=names)
        torch.onnx.export(model, example, directory / "legacy.onnx", dynamo=False,
                          input_names=names)  # fmt: skip
    assert (directory / "model.onnx.data").is_file()  # the default keeps weights apart
    return {"pt2": directory / "model.pt2", "onnx": directory / "model.onnx",
            "legacy": directory / "legacy.onnx"}  # fmt: skip


def user_data(
    info: edge_un.CheckpointInfo, specs: tuple[InputSpec, ...], directory: Path, count: int
) -> dict:
    """calib.npz and eval.npz with one array per model input, named as the model names it."""
    calibration = checkpoint_samples(info, "train", CALIBRATION, specs)
    evaluation = checkpoint_samples(info, "test", specs=specs).head(count)
    np.savez(directory / "calib.npz", **calibration.feeds)
    np.savez(directory / "eval.npz", **evaluation.feeds, labels=evaluation.labels)
    return {"calib": directory / "calib.npz", "eval": directory / "eval.npz",
            "feeds": evaluation.feeds}  # fmt: skip


@pytest.fixture(scope="module")
def vit(tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = tmp_path_factory.mktemp("hf_vit")
    model, info = edge_un.load_pretrained(examples.path("hf-vit-mnist-un"))
    spec = InputSpec("pixel_values", (1, 28, 28), "float32")
    data = user_data(info, (spec,), directory, EVALUATION["vit"])
    return {"dir": directory, **data, **export_all(model, data["feeds"], directory)}


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = tmp_path_factory.mktemp("hf_bert")
    model, info = edge_un.load_pretrained(examples.path("hf-bert-rt-un"))
    length = info.metadata["preprocessing"]["tokenizer"]["max_len"]
    specs = tuple(InputSpec(n, (length,), "int64") for n in ("input_ids", "attention_mask"))
    data = user_data(info, specs, directory, EVALUATION["bert"])
    return {"dir": directory, **data, **export_all(model, data["feeds"], directory)}


def convert_with_cli(source: Path, data: dict, out: Path) -> Report:
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "convert", str(source), "--calib",
         str(data["calib"]), "--eval", str(data["eval"]), "-o", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    return Report.read(out / "report.json")


def check_every_target_converted(report: Report, samples: int) -> None:
    """No target failed, each has its drift on the evaluation data and a file of its own."""
    assert list(report.targets) == list(TARGET_NAMES)
    for target in report.targets.values():
        assert target.status != "failed", (target.name, target.error)
        assert target.drift is not None and target.drift.samples == samples
        assert target.drift.agreement > 0.9 and target.artifacts


def check_vit(report: Report, out: Path) -> None:
    check_every_target_converted(report, EVALUATION["vit"])
    norms = report.fold["norms"]
    assert len(norms) == 9 and all(n["action"].startswith("folded") for n in norms), norms
    imx93 = report.targets["imx93"]  # pure int8, within the bar, every op on the NPU
    assert imx93.status == "ok" and imx93.vela_pure_int8 is None, imx93.excluded
    assert imx93.vela is not None and imx93.vela.cpu_ops == [], imx93.vela
    tflite = next(a for a in imx93.artifacts if a.format == "tflite")
    info = inspect_tflite(out / tflite.name)
    check_full_integer(info)
    matmuls = info.op_histogram["BATCH_MATMUL"]  # issue 32: XNNPACK runs each one
    assert matmuls and xnnpack_ops(info.path)["BATCH_MATMUL"] == (matmuls, matmuls)


@pytest.fixture(scope="module")
def vit_reports(vit: dict) -> dict[str, Report]:
    """The ViT converted from each export, with the same calib.npz and eval.npz: the program
    through the CLI and the legacy ONNX through the library for every target, the default
    ONNX through the library for the quick targets (``QUICK_TARGETS``): its TFLite route is the
    legacy file's, ONNX to onnx2tf (benchmarks/conversion/fold_formats converts every export for
    every target)."""
    reports = {"pt2": convert_with_cli(vit["pt2"], vit, vit["dir"] / "out_pt2")}
    for export, targets in (("onnx", QUICK_TARGETS), ("legacy", None)):
        reports[export] = convert(vit[export], targets=targets, calib=vit["calib"],
                                  eval=vit["eval"], out_dir=vit["dir"] / f"out_{export}",
                                  latency_runs=5)  # fmt: skip
    return reports


def test_the_hf_vit_program_as_exported_converts_for_every_target(
    vit: dict, vit_reports: dict[str, Report]
) -> None:
    report = vit_reports["pt2"]
    check_vit(report, vit["dir"] / "out_pt2")
    assert any("kept 'logits' as the model output" in note for note in report.notes)


def test_the_hf_vit_legacy_onnx_export_converts_for_every_target(
    vit: dict, vit_reports: dict[str, Report]
) -> None:
    report = vit_reports["legacy"]
    check_vit(report, vit["dir"] / "out_legacy")
    assert report.model.inputs[0].name == "pixel_values"


def test_the_hf_vit_default_onnx_export_converts_for_the_quick_targets(
    vit_reports: dict[str, Report],
) -> None:
    report = vit_reports["onnx"]
    assert list(report.targets) == list(QUICK_TARGETS)
    for target in report.targets.values():
        assert target.status == "ok", (target.name, target.error, target.drift)
        assert target.drift.samples == EVALUATION["vit"]
    assert report.model.inputs[0].name == "pixel_values"


def check_alike(reports: dict[str, Report], targets: tuple[str, ...]) -> None:
    """One fold (the same norms into the same layers) and, per target, the same agreement
    within 0.3 pt whatever the export: the converter, not the file's format, decides (a program
    and an ONNX file take different TFLite routes, litert-torch and onnx2tf: on the ViT's 1000
    test images they differ by 3 flips, 99.5 and 99.8 %, the program's cosine the closer)."""
    placements = {
        export: {n["name"]: (n["action"], tuple(n["into"])) for n in report.fold["norms"]}
        for export, report in reports.items()
    }
    first = next(iter(placements.values()))
    assert all(p == first for p in placements.values()), placements
    for target in targets:
        agreement = {e: r.targets[target].drift.agreement for e, r in reports.items()}
        spread = round(max(agreement.values()) - min(agreement.values()), 9)  # 0.998 - 0.995
        assert spread <= 0.003, (target, agreement)


def test_the_hf_vit_converts_alike_from_every_export(vit_reports: dict[str, Report]) -> None:
    check_alike(vit_reports, QUICK_TARGETS)
    check_alike({e: vit_reports[e] for e in ("pt2", "legacy")}, TARGET_NAMES)


@pytest.fixture(scope="module")
def bert_reports(bert: dict) -> dict[str, Report]:
    """The BERT converted from each export with the same data: the default ONNX through the
    CLI for every target, the program and the legacy ONNX through the library for the quick
    targets (cpu, tda4vm)."""
    reports = {"onnx": convert_with_cli(bert["onnx"], bert, bert["dir"] / "out_onnx")}
    for export in ("pt2", "legacy"):
        out = bert["dir"] / f"out_{export}"
        reports[export] = convert(bert[export], targets=QUICK_TARGETS,
                                  calib=bert["calib"], eval=bert["eval"], out_dir=out,
                                  latency_runs=5)  # fmt: skip
    return reports


def test_the_hf_bert_onnx_default_export_converts_for_every_target(
    bert: dict, bert_reports: dict[str, Report]
) -> None:
    """Two integer inputs, HF's float32-min mask, post-norm: every target, fully integer."""
    report = bert_reports["onnx"]
    check_every_target_converted(report, EVALUATION["bert"])
    assert [i.name for i in report.model.inputs] == ["input_ids", "attention_mask"]
    assert any("rewritten as Where(attention_mask == 0, -30, 0)" in n for n in report.notes)
    # post-norm: the norms that feed a residual stay one Mul + Add each, and say why; the
    # embeddings norm folds into the embedding tables, which is what brings the NPU files
    # within the bar (measured: imx93 96.6 % agreement with it kept as a Mul + Add, 99.5 %)
    norms = {n["name"]: n for n in report.fold["norms"]}
    kept = [n for n in norms.values() if n["action"] == "scale_shift"]
    assert len(norms) == 5 and len(kept) == 3 and all(n["reason"] for n in kept)
    embeddings = norms["bert.embeddings.LayerNorm"]
    assert "bert.embeddings.word_embeddings" in embeddings["into"], embeddings
    for name in ("imx93", "imx8mp"):  # whole test split: 99.5 % (with it kept, 96.6 %)
        assert report.targets[name].drift.agreement >= 0.985, report.targets[name].drift
    for name in ("imx93", "imx8mp"):  # ids and mask stay int64 inputs; nothing in float
        target = report.targets[name]
        tflite = next(a for a in target.artifacts if a.format == "tflite")
        info = inspect_tflite(bert["dir"] / "out_onnx" / tflite.name)
        check_full_integer(info)
        # issue 32: XNNPACK runs every attention product (each right operand at zero point 0)
        matmuls = info.op_histogram["BATCH_MATMUL"]
        assert xnnpack_ops(info.path)["BATCH_MATMUL"] == (matmuls, matmuls) == (4, 4)
        groups = target.matmul_operands
        assert sum(g.matmuls for g in groups) == matmuls and all(g.new_scale for g in groups)
        assert target.drift.within_bar, target.drift
        assert {(i.name, i.dtype) for i in target.inputs} == {
            ("input_ids", "int64"),
            ("attention_mask", "int64"),
        }


@pytest.mark.parametrize("export", ["pt2", "legacy"])
def test_the_other_hf_bert_exports_convert(bert_reports: dict[str, Report], export: str) -> None:
    for target in bert_reports[export].targets.values():
        assert target.status != "failed", (target.name, target.error)
        assert target.drift.agreement > 0.95


def test_the_hf_bert_converts_alike_from_every_export(bert_reports: dict[str, Report]) -> None:
    """Before the one fold engine the .pt2 and ONNX routes named different embedding tables."""
    check_alike(bert_reports, QUICK_TARGETS)


@pytest.mark.parametrize(
    ("name", "inputs"),
    [("hf-vit-mnist-un", ["pixel_values"]), ("hf-bert-rt-un", ["input_ids", "attention_mask"])],
)
def test_a_save_pretrained_directory_converts_directly(
    tmp_path: Path, name: str, inputs: list[str]
) -> None:
    """The directory itself (here by the bundled example's name): traced with its own forward
    arguments, calibrated and evaluated on the data set it records, no .npz needed."""
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "convert", name, "--target", "cpu", "-o",
         str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = Report.read(tmp_path / "out" / "report.json")
    assert report.model.source_format == "hf" and report.model.name == name
    assert [i.name for i in report.model.inputs] == inputs
    assert report.reference.eval_source == "checkpoint test split"
    _, info = edge_un.load_pretrained(examples.path(name))
    assert report.reference.top1_fp32 == pytest.approx(info.metadata["test_accuracy"], abs=2e-3)
    assert report.targets["cpu"].status == "ok"
    # issue 21: each worst layer names its module of the Hugging Face model (bert.encoder...,
    # vit.layers...), beside the ONNX tensor
    worst = report.targets["cpu"].drift.worst_layers
    head = name.split("-")[1]  # hf-vit-mnist-un: vit, hf-bert-rt-un: bert
    assert worst and all((layer.module or "").startswith(f"{head}.") for layer in worst), worst


def test_the_hf_bert_onnx_export_converts_over_http(bert: dict, tmp_path: Path) -> None:
    """The same two-input ONNX export with its weights in model.onnx.data, uploaded to a real
    server (local queue) as model + model_data with the two-array .npz files: the job runs the
    one pipeline the CLI test above ran for every target (here cpu and tda4vm, the quick ones)
    and its report names both inputs."""
    from testbed.live import ServiceMode

    from .service_live import converted

    server = ServiceMode("local").server(tmp_path / "data", EDGE_UN_WORKERS="1")
    server.start()
    try:
        names = ("model.onnx", "model.onnx.data", "calib.npz", "eval.npz")
        fields = ("model", "model_data", "calib", "eval")
        parts = [
            (field, (name, (bert["dir"] / name).read_bytes()))
            for field, name in zip(fields, names, strict=True)
        ]
        with server.client(server.token("hf")) as client:
            _, report = converted(client, parts, "cpu,tda4vm", timeout=600)
    finally:
        server.stop()
    assert [i["name"] for i in report["model"]["inputs"]] == ["input_ids", "attention_mask"]
    for name in ("cpu", "tda4vm"):
        target = report["targets"][name]
        assert target["status"] != "failed", (name, target["error"])
        assert target["drift"]["samples"] == EVALUATION["bert"]
