"""The transformers families users bring: every family from every form for every target, and
trained ones through migrate, int8-ready and convert.

    .venv/bin/python -m benchmarks.conversion.hf_families                # ~45 + ~60 min on 2 cores
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.conversion.hf_families --report-only
    .venv/bin/python -m benchmarks.conversion.hf_families --trained-only # the trained models alone

The matrix (``rows``): nine families (:mod:`testbed.hf_families`: ViT, DeiT, Swin, BERT,
DistilBERT, RoBERTa, ALBERT, ELECTRA, GPT-2; tiny, random weights, every LayerNorm swapped to
UN with trained-looking statistics), each exported the three ways users export it (its
``save_pretrained`` directory, a ``torch.export`` program, a dynamo ONNX file), each converted
for every target with the same ``calib.npz`` (64 samples) and ``eval.npz`` (200 samples
labelled by the model's own fp32 predictions: random weights, so agreement is int8 against
fp32 on random inputs from a fixed seed; text at 32 tokens, images at the config's size).
Recorded per family, form and target (:mod:`benchmarks.conversion.conversion_record`): status, top-1
agreement with fp32, the Vela NPU / CPU op split (imx93) or the ops off the accelerator
(imx8mp, tda4vm), the file's inputs, the fold (which norm folded where), and the target's
build time (the load, fold and fp32 export before the first target are the form's own time).

Trained models (``trained``, :mod:`benchmarks.conversion.hf_families_trained`): a Swin on MNIST, a
DistilBERT and a GPT-2 on Rotten Tomatoes, through ``edge-un migrate`` and ``edge-un finetune
--int8-ready`` and converted for every target: the pure int8 drift per target, the conversion
time per target and Vela's split.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

import edge_un
from benchmarks.common.results import RESULTS, benchmark_main, save_figure
from benchmarks.conversion import hf_families_trained as trained
from benchmarks.conversion.conversion_record import cpu_op_types, target_record, timed_convert
from quant.measure.bars import DEFAULT_MAX_DRIFT, DEFAULT_MIN_AGREEMENT
from quant.targets import TARGET_NAMES
from testbed import hf_families

NAME = "hf_families"
FORMS = hf_families.FORMATS


def measure_family(family: str, scratch: Path) -> list[dict[str, Any]]:
    model = hf_families.build(family)
    calib, evaluation = hf_families.write_data(model, scratch)
    forms = hf_families.export_as_users_do(model, hf_families.user_feeds(model, 1, 7), scratch)
    rows = []
    for form in FORMS:
        report, clock = timed_convert(forms[form], scratch / form, calib=calib, eval=evaluation)
        norms = report.fold["norms"]
        fold = {
            "norms": len(norms),
            "folded": sum(n["action"] != "scale_shift" for n in norms),
            "placements": [[n["name"], n["action"], list(n["into"])] for n in norms],
            "kept_reasons": [n["reason"] for n in norms if n["action"] == "scale_shift"],
        }
        spent = clock.per_target()
        for target in report.targets.values():
            rows.append({"family": family, "form": form, "target": target.name,
                         **target_record(target, spent.get(target.name)), **fold,
                         "load_fold_s": clock.before_targets()})  # fmt: skip
        print(f"{family} {form}: {time.perf_counter() - clock.started:.0f} s", flush=True)
    return rows


def run() -> dict[str, Any]:
    rows = []
    for family in hf_families.FAMILIES:
        with tempfile.TemporaryDirectory() as scratch:
            rows += measure_family(family, Path(scratch))
    return {"rows": rows, "edge_un": edge_un.__version__, "trained": trained.run()}


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
        "= the fp32 predictions), status against the bars (drop <= "
        f"{DEFAULT_MAX_DRIFT} pt, agreement >= {100 * DEFAULT_MIN_AGREEMENT:.0f} "
        "%), then for imx93 the Vela op split NPU/CPU, for imx8mp and tda4vm how many op kinds "
        "run off the accelerator. imx8mp takes imx93's int8 TFLite file (built once: its 1 s). "
        "Produced by `python -m benchmarks.conversion.hf_families`.",
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
    cpu_ops = cpu_op_types([op for r in rows for op in r["cpu_ops"] or []])
    if cpu_ops:
        lines += ["", f"Ops Vela leaves to the Cortex-A55 (imx93), all families: "
                      f"{', '.join(cpu_ops)}: the int64 and boolean work on the token ids "
                      "and the mask (embedding lookups, the attention mask, RoBERTa's position "
                      "ids, GPT-2's causal mask and last-token index), which Vela refuses as "
                      "'Unsupported dataType Int64' or an op Ethos-U has not; the image "
                      "families have none."]  # fmt: skip
    return "\n".join(lines) + "\n\n" + trained.markdown(results.get("trained"))


def _why(reason: str) -> str:
    """A kept norm's reason, short: what stopped the forward fold."""
    forward = reason.split(";")[0].removeprefix("forward: ")
    if "a residual" in forward:
        return "feeds a residual add"
    return "feeds a Linear of shared layers" if "shares its weight" in forward else forward


def _plot_matrix(rows: list[dict[str, Any]], axis: Any) -> Any:
    families = list(dict.fromkeys(r["family"] for r in rows))
    columns = [(form, target) for form in FORMS for target in TARGET_NAMES]
    grid = np.full((len(families), len(columns)), np.nan)
    for r in rows:
        if r["agreement"] is not None and r["status"] != "failed":
            i, j = families.index(r["family"]), columns.index((r["form"], r["target"]))
            grid[i, j] = 100 * r["agreement"]
    image = axis.imshow(grid, vmin=90, vmax=100, cmap="viridis", aspect="auto")
    axis.set_xticks(range(len(columns)), [f"{f}\n{t}" for f, t in columns], fontsize=7)
    axis.set_yticks(range(len(families)), families)
    for i in range(len(families)):
        for j in range(len(columns)):
            text = "fail" if np.isnan(grid[i, j]) else f"{grid[i, j]:.1f}"
            axis.text(j, i, text, ha="center", va="center", fontsize=6)
    axis.set_title("Every family, form and target: int8 vs fp32 top-1 agreement")
    return image


def plot(results: dict[str, Any]) -> None:
    record = results.get("trained")
    panels = 2 if record else 1
    figure, axes = plt.subplots(panels, 1, figsize=(12, 4.2 * panels), squeeze=False)
    image = _plot_matrix(results["rows"], axes[0][0])
    figure.colorbar(image, ax=axes[0][0], label="int8 agreement with fp32 (%)")
    if record:
        trained.plot(record, axes[1][0])
    save_figure(figure, NAME)


def trained_only() -> None:
    """The trained half alone, its record merged into the committed results of the whole."""
    path = RESULTS / f"{NAME}.json"
    results = json.loads(path.read_text())
    previous = (results.get("trained") or {}).get("models", {})
    results["trained"] = trained.run()
    for name, model in results["trained"]["models"].items():  # a kept directory's step: the
        made = previous.get(name, {}).get("seconds", {})  # wall time of the run that made it
        model["seconds"] = {**made, **model["seconds"]}
    path.write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / f"{NAME}.md").write_text(markdown(results))
    plot(results)
    print(trained.markdown(results["trained"]))


if __name__ == "__main__":
    modes = {"trained-only": ("run the trained models alone (~60 min)", trained_only)}
    benchmark_main(NAME, __doc__, run, markdown, plot, modes)
