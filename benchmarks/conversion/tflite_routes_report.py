"""The Markdown tables and the plot of ``benchmarks.conversion.tflite_routes``'s results, and the
rule that names the default route per source kind."""

from __future__ import annotations

import re
import statistics
from typing import Any

from benchmarks.common.results import save_figure

NAME = "tflite_routes"
ROUTES = ("litert-torch", "onnx2tf")
GROUPS = ("bundled", "families", "trained", "scale")
OTHER_TARGETS = ("imx8mp",)  # recorded beside imx93 where a group builds them too
BUSY = 0.5  # cores kept busy by other work from which a row counts as measured on a busy host


def _built(row: dict) -> bool:
    return row["status"] in ("ok", "over_bar")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _f(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(scale * value, spec)


def _status(row: dict) -> str:
    if _built(row):
        return row["status"] if row.get("route_taken") == row["route"] else "**other route**"
    error = _short(row.get("error") or "")
    error = error if len(error) <= 120 else f"{error[:50]} ... {error[-65:]}"
    return f"{'**failed**' if row['status'] == 'failed' else row['status']}: " + error.replace(
        "|", "/"
    )


def _short(error: str) -> str:
    """An error's first line without the path of its (temporary) log."""
    return re.sub(r" ?\(log: [^)]*\)", "", error.splitlines()[0] if error else "")


def _table(rows: list[dict]) -> list[str]:
    others = sorted({key for r in rows for key in r if key in OTHER_TARGETS})
    lines = [
        "| model | form | route | status | agreement | drop pt | precision | Vela NPU/CPU ops "
        "| Vela est ms | XNNPACK ops taken | LiteRT p50 ms (1 thread) | TFLite build s "
        "| converter s: to float + to int8 | converter peak GB | peak RSS GB |"
        + "".join(f" {name}: status, agreement, precision |" for name in others),
        "|---" * (15 + len(others)) + "|",
    ]
    for r in rows:
        vela = "-" if r.get("npu_ops") is None else f"{r['npu_ops']}/{len(r['cpu_ops'])}"
        taken = r.get("xnnpack_taken")
        tool = (f"{r['tool_convert_s']:.0f} + {r['tool_quantize_s']:.0f}"
                if r.get("tool_convert_s") is not None else "-")  # fmt: skip
        lines.append(
            f"| {r['model']} | {r['form']} | {r['route']} | {_status(r)} | "
            f"{_f(r.get('agreement'), '.1f', 100)} % | {_f(r.get('top1_drop_pts'), '.1f')} | "
            f"{r.get('precision') or '-'} | {vela} | {_f(r.get('vela_est_ms'), '.2f')} | "
            f"{'-' if taken is None else f'{taken[0]}/{taken[1]}'} | "
            f"{_f(r.get('p50_ms_1t'), '.2f')} | {_f(r.get('build_s'), '.0f')} | {tool} | "
            f"{_f(r.get('tool_peak_gb'), '.2f')} | {_f(r.get('peak_rss_gb'), '.2f')} |"
            + "".join(f" {_other(r.get(name))} |" for name in others)
        )
    return lines


def _other(target: dict | None) -> str:
    if not target:
        return "-"
    if target["status"] == "failed":
        return f"**failed**: {_short(target.get('error') or '')}"
    return (f"{target['status']}, {_f(target.get('agreement'), '.1f', 100)} %, "
            f"{target.get('precision') or '-'}")  # fmt: skip


def _stage_line(row: dict) -> str:
    """A scale row's TFLite stage: the converter's own steps, time and peak memory."""
    convert, quantize = row.get("tool_convert_s"), row.get("tool_quantize_s")
    if convert is None:
        return f"{row['model']} {row['route']}: the converter's steps were not timed in this run"
    return (f"{row['model']} {row['route']}: the converter's steps {convert + quantize:.0f} s "
            f"({convert:.0f} s to the float file, {quantize:.0f} s to int8), its largest "
            f"process {_f(row.get('tool_peak_gb'), '.2f')} GB at peak; the whole imx93 build "
            f"{row['build_s']:.0f} s")  # fmt: skip


def _route_summary(rows: list[dict], route: str) -> str:
    mine = [r for r in rows if r["route"] == route and r["status"] != "n/a"]
    built = [r for r in mine if _built(r)]
    vision = [r for r in built if r.get("vision")]
    agreement = _median([r["agreement"] for r in built
                         if r.get("agreement") is not None and r.get("bars") != "off"])  # fmt: skip
    rss = _median([r["peak_rss_gb"] for r in mine if r.get("peak_rss_gb")])
    clean = [r for r in vision if r.get("cpu_ops") == []]
    kinds = sorted({op.split()[0] for r in vision for op in r["cpu_ops"] or []})
    seconds = _median([r["build_s"] for r in built])
    return (
        f"**{route}** built {len(built)} of {len(mine)} applicable rows "
        f"({sum(r['status'] == 'ok' for r in built)} within the bars), median agreement "
        f"{_f(agreement, '.1f', 100)} %, median TFLite build {_f(seconds, '.0f')} s, median "
        f"peak RSS {_f(rss, '.2f')} GB; vision models with 0 Vela CPU ops: {len(clean)} of "
        f"{len(vision)} built"
        + (f" (the others leave {', '.join(kinds)} to the CPU)" if kinds else "")
    )


def _default_routes(rows: list[dict]) -> str:
    """Per source kind, the route that built most, then most within the bars, then left the
    fewest ops to the Cortex-A (the cost a board pays on every inference), then fastest."""
    parts = []
    for kind, torch_source in (("torch sources (checkpoint, directory, pt2)", True),
                               ("ONNX sources", False)):  # fmt: skip
        scores = []
        for route in ROUTES:
            mine = [r for r in rows if r["route"] == route and r["status"] != "n/a"
                    and (r["form"] != "onnx") == torch_source]  # fmt: skip
            if not mine:
                continue
            built = [r for r in mine if _built(r)]
            seconds = _median([r["build_s"] for r in built]) or float("inf")
            ok = sum(r["status"] == "ok" for r in built)
            cpu_ops = sum(len(r["cpu_ops"] or []) for r in built)
            scores.append(((len(built), ok, -cpu_ops, -seconds), route,
                           f"{len(built)}/{len(mine)} built, {ok} within the bars, {cpu_ops} "
                           f"Vela CPU ops in all, median build {seconds:.0f} s"))  # fmt: skip
        if scores:
            best = max(scores)
            others = "; ".join(f"{name}: {text}" for _, name, text in scores if name != best[1])
            parts.append(f"{kind}: **{best[1]}** ({best[2]}" + (f"; against {others})" if others
                         else "; the only route that applies)"))  # fmt: skip
    return "Default route per source kind, from these rows: " + ". ".join(parts) + "."


def markdown(results: dict[str, Any]) -> str:
    from quant import report as schema
    from testbed.hf_families import FAMILIES

    rows, host = results["rows"], schema.Host(**results["host"])
    busy = [r["others_busy_cores"] for r in rows if r.get("others_busy_cores") is not None]
    lines = [
        "# The TFLite routes side by side: litert-torch against onnx2tf, for imx93",
        "",
        'Each row: `quant.pipeline.convert(..., targets="imx93", latency_runs=20)` in a fresh '
        "process with `EDGE_UN_TFLITE_ROUTE` set to the route alone (no fallback). Agreement "
        "and drop: the shipped file against fp32 (top-1); precision: what it keeps wider than "
        "int8; Vela: ops on the Ethos-U65 / on "
        "the Cortex-A55, and its estimated ms; XNNPACK: ops its delegate took / ops in the file; "
        "LiteRT p50 on this host at 1 thread; TFLite build: the imx93 target's seconds (progress "
        "events: conversion, Vela, drift, latency); converter: the route's own steps as the "
        "report times them (litert-torch's conversion to a float file, then calibration and "
        "quantization; onnx2tf's SavedModel and float file, then TensorFlow's int8 conversion) "
        "and the largest peak RSS (VmHWM) of one of its processes; peak RSS: the worker's "
        "process tree at once. "
        '"other route": the report names another route than asked. Each group says where and '
        "at which commit (+: with uncommitted changes) its rows were measured; the last run "
        f"({results['rerun'] or 'every group'}) took {results['run_s'] / 60:.0f} min on "
        f"{host.label()}. Produced by `python -m benchmarks.conversion.tflite_routes`.",
        "",
    ]
    if results.get("note"):
        lines += [results["note"], ""]
    if busy and max(busy) >= BUSY:
        loaded = sum(b >= BUSY for b in busy)
        mean = statistics.mean(busy)
        lines += [f"The host ran other work meanwhile: other processes kept {mean:.1f} "
                  f"cores busy on average (up to {max(busy):.1f} in one row; {loaded} of "
                  f"{len(busy)} rows at {BUSY} or more), so build times, peak RSS aside, and "
                  "latencies are slower than on a quiet host.", ""]  # fmt: skip
    done = {r["model"] for r in rows if r["group"] == "families"}
    missing = [f for f in FAMILIES if f not in done]
    if missing:
        lines += [f"Left out of this run: families {', '.join(missing)}.", ""]
    for group in GROUPS:
        mine = [r for r in rows if r["group"] == group]
        if mine:
            measured = "; ".join(sorted({f"{r['host']} at {r['commit']}" for r in mine}))
            lines += [f"## {group.capitalize()}", "", f"Measured on {measured}.", "",
                      *_table(mine), ""]  # fmt: skip
            if group == "trained":
                lines += ["Trained on the data that ships in wheels, bars on (the defaults), "
                          "imx93 and imx8mp from one conversion: Swin, DistilBERT and GPT-2 "
                          "through `edge-un migrate` and `edge-un finetune --int8-ready` "
                          "(`benchmarks.conversion.hf_families_trained`); hf-vit-un-plain is the "
                          "bundled "
                          "LayerNorm HF ViT through `edge-un migrate` alone, a UN model never "
                          "made int8-ready.", ""]  # fmt: skip
            if group == "scale":
                lines += ["Random weights, drift bars off: the pure int8 file ships whatever "
                          "its agreement, which measures nothing here (no margins); the row "
                          "is for the TFLite build's time and peak memory.", ""]  # fmt: skip
                lines += [f"- {_stage_line(r)}" for r in mine if _built(r)] + [""]
    pairs = {}
    for r in rows:
        pairs.setdefault((r["group"], r["model"], r["form"]), {})[r["route"]] = r
    ratios = [p["litert-torch"]["build_s"] / p["onnx2tf"]["build_s"] for p in pairs.values()
              if all(route in p and _built(p[route]) for route in ROUTES)]  # fmt: skip
    agree = sum(p["litert-torch"]["agreement"] >= p["onnx2tf"]["agreement"] for p in pairs.values()
                if all(route in p and _built(p[route]) for route in ROUTES))  # fmt: skip
    lines += ["## What the numbers say", ""]
    lines += [f"- {_route_summary(rows, route)}." for route in ROUTES]
    lines += [
        f"- Built by both: {len(ratios)} model x form; TFLite build time litert-torch / onnx2tf, "
        f"median {_f(_median(ratios), '.2f')} (range {_f(min(ratios, default=None), '.2f')} - "
        f"{_f(max(ratios, default=None), '.2f')}); litert-torch's agreement at least "
        f"onnx2tf's on {agree} of {len(ratios)}.",
        f"- {_default_routes(rows)}",
    ]
    failed = [r for r in rows if r["status"] == "failed"]
    if failed:
        lines += ["", "## Failed", ""]
        lines += [f"- {r['model']} {r['form']} {r['route']}: {_short(r['error'])}" for r in failed]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = results["rows"]
    keys = list(dict.fromkeys((r["group"], r["model"], r["form"]) for r in rows))
    by_key = {(r["group"], r["model"], r["form"], r["route"]): r for r in rows}
    figure, axes = plt.subplots(2, 1, figsize=(max(10, 0.42 * len(keys)), 8), sharex=True)
    x, width = np.arange(len(keys)), 0.4
    panels = (("build_s", 1, "imx93 TFLite build (s)"), ("agreement", 100, "agreement (%)"))
    for axis, (field, scale, label) in zip(axes, panels, strict=True):
        for i, route in enumerate(ROUTES):
            values = []
            for key in keys:
                row = by_key.get((*key, route))
                values.append(scale * row[field] if row and _built(row) and row.get(field)
                              is not None else np.nan)  # fmt: skip
            axis.bar(x + (i - 0.5) * width, values, width, label=route)
            for j, value in enumerate(values):
                if np.isnan(value):
                    row = by_key.get((*keys[j], route))
                    mark = "n/a" if row and row["status"] == "n/a" else "x"
                    at = axis.get_xaxis_transform()
                    axis.text(x[j] + (i - 0.5) * width, 0.02, mark, ha="center", va="bottom",
                              fontsize=6, rotation=90, transform=at)  # fmt: skip
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    bottom = min((100 * r["agreement"] for r in rows if _built(r) and r.get("agreement")),
                 default=90)  # fmt: skip
    axes[1].set_ylim(min(bottom - 1, 99), 100.5)
    axes[1].set_xticks(x, [f"{m}\n{f}" + ("\ntrained" if g == "trained" else "")
                           for g, m, f in keys], rotation=90, fontsize=7)  # fmt: skip
    axes[0].set_title("imx93: litert-torch against onnx2tf, per model and form")
    save_figure(figure, NAME)
