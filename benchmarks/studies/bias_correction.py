"""What bias correction (the int8 ladder's second rung) does to the bundled Hugging Face models.

    .venv/bin/python -m benchmarks.studies.bias_correction                # ~5 min on 2 cores
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.studies.bias_correction --report-only

For the QDQ ONNX targets that correct biases (cpu: its ladder's second recipe; tda4vm: always),
each bundled HF model's folded fp32 ONNX (its attention masks bounded, as the pipeline's) is
quantized twice with ``quant.ort.quantize.quantize_onnx`` on its training split's calibration
samples: the target's recipe without and with its int32 biases corrected
(``quant.ort.bias_correction``), each timed (the difference is the correction's cost: one walk
through the graph, ``quant.measure.graph_walk``). Both files are measured on the
held-out test split in the target's exact arithmetic (``onnx_runner(exact=True)``) against the
fp32 file: the logits' RMS error, the largest per-class mean error (what the correction
removes), top-1 agreement and drop. The fp32 logits' top-1 margin says how close to a flip the
test samples sit: the 1 % quantile of (top logit - second logit).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import onnx

from benchmarks.common.results import benchmark_main, save_figure
from converters.attention_masks import bound_attention_masks
from converters.fold_and_export import export_folded, load_and_fold
from edge_un import examples
from quant.measure.drift import measure_drift, onnx_runner
from quant.ort.quantize import quantize_onnx
from quant.prepare import input_specs
from quant.samples import CALIBRATION_SAMPLES, checkpoint_samples
from quant.targets import PROFILES

NAME = "bias_correction"
MODELS = ("hf-vit-mnist-un", "hf-bert-rt-un")
TARGETS = ("cpu", "tda4vm")


def top1_margin_quantile(logits: np.ndarray, quantile: float = 0.01) -> float:
    """The ``quantile`` of each sample's top logit minus its second one."""
    ordered = np.sort(logits, axis=-1)
    return float(np.quantile(ordered[:, -1] - ordered[:, -2], quantile))


def measure_model(name: str, scratch: Path) -> list[dict[str, Any]]:
    folded = load_and_fold(examples.path(name))
    specs = input_specs(folded)
    calibration = checkpoint_samples(folded.info, "train", CALIBRATION_SAMPLES, specs)
    evaluation = checkpoint_samples(folded.info, "test", specs=specs)
    rows = []
    for target in TARGETS:
        profile = PROFILES[target]
        fp32 = scratch / f"{name}_{target}_fp32.onnx"
        export_folded(folded, fp32, opset=profile.opset, dynamic_batch=not profile.static_batch)
        proto = onnx.load(str(fp32))
        bound_attention_masks(proto)  # as the pipeline quantizes it: float32-min masks bounded
        onnx.save_model(proto, str(fp32))
        reference = onnx_runner(fp32)(evaluation.feeds)
        for corrects in (False, True):
            recipe = replace(profile, bias_correction=corrects, int8_ladder=())
            int8 = scratch / f"{name}_{target}_{int(recipe.bias_correction)}.onnx"
            started = time.perf_counter()
            quantize_onnx(fp32, int8, recipe, calibration)
            quantize_s = time.perf_counter() - started
            logits = onnx_runner(int8, exact=True)(evaluation.feeds)
            drift = measure_drift(reference, logits, evaluation.labels)
            error = logits.astype(np.float64) - reference
            rows.append(
                {
                    "model": name,
                    "target": target,
                    "biases_corrected": recipe.bias_correction,
                    "recipe": recipe.recipe,
                    "rms_error": float(np.sqrt(np.mean(error**2))),
                    "max_mean_error": float(np.abs(error.mean(axis=0)).max()),
                    "agreement": drift.agreement,
                    "top1_drop_pts": drift.top1_drop_pts,
                    "fp32_margin_q01": top1_margin_quantile(reference),
                    "calibration_samples": len(calibration),
                    "quantize_s": round(quantize_s, 1),
                    "test_samples": len(evaluation),
                }
            )
            print(f"{name} {target} corrected={recipe.bias_correction}: {rows[-1]}", flush=True)
    return rows


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        rows = [row for name in MODELS for row in measure_model(name, Path(scratch))]
    return {"rows": rows}


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Bias correction on the bundled HF models (held-out test split, exact arithmetic)",
        "",
        "Logits of each pure int8 file against the fp32 file; `biases corrected` is cpu's "
        "second int8 recipe and every tda4vm file. `quantize` is the wall time of the whole "
        "quantization, on 2 cores; the difference is the correction's (one walk through the "
        "graph). Produced by `python -m benchmarks.studies.bias_correction`.",
        "",
        "| model | target | biases corrected | logit RMS error | largest class mean error "
        "| agreement | top-1 drop | fp32 margin, 1 % quantile | quantize |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['model']} | {row['target']} | {'yes' if row['biases_corrected'] else 'no'} "
            f"| {row['rms_error']:.3f} | {row['max_mean_error']:.3f} "
            f"| {100 * row['agreement']:.1f} % | {row['top1_drop_pts']:.1f} pt "
            f"| {row['fp32_margin_q01']:.2f} | {row.get('quantize_s', '-')} s |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> None:
    rows = results["rows"]
    pairs = sorted({(row["model"], row["target"]) for row in rows})
    figure, axis = plt.subplots(figsize=(7, 3.5))
    positions = np.arange(len(pairs))
    for offset, corrected in ((-0.2, False), (0.2, True)):
        values = [
            next(
                r["rms_error"]
                for r in rows
                if (r["model"], r["target"]) == pair and r["biases_corrected"] == corrected
            )
            for pair in pairs
        ]
        label = "biases corrected" if corrected else "not corrected"
        axis.bar(positions + offset, values, width=0.4, label=label)
    axis.set_xticks(positions, [f"{model}\n{target}" for model, target in pairs], fontsize=8)
    axis.set_ylabel("logit RMS error vs fp32")
    axis.set_title("int8 logits' error on the test split, before and after bias correction")
    axis.legend()
    save_figure(figure, NAME)


def main() -> None:
    benchmark_main(NAME, __doc__, run, markdown, plot)


if __name__ == "__main__":
    main()
