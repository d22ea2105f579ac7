"""Every int8 recipe tried on the bundled examples, with its numbers (ONNX Runtime QDQ).

    python -m benchmarks.conversion.quant_recipes      # ~5 min on 2 cores

Each recipe quantizes the folded fp32 model (calibrated on the checkpoint's training split) and
measures it on the held-out test split against the fp32 model: top-1 agreement, top-1 drop,
logits cosine. Results: ``benchmarks/results/quant_recipes.json`` and ``.md``. The TFLite
recipes (full int8, 16x8) are measured by the pipeline itself: see ``quant_compare.py``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import onnx
from onnxruntime.quantization import (
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quant_pre_process,
    quantize_static,
)

from benchmarks.common.results import RESULTS
from converters.fold_and_export import export_folded, load_and_fold
from edge_un import examples
from quant.host import describe_host
from quant.measure.drift import measure_drift, onnx_runner, tensor_sqnr
from quant.ort.pow2.grid import align_streams
from quant.ort.pow2.record import recorded_choices
from quant.ort.quantize import SamplesReader, quantize_onnx
from quant.report import power_of_two_counts
from quant.samples import checkpoint_samples
from quant.targets import PROFILES

MODELS = ("vit-mnist-un", "vit-mnist-ln", "text-rt-un", "text-rt-ln")


def ort_recipe(fp32: Path, out: Path, calibration, activation: QuantType, symmetric: bool,
               method: CalibrationMethod) -> Path:  # fmt: skip
    """A plain quantize_static call with one knob changed (the pipeline's path is MinMax)."""
    prepared = out.with_suffix(".pre.onnx")
    quant_pre_process(str(fp32), str(prepared))
    name = onnx.load(str(fp32)).graph.input[0].name
    quantize_static(
        str(prepared), str(out), SamplesReader([name], calibration, 32),
        quant_format=QuantFormat.QDQ, per_channel=True, activation_type=activation,
        weight_type=QuantType.QInt8, calibrate_method=method,
        extra_options={"ActivationSymmetric": symmetric},
    )  # fmt: skip
    return out


def run_model(name: str, scratch: Path) -> list[dict]:
    folded = load_and_fold(examples.path(name), allow_online=name.endswith("-ln"))
    fp32 = scratch / f"{name}.onnx"
    export_folded(folded, fp32, opset=21)
    evaluation = checkpoint_samples(folded.info, "test")
    reference = onnx_runner(fp32)(evaluation.inputs)
    rows = []

    def record(recipe: str, path: Path, calibration_samples: int, seconds: float) -> None:
        drift = measure_drift(reference, onnx_runner(path)(evaluation.inputs), evaluation.labels)
        rows.append({"model": name, "recipe": recipe, "calibration_samples": calibration_samples,
                     "agreement": drift.agreement, "top1_drop_pts": drift.top1_drop_pts,
                     "cosine": drift.cosine, "quantize_s": round(seconds, 2)})  # fmt: skip
        print(f"{name:14s} {recipe:55s} agreement {drift.agreement:.3f} drop "
              f"{drift.top1_drop_pts:5.2f} cosine {drift.cosine:.4f}", flush=True)  # fmt: skip

    cpu = PROFILES["cpu"]
    s8 = replace(cpu, activation_type="int8", symmetric_activations=True)
    for count in (64, 256, 1024):
        calibration = checkpoint_samples(folded.info, "train", count)
        for label, profile in (("MinMax, u8 asymmetric activations", cpu),
                               ("MinMax, s8 symmetric activations", s8)):  # fmt: skip
            start = time.perf_counter()
            out = quantize_onnx(fp32, scratch / "q.onnx", profile, calibration)
            record(label, out, count, time.perf_counter() - start)
    calibration = checkpoint_samples(folded.info, "train", 256)
    for method in (CalibrationMethod.Percentile, CalibrationMethod.Entropy):
        start = time.perf_counter()
        try:
            out = ort_recipe(fp32, scratch / "m.onnx", calibration, QuantType.QInt8, True, method)
        except Exception as error:  # entropy fails on some models: that is a finding too
            rows.append({"model": name, "recipe": f"{method.name}, s8", "error": str(error)[:200]})
            print(f"{name:14s} {method.name}: failed: {str(error)[:120]}")
            continue
        record(f"{method.name}, s8 symmetric activations", out, 256, time.perf_counter() - start)
    start = time.perf_counter()
    out = ort_recipe(fp32, scratch / "a16.onnx", calibration, QuantType.QInt16, True,
                     CalibrationMethod.MinMax)  # fmt: skip
    record("every activation int16 (A16W8)", out, 256, time.perf_counter() - start)
    pure = quantize_onnx(fp32, scratch / "pure.onnx", s8, calibration)
    errors = tensor_sqnr(fp32, pure, evaluation)
    for key, label in (("own_sqnr_db", "own rounding SQNR"), ("sqnr_db", "accumulated SQNR")):
        ranked = [e.name for e in sorted(errors, key=lambda e: getattr(e, key))]
        for count in (4, 8, 16, 32, 64):
            start = time.perf_counter()
            out = quantize_onnx(fp32, scratch / "w.onnx", s8, calibration, tuple(ranked[:count]))
            record(f"worst {count} by {label} to int16, rest s8", out, 256,
                   time.perf_counter() - start)  # fmt: skip
    if name == "vit-mnist-un":
        rows += sensitivity_scan(
            name, fp32, s8, calibration, evaluation, reference, errors, scratch
        )
    # tda4vm: static batch 1, TIDL's power-of-two rule
    b1 = scratch / f"{name}_b1.onnx"
    export_folded(folded, b1, opset=17, dynamic_batch=False)
    reference_b1 = onnx_runner(b1)(evaluation.inputs)
    tda = PROFILES["tda4vm"]
    uncorrected = replace(tda, bias_correction=False)
    two = 2  # the search before: the ceiling of each MinMax scale or the power of two below it
    count = tda.power_of_two_candidates
    streams = scratch / f"{name}_b1_streams.onnx"
    variants = (
        (f"tda4vm: s8 symmetric, power-of-two scales (MSE-chosen of {two}), opset 17", b1,
         replace(uncorrected, power_of_two_candidates=two)),
        (f"tda4vm: the same, MSE-chosen of {count}", b1, uncorrected),
        ("tda4vm: the same, residual streams on the power-of-two grid", streams, uncorrected),
        ("tda4vm: the same, biases corrected (as shipped)", streams, tda),
        (f"tda4vm: as shipped but MSE-chosen of {two} (before)", streams,
         replace(tda, power_of_two_candidates=two)),
    )  # fmt: skip
    for label, source, recipe in variants:
        start = time.perf_counter()
        if source != b1:
            grid = align_streams(
                b1, source, lambda f, o, r=recipe: quantize_onnx(f, o, r, calibration), calibration
            )
            source = source if grid.scaled else b1
        out = quantize_onnx(source, scratch / "tda.onnx", recipe, calibration)
        logits = onnx_runner(out, exact=True)(evaluation.inputs)  # TIDL's arithmetic
        drift = measure_drift(reference_b1, logits, evaluation.labels)
        rows.append(
            {
                "model": name,
                "recipe": label,
                "calibration_samples": 256,
                "agreement": drift.agreement,
                "top1_drop_pts": drift.top1_drop_pts,
                "cosine": drift.cosine,
                "quantize_s": round(time.perf_counter() - start, 2),
                "power_of_two": power_of_two_counts(recorded_choices(out)),
            }
        )
    return rows


def sensitivity_scan(name, fp32, profile, calibration, evaluation, reference, errors, scratch):
    """One activation at a time in int16, the rest s8: how much can any single tensor buy?"""
    rows = []
    for error in errors:
        out = quantize_onnx(fp32, scratch / "one.onnx", profile, calibration, (error.name,))
        drift = measure_drift(reference, onnx_runner(out)(evaluation.inputs), evaluation.labels)
        rows.append({"model": name, "recipe": f"sensitivity: only {error.name} ({error.op}) int16",
                     "calibration_samples": len(calibration), "agreement": drift.agreement,
                     "top1_drop_pts": drift.top1_drop_pts, "cosine": drift.cosine,
                     "quantize_s": None})  # fmt: skip
    best = max(rows, key=lambda row: row["agreement"])
    print(f"{name}: sensitivity scan of {len(rows)} tensors, best single: {best['recipe']} "
          f"{best['agreement']:.3f}", flush=True)  # fmt: skip
    return rows


def write_markdown(rows: list[dict], host: str) -> str:
    scan = sorted((r for r in rows if r["recipe"].startswith("sensitivity")),
                  key=lambda r: -r["agreement"])  # fmt: skip
    lines = [
        "# int8 recipes on the bundled examples (ONNX Runtime QDQ, per-channel s8 weights)",
        "",
        f"Made by `python -m benchmarks.conversion.quant_recipes` on {host}. Agreement = top-1 "
        "agreement",
        "with the fp32 folded model on the held-out test split (ViT: 1000 samples, text: 2562);",
        "drop in points.",
        f"The sensitivity scan put each of the {len(scan)} activations of vit-mnist-un alone in",
        "int16 (the rest s8); its 10 best rows are listed last (all of them in the JSON).",
        "The tda4vm rows are measured in the file's exact arithmetic (`onnx_runner(exact=True)`,",
        "what TIDL computes), the others on this host's ONNX Runtime int8 kernels (on x86",
        "without VNNI its u8s8 kernels saturate: `shared/docs/targets-and-toolchain.md`).",
        "",
        "Power-of-two scales (tda4vm rows): rounded up / down (of those, two powers of two or",
        "more down), activations; weight channels.",
        "",
        "| model | recipe | calib. samples | agreement | drop (pt) | cosine | pow-2 scales |",
        "|---|---|---|---|---|---|---|",
    ]
    listed = [r for r in rows if not r["recipe"].startswith("sensitivity")] + scan[:10]
    for row in listed:
        if "error" in row:
            lines.append(
                f"| {row['model']} | {row['recipe']} | 256 | failed: {row['error']} | | | |"
            )
            continue
        counts = row.get("power_of_two") or {}
        scales = "; ".join("{} / {} ({})".format(*counts[kind]) for kind in counts)
        lines.append(
            f"| {row['model']} | {row['recipe']} | {row['calibration_samples']} | "
            f"{100 * row['agreement']:.1f} % | {row['top1_drop_pts']:.1f} | {row['cosine']:.4f} | "
            f"{scales} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in MODELS:
            rows += run_model(name, Path(scratch))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quant_recipes.json").write_text(json.dumps(rows, indent=2) + "\n")
    (RESULTS / "quant_recipes.md").write_text(write_markdown(rows, describe_host().label()))
    print(f"wrote {RESULTS / 'quant_recipes.md'}")


if __name__ == "__main__":
    main()
