"""tda4vm with and without its residual streams moved onto the power-of-two grid.

    .venv/bin/python -m benchmarks.studies.tda4vm_streams                # ~10 min on 2 cores
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.studies.tda4vm_streams --report-only

Each bundled UN example is converted for tda4vm twice by the pipeline itself
(``quant.convert``): with the target's profile as it ships (``stream_factors``: each residual
stream scaled by the factor in [1, 2) whose power-of-two scales give the smallest int8 logits
error on 256 calibration samples, ``quant.ort.pow2.grid``) and with that step off, the rest of the
recipe (s8 symmetric activations, power-of-two scales, its int8 ladder) the same. The
figures are the report's (pure int8 agreement and top-1 drop in exact arithmetic on the held-out
test split) and the logits' mean squared error against the fp32 file on that split, the quantity
the search lowers (on calibration samples, not these). Wall: the whole tda4vm conversion,
measured side by side in one run.
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

from benchmarks.common.paired_flips import held_out_reference
from benchmarks.common.results import benchmark_main, save_figure
from edge_un import examples
from quant.host import describe_host
from quant.measure.drift import onnx_runner
from quant.ort.pow2.grid import SEARCH_SAMPLES
from quant.pipeline import convert
from quant.report import Host
from quant.targets import PROFILES

NAME = "tda4vm_streams"
MODELS = (
    "vit-mnist-un", "vit-mnist-ln-to-un", "text-rt-un", "text-rt-ln-to-un", "hf-vit-mnist-un",
    "hf-bert-rt-un",
)  # fmt: skip
PROFILE = PROFILES["tda4vm"]
VARIANTS = {"without": replace(PROFILE, stream_factors=False), "with": PROFILE}


def held_out_logits(model: Path, out_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The logits of the fp32 file and of the tda4vm file (exact arithmetic) that ``convert``
    wrote for ``model`` under ``out_dir``, on the model's held-out test split."""
    feeds, reference = held_out_reference(model, out_dir)
    logits = onnx_runner(out_dir / "tda4vm" / "model_int8.onnx", exact=True)(feeds)
    return reference, logits


def held_out_logits_mse(name: str, out_dir: Path) -> float:
    """The tda4vm file's logits vs its fp32 file's on the held-out test split."""
    reference, logits = held_out_logits(examples.path(name), out_dir)
    return float(np.mean(np.square(logits - reference, dtype=np.float64)))


def measure(name: str, scratch: Path) -> list[dict[str, Any]]:
    rows = []
    for variant, profile in VARIANTS.items():
        out_dir = scratch / f"{name}-{variant}"
        started = time.perf_counter()
        report = convert(examples.path(name), [profile], out_dir=out_dir, latency_runs=10)
        seconds = time.perf_counter() - started
        target = report.targets["tda4vm"]
        pure = target.pure_int8_drift or target.drift
        rows.append(
            {
                "model": name,
                "streams": variant,
                "status": target.status,
                "agreement": pure.agreement,
                "top1_drop_pts": pure.top1_drop_pts,
                "within_bar": pure.within_bar,
                "recipe_rung": len(target.recipes_tried),
                "test_logits_mse": held_out_logits_mse(name, out_dir),
                "stream_factors": [found.model_dump() for found in target.stream_factors],
                "warnings": target.warnings,
                "convert_s": round(seconds, 1),
            }
        )
        print(f"{name} {variant}: {rows[-1]}", flush=True)
    return rows


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        rows = [row for name in MODELS for row in measure(name, Path(scratch))]
    return {"host": describe_host().model_dump(), "rows": rows}


def _factors(row: dict[str, Any]) -> str:
    found = row["stream_factors"]
    if not found:
        return "-"
    return ", ".join(
        f"{f['stream']} ({f['tensors']} tensors) x{f['factor']:.3f}: "
        f"{f['logits_mse_at_one']:.4f} -> {f['logits_mse']:.4f}"
        for f in found
    )


def markdown(results: dict[str, Any]) -> str:
    host = Host.model_validate(results["host"])
    lines = [
        "# tda4vm: residual streams on the power-of-two grid (bundled UN examples)",
        "",
        f"Made by `python -m benchmarks.studies.tda4vm_streams` on {host.label()}. Each model "
        "converted "
        "for tda4vm by the pipeline twice, with and without the residual-stream factors "
        "(`quant.ort.pow2.grid`), everything else the same. Agreement and drop: the pure int8 file "
        "in exact arithmetic on the held-out test split (the report's figures); `rung`: the int8 "
        "recipe shipped (1: biases corrected, 2: as calibrated); test logits' MSE: mean squared "
        "difference of the int8 and fp32 logits on the test split. The search's own figures "
        f"(logits' MSE on {SEARCH_SAMPLES} calibration samples at factor 1 and at the chosen one) "
        "are in the last column. Wall: the whole tda4vm conversion.",
        "",
        "| model | streams | agreement | drop | rung | test logits' MSE | within bar "
        "| factor: search MSE at 1 -> chosen | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['model']} | {row['streams']} | {100 * row['agreement']:.1f} % "
            f"| {row['top1_drop_pts']:.1f} pt | {row['recipe_rung']} "
            f"| {row['test_logits_mse']:.4f} | {'yes' if row['within_bar'] else 'no'} "
            f"| {_factors(row)} | {row['convert_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> None:
    rows = results["rows"]
    models = list(dict.fromkeys(row["model"] for row in rows))
    figure, (error_axis, agreement_axis) = plt.subplots(1, 2, figsize=(11, 3.8))
    positions = np.arange(len(models))
    for offset, variant in ((-0.2, "without"), (0.2, "with")):
        picked = [next(r for r in rows if r["model"] == m and r["streams"] == variant)
                  for m in models]  # fmt: skip
        label = f"{variant} stream factors"
        error_axis.bar(positions + offset, [r["test_logits_mse"] for r in picked], 0.4,
                       label=label)  # fmt: skip
        agreement_axis.bar(positions + offset, [100 * r["agreement"] for r in picked], 0.4,
                           label=label)  # fmt: skip
    for axis in (error_axis, agreement_axis):
        axis.set_xticks(positions, models, fontsize=7, rotation=20)
    error_axis.set_ylabel("int8 vs fp32 logits' MSE, test split")
    agreement_axis.set_ylabel("top-1 agreement with fp32 (%)")
    agreement_axis.set_ylim(98.5, 100)
    agreement_axis.axhline(99.0, color="black", linewidth=0.8, linestyle="--")
    error_axis.legend(fontsize=8)
    figure.suptitle("tda4vm pure int8: residual streams moved onto the power-of-two grid")
    save_figure(figure, NAME)


def main() -> None:
    benchmark_main(NAME, __doc__, run, markdown, plot)


if __name__ == "__main__":
    main()
