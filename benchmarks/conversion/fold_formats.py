"""One model, any source format: the same fold and the same int8 drift on every target.

    .venv/bin/python -m benchmarks.conversion.fold_formats                # ~40 min on 2 cores
    .venv/bin/python -m benchmarks.conversion.fold_formats --models hf-bert-rt-un-in-place
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.conversion.fold_formats --report-only

Each bundled model (edge_un's ViT and text model migrated from LayerNorm, the Hugging Face ViT
and BERT) is converted for every target from each form a user may bring it in: the checkpoint
or save_pretrained directory itself, a ``torch.export`` program (.pt2), a dynamo ONNX file and
a legacy ONNX file, all exported here from the same weights. Every conversion gets the same
``calib.npz`` (128 samples of the training split) and ``eval.npz`` (the held-out test split),
so any difference between formats is the converter's. Recorded per model, format and target:
the fold placements (which norm folded into which layers), status, agreement with fp32, top-1
drop, the int8 recipe shipped, and the conversion's wall time.

Two models are a bundled one as other code writes it (:mod:`testbed.authors_un`): the trained
UN ViT with every norm the UN authors' ``UN1d`` (same state, their ``(B, C, N, 1)`` layout),
and the UN BERT with its embeddings adding their rows in place as transformers 4.x did
(``aten.add_.Tensor`` in a program). Their "native" column is the bundled file itself (the
project's own equivalent); the other formats are exported from the rewritten module.
``--models NAME ...`` measures only those and keeps the other rows of the JSON.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

import edge_un
from benchmarks.common.results import RESULTS, benchmark_main, save_figure
from converters.fold_and_export import load_and_fold
from edge_un import examples
from quant.pipeline import convert
from quant.prepare import input_specs
from quant.samples import checkpoint_samples
from quant.targets import TARGET_NAMES
from testbed.authors_un import in_authors_layout, with_in_place_embeddings

NAME = "fold_formats"
# A bundled model rewritten as other code writes it: (the bundled model, the rewrite).
DERIVED = {
    "vit-mnist-un-authors-layout": ("vit-mnist-un", in_authors_layout),
    "hf-bert-rt-un-in-place": ("hf-bert-rt-un", with_in_place_embeddings),
}
MODELS = ("vit-mnist-ln-to-un", "text-rt-ln-to-un", "hf-vit-mnist-un", "hf-bert-rt-un", *DERIVED)
FORMATS = ("native", "pt2", "dynamo", "legacy")
CALIBRATION = 128


def sources(name: str, scratch: Path) -> tuple[dict[str, Path], Path, Path]:
    """The model in every format, and calib.npz / eval.npz named by its inputs."""
    bundled, rewrite = DERIVED.get(name, (name, None))
    native = examples.path(bundled)
    folded = load_and_fold(native)
    names = folded.input_names
    specs = input_specs(folded)
    calibration = checkpoint_samples(folded.info, "train", CALIBRATION, specs)
    evaluation = checkpoint_samples(folded.info, "test", specs=specs)
    np.savez(scratch / "calib.npz", **calibration.feeds)
    np.savez(scratch / "eval.npz", **evaluation.feeds, labels=evaluation.labels)
    model = folded.model.eval() if rewrite is None else rewrite(folded.model)
    example = tuple(torch.from_numpy(calibration.feeds[n][:1]) for n in names)
    paths = {"native": native, "pt2": scratch / "model.pt2"}
    torch.export.save(torch.export.export(model, example), paths["pt2"])
    for export, dynamo in (("dynamo", True), ("legacy", False)):
        paths[export] = scratch / f"{export}.onnx"
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            torch.onnx.export(model, example, paths[export], input_names=list(names), dynamo=dynamo)
    return paths, scratch / "calib.npz", scratch / "eval.npz"


def measure_model(name: str, scratch: Path) -> list[dict[str, Any]]:
    paths, calib, evaluation = sources(name, scratch)
    rows = []
    for source in FORMATS:
        started = time.perf_counter()
        report = convert(paths[source], calib=calib, eval=evaluation,
                         out_dir=scratch / f"out_{source}", latency_runs=5)  # fmt: skip
        seconds = time.perf_counter() - started
        placements = {n["name"]: [n["action"], list(n["into"])] for n in report.fold["norms"]}
        for target in report.targets.values():
            drift = target.drift
            rows.append(
                {
                    "model": name,
                    "format": source,
                    "target": target.name,
                    "status": target.status,
                    "agreement": None if drift is None else drift.agreement,
                    "top1_drop_pts": None if drift is None else drift.top1_drop_pts,
                    "recipe": target.int8_recipe,
                    "error": target.error,
                    "placements": placements,
                    "conversion_s": seconds,
                    "samples": None if drift is None else drift.samples,
                }
            )
        print(f"{name} {source}: {seconds:.0f} s", flush=True)
    return rows


def run(models: tuple[str, ...] = MODELS) -> dict[str, Any]:
    """Every model in ``models``; with fewer than all, the committed JSON's other rows kept."""
    kept = [] if set(models) == set(MODELS) else _committed_rows(exclude=models)
    rows = []
    for name in models:
        with tempfile.TemporaryDirectory() as scratch:
            rows += measure_model(name, Path(scratch))
    order = {name: index for index, name in enumerate(MODELS)}
    rows = sorted(kept + rows, key=lambda r: order.get(r["model"], len(order)))
    return {"rows": rows, "edge_un": edge_un.__version__}


def _committed_rows(exclude: tuple[str, ...]) -> list[dict[str, Any]]:
    path = RESULTS / f"{NAME}.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    return [row for row in rows if row["model"] not in exclude]


def _cell(row: dict[str, Any] | None) -> str:
    if row is None or row["agreement"] is None:
        return "failed" if row else "-"
    return f"{100 * row['agreement']:.1f} % ({row['status']})"


def markdown(results: dict[str, Any]) -> str:
    rows = results["rows"]
    lines = [
        "# One model, any source format (same calib.npz and eval.npz for every format)",
        "",
        "Agreement of each target's int8 file with fp32 on the held-out test split, and the "
        "status against the bars. Produced by `python -m benchmarks.conversion.fold_formats`.",
        "",
        f"| model | target | {' | '.join(FORMATS)} | spread |",
        f"|---|---|{'---|' * len(FORMATS)}---|",
    ]
    for name in dict.fromkeys(r["model"] for r in rows):
        for target in TARGET_NAMES:
            cells = {r["format"]: r for r in rows if r["model"] == name and r["target"] == target}
            values = [c["agreement"] for c in cells.values() if c["agreement"] is not None]
            spread = 100 * (max(values) - min(values)) if values else float("nan")
            row = " | ".join(_cell(cells.get(f)) for f in FORMATS)
            lines.append(f"| {name} | {target} | {row} | {spread:.1f} pt |")
    lines += ["", "| model | same fold from every format | conversion time per format (s) |",
              "|---|---|---|"]  # fmt: skip
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        same = len({str(sorted(r["placements"].items())) for r in mine}) == 1
        times = {r["format"]: r["conversion_s"] for r in mine}
        spent = ", ".join(f"{f} {times[f]:.0f}" for f in FORMATS if f in times)
        lines.append(f"| {name} | {'yes' if same else 'NO'} | {spent} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> None:
    rows = results["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    figure, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.6), sharey=True)
    width = 0.8 / len(FORMATS)
    for axis, name in zip(np.atleast_1d(axes), models, strict=True):
        for i, source in enumerate(FORMATS):
            values = [
                next((100 * (r["agreement"] or 0) for r in rows
                      if (r["model"], r["format"], r["target"]) == (name, source, t)), 0)
                for t in TARGET_NAMES
            ]  # fmt: skip
            axis.bar(np.arange(len(TARGET_NAMES)) + i * width, values, width, label=source)
        axis.axhline(99, color="black", linewidth=0.8, linestyle="--")
        axis.set_xticks(np.arange(len(TARGET_NAMES)) + 0.4 - width / 2, TARGET_NAMES)
        axis.set_ylim(95, 100)
        axis.set_title(name, fontsize=9)
    np.atleast_1d(axes)[0].set_ylabel("int8 agreement with fp32 (%)")
    np.atleast_1d(axes)[-1].legend(fontsize=7, loc="lower right")
    save_figure(figure, NAME)


if __name__ == "__main__":
    chosen = tuple(sys.argv[sys.argv.index("--models") + 1 :]) if "--models" in sys.argv else ()
    sys.argv = sys.argv[: sys.argv.index("--models")] if chosen else sys.argv
    benchmark_main(NAME, __doc__, lambda: run(chosen or MODELS), markdown, plot)
