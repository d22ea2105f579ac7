"""The cpu target's int8 recipe for every host: which weights and activations compute the same
with and without VNNI, at what accuracy and speed.

    .venv/bin/python -m benchmarks.studies.cpu_recipe                # ~8 min on 2 cores
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.studies.cpu_recipe --report-only

ONNX Runtime's x86 u8s8 (and s8s8) kernels without VNNI add pairs of u8 x s8 products into
int16 (VPMADDUBSW), which saturates with 8-bit weights. Candidates, each the cpu profile with one
change (``quant.ort.quantize.quantize_onnx``): the 8-bit weights it had, 7-bit weights
(``reduce_range``), uint8 weights (U8U8 kernels, no VPMADDUBSW), and int8 symmetric activations.
Each is measured on the bundled UN models' held-out test split, against their fp32 ONNX:

* exact: the QDQ graph as written (``onnx_runner(exact=True)``: no fused int8 kernel), what any
  non-saturating integer kernel computes;
* this host's int8 kernels (``onnx_runner``);
* on a host with VNNI, also ONNX Runtime under QEMU's Haswell model (``quant.measure.emulation``):
  the kernels of an x86 without VNNI. On a host without VNNI that is what "this host" already is.

Speed: batch 1, one thread, every candidate and the fp32 file of a model in one process,
round-robin (``ROUNDS`` x ``CALLS``), medians; ViT-Tiny (random weights: timing only) and two
bundled models. Speed is of this host's kernels only: a VNNI host's cannot be emulated.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import onnxruntime as ort
import torch

import edge_un
from benchmarks.common.results import benchmark_main, save_figure
from converters.fold_and_export import export_folded, load_and_fold
from edge_un import examples
from edge_un.models import VisionTransformer
from quant.host import VNNI, describe_host
from quant.measure.bars import DEFAULT_MIN_AGREEMENT
from quant.measure.drift import measure_drift, onnx_runner
from quant.measure.emulation import qemu_available, run_onnx_emulated
from quant.ort.quantize import quantize_onnx
from quant.samples import Samples, as_feeds, checkpoint_samples
from quant.targets import PROFILES, TargetProfile

NAME = "cpu_recipe"
ACCURACY_MODELS = ("vit-mnist-ln-to-un", "vit-mnist-un", "text-rt-un", "text-rt-ln-to-un")
SPEED_MODELS = ("vit-tiny-un", "vit-mnist-ln-to-un", "text-rt-un")
TINY = dict(img_size=224, in_chans=3, patch_size=16, dim=192, depth=12, heads=3, mlp_ratio=4.0,
            num_classes=1000, pool="cls")  # fmt: skip
EMULATED_SAMPLES = 300  # QEMU runs ~100x slower than native
ROUNDS, CALLS = 20, 5
CPU = PROFILES["cpu"]
CANDIDATES: dict[str, TargetProfile] = {
    "s8 weights, 8 bits (before)": dataclasses.replace(CPU, weight_bits=8),
    "s8 weights, 7 bits (chosen)": dataclasses.replace(CPU, weight_bits=7),
    "u8 weights (U8U8)": dataclasses.replace(CPU, weight_type="uint8", weight_bits=8),
    "s8 symmetric activations": dataclasses.replace(
        CPU, weight_bits=8, activation_type="int8", symmetric_activations=True
    ),
}


def model_data(name: str, work: Path) -> tuple[Path, Samples, Samples]:
    """(fp32 ONNX at the cpu opset, calibration samples, evaluation samples) of one model."""
    fp32 = work / f"{name}.onnx"
    if name == "vit-tiny-un":
        checkpoint = work / "vit-tiny-un.safetensors"
        torch.manual_seed(0)
        edge_un.save_checkpoint(VisionTransformer(**TINY, norm="un").eval(), checkpoint)
        rng = np.random.default_rng(0)
        calibration = Samples(
            as_feeds(rng.standard_normal((32, 3, 224, 224), np.float32)), None, "random"
        )
        evaluation = Samples(
            as_feeds(rng.standard_normal((8, 3, 224, 224), np.float32)), None, "random"
        )
    else:
        checkpoint = examples.path(name)
        _, info = edge_un.load_checkpoint(checkpoint)
        calibration = checkpoint_samples(info, "train", 256)
        evaluation = checkpoint_samples(info, "test")
    export_folded(load_and_fold(checkpoint), fp32, opset=CPU.opset, dynamic_batch=True)
    return fp32, calibration, evaluation


def accuracy(name: str, work: Path, emulate: bool) -> dict[str, Any]:
    fp32, calibration, evaluation = model_data(name, work)
    reference = onnx_runner(fp32)(evaluation.inputs)
    rows = {}
    for label, profile in CANDIDATES.items():
        path = work / f"{name}-{len(rows)}.onnx"
        quantize_onnx(fp32, path, profile, calibration)
        row = {}
        for kernels, run in (("exact", onnx_runner(path, exact=True)), ("host", onnx_runner(path))):
            drift = measure_drift(reference, run(evaluation.inputs), evaluation.labels)
            row[kernels] = {"agreement": drift.agreement, "drop_pts": drift.top1_drop_pts}
        if emulate:
            head = evaluation.head(EMULATED_SAMPLES)
            outputs = run_onnx_emulated(path, head.inputs)
            drift = measure_drift(reference[: len(head)], outputs, head.labels)
            row["haswell"] = {"agreement": drift.agreement, "drop_pts": drift.top1_drop_pts,
                              "samples": len(head)}  # fmt: skip
        rows[label] = row
        print(f"  {name} / {label}: " + ", ".join(
            f"{k} {100 * v['agreement']:.2f} %" for k, v in row.items()), flush=True)  # fmt: skip
    return {"samples": len(evaluation), "candidates": rows}


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def speed(name: str, work: Path) -> dict[str, Any]:
    fp32, calibration, evaluation = model_data(name, work)
    files = {"fp32": fp32}
    for index, (label, profile) in enumerate(CANDIDATES.items()):
        files[label] = quantize_onnx(fp32, work / f"{name}-speed-{index}.onnx", profile,
                                     calibration)  # fmt: skip
    sessions = {label: session(path) for label, path in files.items()}
    feed_name = sessions["fp32"].get_inputs()[0].name
    feed = {feed_name: evaluation.inputs[:1]}
    times: dict[str, list[float]] = {label: [] for label in sessions}
    for one in sessions.values():  # warm-up
        for _ in range(3):
            one.run(None, feed)
    for _ in range(ROUNDS):
        for label, one in sessions.items():
            for _ in range(CALLS):
                start = time.perf_counter()
                one.run(None, feed)
                times[label].append(time.perf_counter() - start)
    medians = {label: 1e3 * float(np.median(t)) for label, t in times.items()}
    print(f"  {name}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in medians.items()), flush=True)
    return {"median_ms": medians, "p90_ms": {k: 1e3 * float(np.percentile(t, 90))
                                            for k, t in times.items()}}  # fmt: skip


def run() -> dict[str, Any]:
    host = describe_host()
    emulate = bool(set(host.int8_features) & VNNI) and qemu_available()
    torch.set_num_threads(1)
    results: dict[str, Any] = {"host": host.model_dump(), "emulated_haswell": emulate}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        results["accuracy"] = {name: accuracy(name, work, emulate) for name in ACCURACY_MODELS}
        results["speed"] = {name: speed(name, work) for name in SPEED_MODELS}
    return results


def markdown(results: dict[str, Any]) -> str:
    from quant.report import Host

    host = Host.model_validate(results["host"])
    kernels = ["exact", "host"] + (["haswell"] if results["emulated_haswell"] else [])
    titles = {"exact": "exact", "host": "this host's kernels",
              "haswell": "emulated Haswell (no VNNI)"}  # fmt: skip
    lines = [
        "# The cpu target's int8 recipe on hosts with and without VNNI",
        "",
        "Made by `python -m benchmarks.studies.cpu_recipe` on "
        f"**{host.label()}** ({host.int8_kernels}); ONNX Runtime "
        f"{host.versions.get('onnxruntime')}. Agreement = top-1 agreement with the fp32 ONNX "
        "model on the held-out test split (drop in points in brackets); exact = the QDQ graph as "
        "written, no fused int8 kernel. Bar: agreement >= "
        f"{100 * DEFAULT_MIN_AGREEMENT:.0f} %.",
        "",
        "| model | recipe | " + " | ".join(titles[k] for k in kernels) + " |",
        "|---|---|" + "---|" * len(kernels),
    ]
    for name, entry in results["accuracy"].items():
        for label, row in entry["candidates"].items():
            cells = [f"{100 * row[k]['agreement']:.1f} % ({row[k]['drop_pts']:+.1f})"
                     for k in kernels]  # fmt: skip
            lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    labels = list(CANDIDATES)
    lines += [
        "",
        f"## Speed on this host (batch 1, one thread, median of {ROUNDS} x {CALLS} calls, "
        "interleaved)",
        "",
        "| model | fp32 ms | " + " | ".join(f"{label} ms" for label in labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for name, entry in results["speed"].items():
        medians = entry["median_ms"]
        cells = [f"{medians[label]:.3f} ({medians[label] / medians[labels[0]]:.2f}x)"
                 for label in labels]  # fmt: skip
        lines.append(f"| {name} | {medians['fp32']:.3f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Ratios are to the 8-bit recipe of the same model, measured in the same rounds. A host "
        "with VNNI runs every s8-weight recipe through the same VNNI kernel (the weights' range "
        "does not change it); its speed cannot be measured here (QEMU has no AVX-512).",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> None:
    kernels = ["exact", "host"] + (["haswell"] if results["emulated_haswell"] else [])
    models = list(results["accuracy"])
    figure, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 4), sharey=True)
    for axis, name in zip(np.atleast_1d(axes), models, strict=True):
        rows = results["accuracy"][name]["candidates"]
        width = 0.8 / len(kernels)
        for i, kernel in enumerate(kernels):
            values = [100 * rows[label][kernel]["agreement"] for label in CANDIDATES]
            axis.bar(np.arange(len(CANDIDATES)) + i * width, values, width, label=kernel)
        axis.axhline(100 * DEFAULT_MIN_AGREEMENT, color="k", linestyle="--", linewidth=0.8)
        axis.set_xticks(np.arange(len(CANDIDATES)) + width * (len(kernels) - 1) / 2,
                        [label.split(" (")[0] for label in CANDIDATES], rotation=30,
                        ha="right", fontsize=7)  # fmt: skip
        axis.set_title(name, fontsize=9)
        axis.set_ylim(95, 100.2)
    np.atleast_1d(axes)[0].set_ylabel("top-1 agreement with fp32 (%)")
    np.atleast_1d(axes)[0].legend(fontsize=7, loc="lower left")
    figure.suptitle(f"cpu recipe candidates on {results['host']['cpu']} "
                    f"({', '.join(results['host']['int8_features']) or 'no AVX2'})")  # fmt: skip
    save_figure(figure, NAME)


def main() -> None:
    benchmark_main(NAME, __doc__, run, markdown, plot)


if __name__ == "__main__":
    main()
