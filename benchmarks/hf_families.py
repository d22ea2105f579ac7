"""The transformers families users bring, from every form, for every target: built or not.

    .venv/bin/python -m benchmarks.hf_families                # ~45 min on 2 cores
    .venv/bin/python -m benchmarks.hf_families --report-only  # Markdown and plot from the JSON

Nine families (:mod:`testbed.hf_families`: ViT, DeiT, Swin, BERT, DistilBERT, RoBERTa, ALBERT,
ELECTRA, GPT-2; tiny, random weights, every LayerNorm swapped to UN with trained-looking
statistics), each exported the three ways users export it (its ``save_pretrained`` directory,
a ``torch.export`` program, a dynamo ONNX file), each converted for every target with the same
``calib.npz`` (64 samples) and ``eval.npz`` (200 samples labelled by the model's own fp32
predictions: random weights, so agreement is int8 against fp32 on random inputs from a fixed
seed; text at 32 tokens, images at the config's size). Recorded per family, form and target:
status, top-1 agreement with fp32, the Vela NPU / CPU op split (imx93) or the ops off the
accelerator (imx8mp, tda4vm), the file's inputs, the fold (which norm folded where), and the
target's build time (from the pipeline's progress events; the load, fold and fp32 export
before the first target are the form's own time).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

import edge_un
from benchmarks.results_main import benchmark_main, save_figure
from converters.progress import ProgressEvent
from quant.pipeline import convert
from quant.targets import TARGET_NAMES
from testbed import hf_families

NAME = "hf_families"
FORMS = hf_families.FORMATS


class Clock:
    """When each target's first and last progress event came, and when the run started."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.spans: dict[str, list[float]] = {}

    def __call__(self, event: ProgressEvent) -> None:
        if event.target is not None:
            now = time.perf_counter()
            self.spans.setdefault(event.target, [now, now])[1] = now

    def seconds(self, target: str) -> float | None:
        span = self.spans.get(target)
        return None if span is None else span[1] - span[0]

    def before_targets(self) -> float:
        first = min((span[0] for span in self.spans.values()), default=time.perf_counter())
        return first - self.started


def measure_family(family: str, scratch: Path) -> list[dict[str, Any]]:
    model = hf_families.build(family)
    calib, evaluation = hf_families.write_data(model, scratch)
    forms = hf_families.export_as_users_do(model, hf_families.user_feeds(model, 1, 7), scratch)
    rows = []
    for form in FORMS:
        clock = Clock()
        report = convert(forms[form], calib=calib, eval=evaluation, out_dir=scratch / form,
                         latency_runs=5, progress=clock)  # fmt: skip
        norms = report.fold["norms"]
        placements = [[n["name"], n["action"], list(n["into"])] for n in norms]
        for target in report.targets.values():
            drift, vela = target.drift, target.vela
            rows.append(
                {
                    "family": family,
                    "form": form,
                    "target": target.name,
                    "status": target.status,
                    "error": target.error,
                    "agreement": None if drift is None else drift.agreement,
                    "samples": None if drift is None else drift.samples,
                    "npu_ops": None if vela is None else vela.npu_ops,
                    "cpu_ops": None if vela is None else vela.cpu_ops,
                    "fallback_ops": target.fallback_ops,
                    "inputs": {i.name: i.shape for i in target.inputs},
                    "norms": len(norms),
                    "folded": sum(n["action"] != "scale_shift" for n in norms),
                    "placements": placements,
                    "kept_reasons": [n["reason"] for n in norms if n["action"] == "scale_shift"],
                    "target_s": clock.seconds(target.name),
                    "load_fold_s": clock.before_targets(),
                }
            )
        print(f"{family} {form}: {time.perf_counter() - clock.started:.0f} s", flush=True)
    return rows


def run() -> dict[str, Any]:
    rows = []
    for family in hf_families.FAMILIES:
        with tempfile.TemporaryDirectory() as scratch:
            rows += measure_family(family, Path(scratch))
    return {"rows": rows, "edge_un": edge_un.__version__}


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if row["status"] == "failed":
        return "**failed**"
    agreement = f"{100 * row['agreement']:.1f} %" if row["agreement"] is not None else "?"
    ops = ""
    if row["npu_ops"] is not None:
        ops = f", {row['npu_ops']}/{len(row['cpu_ops'])}"
    elif row["fallback_ops"]:
        ops = f", {len(row['fallback_ops'])} off"
    return f"{agreement} {row['status']}{ops}"


def markdown(results: dict[str, Any]) -> str:
    rows = results["rows"]
    by_key = {(r["family"], r["form"], r["target"]): r for r in rows}
    families = list(dict.fromkeys(r["family"] for r in rows))
    failed = [r for r in rows if r["status"] == "failed"]
    lines = [
        "# The transformers families users bring: every form, every target",
        "",
        "Tiny random-weight models (testbed/hf_families.py), every LayerNorm swapped to UN; "
        "each cell: top-1 agreement of the int8 file with fp32 on 200 random inputs (labels "
        "= the fp32 predictions), status against the bars (drop <= 0.5 pt, agreement >= 99 %), "
        "then for imx93 the Vela op split NPU/CPU, for imx8mp and tda4vm how many op kinds run "
        "off the accelerator. imx8mp takes imx93's int8 TFLite file (built once: its 1 s). "
        "Produced by `python -m benchmarks.hf_families`.",
        "",
        f"Built: {len(rows) - len(failed)} of {len(rows)} family x form x target; failed: "
        f"{len(failed)}.",
        "",
        f"| family | form | {' | '.join(TARGET_NAMES)} |",
        f"|---|---|{'---|' * len(TARGET_NAMES)}",
    ]
    for family in families:
        for form in FORMS:
            cells = " | ".join(_cell(by_key.get((family, form, t))) for t in TARGET_NAMES)
            lines.append(f"| {family} | {form} | {cells} |")
    lines += [
        "",
        "| family | norms folded | same fold from every form | kept, why | build s per target "
        "(cpu / imx93 / imx8mp / tda4vm, median of forms) | text length / image |",
        "|---|---|---|---|---|---|",
    ]
    for family in families:
        mine = [r for r in rows if r["family"] == family]
        same = len({str(r["placements"]) for r in mine}) == 1
        reasons = sorted({_why(reason) for r in mine for reason in r["kept_reasons"]})
        times = [
            np.median([r["target_s"] for r in mine if r["target"] == t and r["target_s"]])
            for t in TARGET_NAMES
        ]
        shapes = {str(v) for r in mine for v in r["inputs"].values()}
        lines.append(
            f"| {family} | {mine[0]['folded']} of {mine[0]['norms']} | "
            f"{'yes' if same else 'NO'} | {'; '.join(reasons) or '-'} | "
            f"{' / '.join(f'{t:.0f}' for t in times)} | {', '.join(sorted(shapes))} |"
        )
    if failed:
        lines += ["", "## Failed", ""]
        lines += [f"- {r['family']} {r['form']} {r['target']}: {r['error']}" for r in failed]
    cpu_ops = sorted({op.split()[0] for r in rows for op in r["cpu_ops"] or []})
    if cpu_ops:
        lines += ["", f"Ops Vela leaves to the Cortex-A55 (imx93), all families: "
                      f"{', '.join(cpu_ops)}: the int64 and boolean work on the token ids "
                      "and the mask (embedding lookups, the attention mask, RoBERTa's position "
                      "ids, GPT-2's causal mask and last-token index), which Vela refuses as "
                      "'Unsupported dataType Int64' or an op Ethos-U has not; the image "
                      "families have none."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _why(reason: str) -> str:
    """A kept norm's reason, short: what stopped the forward fold."""
    forward = reason.split(";")[0].removeprefix("forward: ")
    if "a residual" in forward:
        return "feeds a residual add"
    return "feeds a Linear of shared layers" if "shares its weight" in forward else forward


def plot(results: dict[str, Any]) -> None:
    rows = results["rows"]
    families = list(dict.fromkeys(r["family"] for r in rows))
    columns = [(form, target) for form in FORMS for target in TARGET_NAMES]
    grid = np.full((len(families), len(columns)), np.nan)
    for r in rows:
        if r["agreement"] is not None and r["status"] != "failed":
            i, j = families.index(r["family"]), columns.index((r["form"], r["target"]))
            grid[i, j] = 100 * r["agreement"]
    figure, axis = plt.subplots(figsize=(12, 4.2))
    image = axis.imshow(grid, vmin=90, vmax=100, cmap="viridis", aspect="auto")
    axis.set_xticks(range(len(columns)), [f"{f}\n{t}" for f, t in columns], fontsize=7)
    axis.set_yticks(range(len(families)), families)
    for i in range(len(families)):
        for j in range(len(columns)):
            text = "fail" if np.isnan(grid[i, j]) else f"{grid[i, j]:.1f}"
            axis.text(j, i, text, ha="center", va="center", fontsize=6)
    figure.colorbar(image, label="int8 agreement with fp32 (%)")
    axis.set_title("Every family, form and target: int8 vs fp32 top-1 agreement")
    save_figure(figure, NAME)


if __name__ == "__main__":
    benchmark_main(NAME, __doc__, run, markdown, plot)
