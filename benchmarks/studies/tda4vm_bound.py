"""What TIDL's power-of-two rule costs: tda4vm's file beside the same recipe with any scale.

    .venv/bin/python -m benchmarks.studies.tda4vm_bound                # ~6 min on 2 cores
    # +1.5 min a model
    EDGE_UN_BENCH_TEACHERS=DIR .venv/bin/python -m benchmarks.studies.tda4vm_bound
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.studies.tda4vm_bound --report-only

Each model is converted for tda4vm by the pipeline itself (``quant.convert``) twice: with the
target's profile as it ships (s8 symmetric, power-of-two scales chosen per tensor, residual
streams on the power-of-two grid, its int8 ladder) and with the power-of-two rule off
(``power_of_two_scales=False, stream_factors=False``: ORT's symmetric s8 MinMax scales, any
real number, the same ladder), the symmetric-s8 file TIDL would take if its scales were free.
The models: four bundled UN examples (two ViTs, two text models) and, with
``EDGE_UN_BENCH_TEACHERS`` set to the directory ``benchmarks.training.hf_migrate`` kept, its
int8-ready models (``MODEL-un8-SEED``). Figures: the report's (pure int8 agreement and top-1 drop in
exact arithmetic on the held-out test split), the logits' mean squared error against the fp32 file
on that split, and the test samples whose top-1 differs from fp32's ("flips"), with how many of them
fp32 itself ranks within ``NEAR_TIE`` logits of its runner-up: how much of a file's disagreement
is samples that any small error tips over.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from benchmarks.common.results import benchmark_main, git_commit, save_figure
from benchmarks.studies.tda4vm_streams import held_out_logits
from benchmarks.training.hf_migrate import MARGIN
from edge_un import examples
from quant.host import describe_host
from quant.measure.bars import DEFAULT_MIN_AGREEMENT
from quant.pipeline import convert
from quant.report import Host
from quant.targets import PROFILES

NAME = "tda4vm_bound"
BUNDLED = ("vit-mnist-un", "hf-vit-mnist-un", "text-rt-un", "hf-bert-rt-un")
PROFILE = PROFILES["tda4vm"]
VARIANTS = {
    "power of two": PROFILE,
    "any scale": replace(PROFILE, power_of_two_scales=False, stream_factors=False),
}
NEAR_TIE = 1.0  # logits: fp32's top-2 margin under which a sample counts as a near tie


def models() -> dict[str, Path]:
    """label -> checkpoint directory: the bundled examples, then hf_migrate's kept ones."""
    found = {name: examples.path(name) for name in BUNDLED}
    kept = os.environ.get("EDGE_UN_BENCH_TEACHERS")
    if kept:
        for path in sorted(Path(kept).glob("*-un8-*")):
            model, _, seed = path.name.partition("-un8-")
            found[f"hf_migrate {model} seed {seed}"] = path
    return found


def flips(model: Path, out_dir: Path) -> dict[str, Any]:
    """The tda4vm file's logits vs its fp32 file's on the held-out test split: their error, the
    samples they rank differently and the near ties among those."""
    reference, logits = held_out_logits(model, out_dir)
    top2 = np.sort(reference, axis=1)[:, -2:]
    near_tie = top2[:, 1] - top2[:, 0] < NEAR_TIE
    flipped = logits.argmax(axis=1) != reference.argmax(axis=1)
    return {
        "test_samples": len(reference),
        "test_logits_mse": float(np.mean(np.square(logits - reference, dtype=np.float64))),
        "flips": int(flipped.sum()),
        "flips_near_tie": int((flipped & near_tie).sum()),
        "near_ties": int(near_tie.sum()),
    }


def measure(label: str, model: Path, scratch: Path) -> list[dict[str, Any]]:
    rows = []
    for variant, profile in VARIANTS.items():
        out_dir = scratch / f"{model.name}-{variant.replace(' ', '-')}"
        report = convert(model, [profile], out_dir=out_dir, latency_runs=3)
        target = report.targets["tda4vm"]
        pure = target.pure_int8_drift or target.drift
        rows.append(
            {
                "model": label,
                "scales": variant,
                "status": target.status,
                "agreement": pure.agreement,
                "top1_fp32": pure.top1_fp32,
                "top1_drop_pts": pure.top1_drop_pts,
                "within_bar": pure.within_bar,
                "recipe_rung": len(target.recipes_tried),
                **flips(model, out_dir),
            }
        )
        print(f"{label} {variant}: {rows[-1]}", flush=True)
    return rows


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        rows = [row for label, path in models().items() for row in measure(label, path,
                Path(scratch))]  # fmt: skip
    return {"commit": git_commit(), "host": describe_host().model_dump(), "rows": rows}


def markdown(results: dict[str, Any]) -> str:
    host = Host.model_validate(results["host"])
    lines = [
        "# tda4vm: power-of-two scales vs the same recipe with any scale",
        "",
        f"Made by `python -m benchmarks.studies.tda4vm_bound` at {results['commit']} on "
        f"{host.label()}. "
        "Each model converted for tda4vm by the pipeline twice: as the target ships (s8 "
        "symmetric, power-of-two scales) and with the power-of-two rule off (symmetric s8 "
        "MinMax scales, any real number), the same int8 ladder. Agreement and drop: the pure "
        "int8 file in exact arithmetic on the held-out test split (the report's figures); `rung`:"
        " the int8 recipe shipped (1: biases corrected, 2: as calibrated); test logits' MSE: "
        "int8 vs fp32 on the test split; flips: test samples whose top-1 differs from fp32's, "
        f"of them near ties: fp32's own top-2 margin under {NEAR_TIE:g} logit (samples with "
        "such a margin in the whole split in brackets).",
        "",
        "| model (its fp32 test top-1) | scales | agreement | drop | rung | test logits' MSE "
        "| flips (near ties) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['model']} ({_percent(row['top1_fp32'])}) | {row['scales']} "
            f"| {100 * row['agreement']:.1f} % "
            f"| {row['top1_drop_pts']:.1f} pt | {row['recipe_rung']} "
            f"| {row['test_logits_mse']:.4f} | {row['flips']} of {row['test_samples']} "
            f"({row['flips_near_tie']} of {row['near_ties']}) |"
        )
    return "\n".join(lines) + "\n"


def _percent(accuracy: float | None) -> str:
    return "-" if accuracy is None else f"{100 * accuracy:.1f} %"


def plot(results: dict[str, Any]) -> None:
    rows = results["rows"]
    labels = list(dict.fromkeys(row["model"] for row in rows))
    figure, axis = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 3.8))
    positions = np.arange(len(labels))
    for offset, variant in zip((-0.2, 0.2), VARIANTS, strict=True):
        picked = [next(r for r in rows if r["model"] == m and r["scales"] == variant)
                  for m in labels]  # fmt: skip
        axis.bar(positions + offset, [100 * r["agreement"] for r in picked], 0.4, label=variant)
    axis.set_xticks(positions, labels, fontsize=7, rotation=20)
    axis.set_ylabel("top-1 agreement with fp32 (%)")
    axis.set_ylim(98.5, 100)
    axis.axhline(100 * DEFAULT_MIN_AGREEMENT, color="black", linewidth=0.8, linestyle="--",
                 label="bar")  # fmt: skip
    axis.axhline(100 * MARGIN, color="grey", linewidth=0.8, linestyle=":", label="margin")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.suptitle("tda4vm pure int8 (exact arithmetic, test split): what power-of-two costs")
    save_figure(figure, NAME)


def main() -> None:
    benchmark_main(NAME, __doc__, run, markdown, plot)


if __name__ == "__main__":
    main()
