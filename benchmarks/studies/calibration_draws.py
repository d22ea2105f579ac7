"""Calibration draws: how far a pure int8 file's agreement moves with its calibration samples.

    .venv/bin/python -m benchmarks.studies.calibration_draws                # ~12 min on 2 cores
    # table and plot from JSON
    .venv/bin/python -m benchmarks.studies.calibration_draws --report-only

Issue 34 asks for a margin above the bar (agreement >= 99.3 %). This measures the spread that
margin sits in. Each bundled example below is converted by the pipeline (``quant.convert``)
``DRAWS`` times for cpu, imx93 and tda4vm, each time calibrated on a different random
``CALIBRATION_SAMPLES`` of its training split, handed over as a user's calibration ``.npz``
(``--calib``). Draw 0 is the pipeline's own draw (``quant.samples.CALIBRATION_SEED``). Nothing else
changes between draws: the model, the recipes, the held-out test split the figures come from.

Figures are the report's pure int8 file in its arithmetic (exact for the ONNX targets, LiteRT
for imx93): agreement with fp32 top-1, the disagreements behind it (test samples, the unit it
moves in) and the logits' cosine. The models are a 2-class sentiment BERT and a 2-class
sentiment Transformer (many test sentences near the decision threshold) and a 10-class MNIST
ViT.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from benchmarks.common.results import RESULTS, benchmark_main, git_commit, save_figure
from benchmarks.training.hf_migrate import MARGIN
from converters.fold_and_export import FoldedSource, load_and_fold
from edge_un import examples
from quant.host import describe_host
from quant.pipeline import convert
from quant.prepare import input_specs
from quant.report import Host
from quant.samples import CALIBRATION_SAMPLES, CALIBRATION_SEED, checkpoint_samples

NAME = "calibration_draws"
MODELS = ("hf-bert-rt-un", "text-rt-un", "hf-vit-mnist-un")
TARGETS = ("cpu", "imx93", "tda4vm")
DRAWS = 10  # seeds CALIBRATION_SEED, CALIBRATION_SEED + 1, ...


def write_draw(folded: FoldedSource, seed: int, path: Path) -> None:
    """The calibration samples of draw ``seed`` as the ``.npz`` a user would pass."""
    specs = input_specs(folded)
    drawn = checkpoint_samples(folded.info, "train", CALIBRATION_SAMPLES, specs, seed=seed)
    np.savez(path, **drawn.feeds)


def measure(name: str, folded: FoldedSource, seed: int, scratch: Path) -> dict[str, Any]:
    calibration = scratch / f"{name}-{seed}.npz"
    write_draw(folded, seed, calibration)
    started = time.perf_counter()
    report = convert(
        examples.path(name), list(TARGETS), calib=calibration, out_dir=scratch / f"{name}-{seed}",
        latency_runs=3, parallel=2,
    )  # fmt: skip
    seconds = round(time.perf_counter() - started, 1)
    row: dict[str, Any] = {"model": name, "seed": seed, "convert_s": seconds, "targets": {}}
    for target_name in TARGETS:
        target = report.targets[target_name]
        pure = target.pure_int8_drift or target.drift
        row["targets"][target_name] = {
            "status": target.status,
            "agreement": pure.agreement,
            "disagreements": round(pure.samples * (1 - pure.agreement)),
            "samples": pure.samples,
            "top1_drop_pts": pure.top1_drop_pts,
            "cosine": pure.cosine,
            "recipe_rung": len(target.recipes_tried) or 1,
            "stream_factors": [round(found.factor, 3) for found in target.stream_factors],
        }
    print(f"{name} draw {seed}: " + ", ".join(
        f"{t} {100 * v['agreement']:.2f} %" for t, v in row["targets"].items()
    ), flush=True)  # fmt: skip
    return row


def run() -> dict[str, Any]:
    committed = RESULTS / f"{NAME}.json"  # the run before this one, kept beside it
    previous = json.loads(committed.read_text()) if committed.exists() else None
    seeds = range(CALIBRATION_SEED, CALIBRATION_SEED + DRAWS)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in MODELS:
            folded = load_and_fold(examples.path(name))  # once: each draw only samples its data
            rows += [measure(name, folded, seed, Path(scratch)) for seed in seeds]
    results = {"host": describe_host().model_dump(), "commit": git_commit(), "rows": rows}
    if previous is not None:
        results["previous"] = {"commit": previous["commit"], "rows": previous["rows"]}
    return results


def spread(results: dict[str, Any], model: str, target: str) -> dict[str, Any]:
    """One model's target over the draws: its agreements, the pipeline's own draw's, and how
    many draws reach the margin."""
    rows = [row for row in results["rows"] if row["model"] == model]
    figures = [row["targets"][target] for row in rows]
    agreements = [figure["agreement"] for figure in figures]
    (own,) = (row["targets"][target] for row in rows if row["seed"] == CALIBRATION_SEED)
    return {
        "agreements": agreements,
        "own_draw": own["agreement"],
        "median": statistics.median(agreements),
        "disagreements": [figure["disagreements"] for figure in figures],
        "samples": figures[0]["samples"],
        "at_margin": sum(agreement >= MARGIN for agreement in agreements),
        "within_bar": sum(figure["status"] == "ok" for figure in figures),
        "cosines": [figure["cosine"] for figure in figures],
        "own_cosine": own["cosine"],
    }


def _before(previous: dict[str, Any] | None, model: str, target: str) -> str:
    """The previous run's own draw, median and draws at the margin, or a dash."""
    if previous is None or not any(row["model"] == model for row in previous["rows"]):
        return "-"
    found = spread(previous, model, target)
    cosine = statistics.median(found["cosines"])
    return (f"own {100 * found['own_draw']:.2f} %, median {100 * found['median']:.2f} %, "
            f"{found['at_margin']} / {len(found['agreements'])} at the margin; cosine own "
            f"{found['own_cosine']:.5f}, median {cosine:.5f}")  # fmt: skip


def markdown(results: dict[str, Any]) -> str:
    host = Host.model_validate(results["host"])
    draws = len({row["seed"] for row in results["rows"]})
    previous = results.get("previous")
    before_header = f"before ({previous['commit']})" if previous else "before"
    lines = [
        "# Calibration draws: the spread of a pure int8 file's agreement",
        "",
        f"Made by `python -m benchmarks.studies.calibration_draws` at {results['commit']} on "
        f"{host.label()}. Each bundled example converted by the pipeline {draws} times for "
        f"{', '.join(TARGETS)}, each time calibrated on a different random "
        f"{CALIBRATION_SAMPLES} samples of its training split (`--calib`; draw "
        f"{CALIBRATION_SEED} is the pipeline's own). Figures: the report's pure int8 file on "
        "the held-out test split, in its arithmetic (exact for the ONNX files, LiteRT for "
        "imx93). Disagreements: test samples whose int8 top-1 differs from fp32, the unit the "
        f"agreement moves in. `>= {100 * MARGIN:.1f} %`: draws reaching issue 34's margin; "
        "`ok`: draws within the bars. Before: the previous committed run of this benchmark.",
        "",
        "| model | target | own draw | median | min - max | disagreements (min - max, of N) "
        f"| >= {100 * MARGIN:.1f} % | ok | logits' cosine: own draw, median (min - max) "
        f"| {before_header} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(row["model"] for row in results["rows"]):
        for target in TARGETS:
            found = spread(results, model, target)
            low, high = min(found["agreements"]), max(found["agreements"])
            lines.append(
                f"| {model} | {target} | {100 * found['own_draw']:.2f} % "
                f"| {100 * found['median']:.2f} % | {100 * low:.2f} - {100 * high:.2f} % "
                f"| {min(found['disagreements'])} - {max(found['disagreements'])} of "
                f"{found['samples']} | {found['at_margin']} / {draws} "
                f"| {found['within_bar']} / {draws} "
                f"| {found['own_cosine']:.5f}, {statistics.median(found['cosines']):.5f} "
                f"({min(found['cosines']):.5f} - {max(found['cosines']):.5f}) "
                f"| {_before(previous, model, target)} |"
            )
    lines += ["", "Each draw (agreement %; tda4vm's residual-stream factors in brackets):", "",
              "| model | draw | " + " | ".join(TARGETS) + " | wall (s) |",
              "|---|---|" + "---|" * len(TARGETS) + "---|"]  # fmt: skip
    for row in results["rows"]:
        cells = []
        for target in TARGETS:
            figure = row["targets"][target]
            factors = ", ".join(f"x{f:.3f}" for f in figure["stream_factors"])
            cells.append(f"{100 * figure['agreement']:.2f}" + (f" [{factors}]" if factors else ""))
        lines.append(f"| {row['model']} | {row['seed']} | {' | '.join(cells)} "
                     f"| {row['convert_s']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> None:
    models = list(dict.fromkeys(row["model"] for row in results["rows"]))
    previous = results.get("previous")
    figure, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.8), sharey=True)
    for axis, model in zip(np.atleast_1d(axes), models, strict=True):
        for position, target in enumerate(TARGETS):
            found = spread(results, model, target)
            jitter = np.linspace(-0.15, 0.15, len(found["agreements"]))
            axis.scatter(position + jitter, [100 * a for a in found["agreements"]], s=14,
                         color=f"C{position}")  # fmt: skip
            axis.scatter([position], [100 * found["own_draw"]], marker="x", color="black",
                         s=40, label="the pipeline's draw" if position == 0 else None)  # fmt: skip
            if previous is not None:
                before = 100 * spread(previous, model, target)["median"]
                label = f"median at {previous['commit']}" if position == 0 else None
                axis.hlines(before, position - 0.25, position + 0.25, color="grey", label=label)
        axis.axhline(99.0, color="black", linewidth=0.8, linestyle="--")
        axis.axhline(100 * MARGIN, color="grey", linewidth=0.8, linestyle=":")
        axis.set_xticks(range(len(TARGETS)), TARGETS)
        axis.set_title(model, fontsize=9)
    first = np.atleast_1d(axes)[0]
    first.set_ylabel("pure int8 top-1 agreement with fp32 (%)")
    first.legend(fontsize=7, loc="lower left")
    figure.suptitle(f"Agreement over calibration draws at {results['commit']} (a dot: a draw; "
                    "dashed: the bar; dotted: the margin)")  # fmt: skip
    save_figure(figure, NAME)


def main() -> None:
    benchmark_main(NAME, __doc__, run, markdown, plot)


if __name__ == "__main__":
    main()
