"""The two TFLite routes side by side: litert-torch (the folded torch program -> LiteRT,
ai-edge-quantizer) against onnx2tf (the fp32 ONNX file -> TensorFlow), for imx93 (Vela).

    .venv/bin/python -m benchmarks.tflite_routes                  # ~1 h on 2 cores
    .venv/bin/python -m benchmarks.tflite_routes --only bundled   # or families, scale: one group
    .venv/bin/python -m benchmarks.tflite_routes --report-only    # Markdown and plot from the JSON
    (--note "..." adds a sentence on how or where it ran to the results)

Models: the bundled examples (their own data sets) and the nine families of
:mod:`testbed.hf_families` in each form users export them (a ``save_pretrained`` directory, a
``torch.export`` program, a dynamo ONNX file; calib.npz / eval.npz from ``write_data``). Each
model, form and route is one ``quant.pipeline.convert(..., targets="imx93", latency_runs=20)`` in
a fresh process (:func:`worker`) with ``EDGE_UN_TFLITE_ROUTE`` set to that route alone (no
fallback); an ONNX source has no torch program, so its litert-torch row is "n/a". Recorded per
row: the route the report names, status and error, agreement / top-1 drop / cosine of the shipped
file, Vela's NPU / CPU ops, cycles and estimated ms, the ops XNNPACK took and LiteRT's p50 at one
thread, the imx93 build's seconds (progress events, ``TargetClock``), the process's wall time,
the peak RSS of the worker's process tree (itself and the build and tool processes it starts,
sampled every 0.2 s, never below its own VmHWM; ``getrusage``'s figures are kept too), and how
many cores other work on the host kept busy meanwhile.

The ``scale`` group is BERT-base (HF's default ``BertConfig``, 110 M parameters, UN swapped in,
random weights with trained-looking norm statistics, 32 tokens) as a ``save_pretrained``
directory through both routes, the drift bars off: random weights have no margins to keep, so
the row measures the TFLite build's time and memory, not its accuracy.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.results_main import RESULTS, ROOT, benchmark_main, git_commit, save_figure

NAME = "tflite_routes"
ROUTES = ("litert-torch", "onnx2tf")
GROUPS = ("bundled", "families", "scale")
BUNDLED = ("vit-mnist-un", "vit-mnist-ln-to-un", "text-rt-un", "hf-vit-mnist-un", "hf-bert-rt-un")
WORKER_TIMEOUT_S = 1800
NOT_APPLICABLE = "an ONNX source has no torch program (auto takes onnx2tf)"
BUSY = 0.5  # cores kept busy by other work from which a row counts as measured on a busy host


def worker(
    model: str, out: str, result: str, calib: str = "", evaluation: str = "", bars: str = "on"
) -> None:
    """One imx93 conversion in this (fresh) process, its row written to ``result`` as JSON;
    ``bars="off"`` ships the pure int8 file whatever its drift (no fallback ladder)."""
    import psutil

    from benchmarks.conversion_record import TargetClock
    from benchmarks.latency_stages import tree_memory
    from quant.pipeline import convert

    me, peak, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], tree_memory(me)[0])

    threading.Thread(target=sample, daemon=True).start()
    clock = TargetClock()
    off = {"max_drift": 100.0, "min_agreement": 0.0} if bars == "off" else {}
    try:
        report = convert(model, targets="imx93", calib=calib or None, eval=evaluation or None,
                         out_dir=out, progress=clock, latency_runs=20, **off)  # fmt: skip
        row = _target_row(report.targets["imx93"], report.model.input_dtype)
    except Exception as error:  # a failed row, not a failed run
        row = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
    done.set()
    hwm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text()
               .splitlines() if line.startswith("VmHWM:"))  # fmt: skip
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    row |= {"build_s": clock.per_target().get("imx93"), "convert_s": time.perf_counter()
            - clock.started, "peak_rss_gb": max(peak[0], hwm) / 1e9, "self_maxrss_gb": hwm / 1e9,
            "children_maxrss_gb": children / 1e9}  # fmt: skip
    Path(result).write_text(json.dumps(row))


def _target_row(target: Any, input_dtype: str) -> dict[str, Any]:
    drift, vela, route = target.drift, target.vela, target.tflite_route
    one = next(
        (lat for lat in target.latency if lat.runtime == "litert" and lat.threads == 1), None
    )
    xnnpack = None
    if one is not None and one.xnnpack_ops is not None:
        xnnpack = [sum(t for _, t in one.xnnpack_ops.values()),
                   sum(n for n, _ in one.xnnpack_ops.values())]  # fmt: skip
    return {
        "status": target.status, "error": target.error, "vision": input_dtype.startswith("float"),
        "route_taken": route and route.name, "route_reason": route and route.reason,
        "agreement": drift and drift.agreement, "top1_drop_pts": drift and drift.top1_drop_pts,
        "cosine": drift and drift.cosine, "npu_ops": vela and vela.npu_ops,
        "cpu_ops": vela and list(vela.cpu_ops), "vela_cycles": vela and vela.cycles,
        "vela_est_ms": vela and vela.est_ms, "xnnpack_taken": xnnpack,
        "p50_ms_1t": one and one.p50_ms, "latency_others_busy": one and one.others_busy_cores,
        "fallback_ops": target.fallback_ops,
    }  # fmt: skip


def _busy_s() -> float:
    """Seconds the host's cores have been busy (all processes) since boot."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def measure(
    model: Path, route: str, work: Path, data: tuple[Path, Path] | None, bars: str = "on"
) -> dict:
    """One route on one model, in a fresh process; what other work did on the host meanwhile."""
    work.mkdir(parents=True)
    result, log = work / "row.json", work / "worker.log"
    code = "import sys; from benchmarks.tflite_routes import worker; worker(*sys.argv[1:])"
    args = [sys.executable, "-c", code, str(model), str(work / "out"), str(result)]
    args += [str(p) for p in data or ("", "")] + [bars]
    env = {**os.environ, "EDGE_UN_TFLITE_ROUTE": route}
    ours = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy, started = _busy_s(), time.perf_counter()
    with log.open("w") as output, contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(args, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                       timeout=WORKER_TIMEOUT_S, check=False)  # fmt: skip
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    ours_s = after.ru_utime + after.ru_stime - ours.ru_utime - ours.ru_stime
    if result.is_file():
        row = json.loads(result.read_text())
    else:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        row = {"status": "failed", "error": f"worker died: {lines[-1] if lines else wall}"}
    others = max(0.0, (_busy_s() - busy - ours_s) / wall)
    return {"route": route, **row, "wall_s": wall, "others_busy_cores": round(others, 2)}


def _rows_for(
    name: str, form: str, group: str, model: Path, work: Path, data: Any, bars: str = "on"
) -> list:
    rows = []
    for route in ROUTES:
        head = {"group": group, "model": name, "form": form, "bars": bars}
        if form == "onnx" and route == "litert-torch":
            rows.append({**head, "route": route, "status": "n/a", "error": NOT_APPLICABLE})
            continue
        rows.append({**head, **measure(model, route, work / f"{form}-{route}", data, bars)})
        row = rows[-1]
        print(
            f"{name} {form} {route}: {row['status']}, build {row.get('build_s') or 0:.0f} s, "
            f"wall {row['wall_s']:.0f} s, {row.get('error') or ''}"[:200],
            flush=True,
        )
    return rows


def run(only: str | None = None, note: str | None = None) -> dict[str, Any]:
    from edge_un import examples
    from quant.host import describe_host

    previous = RESULTS / f"{NAME}.json"
    kept = json.loads(previous.read_text())["rows"] if only and previous.is_file() else []
    rows = [r for r in kept if r["group"] != only]
    commit, uncommitted = git_commit(), _uncommitted()  # the code measured: as the run starts
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        if only in (None, "bundled"):
            for name in BUNDLED:
                path = examples.path(name)
                form = "directory" if path.is_dir() else path.suffix.lstrip(".")
                rows += _rows_for(name, form, "bundled", path, work / name, None)
        if only in (None, "families"):
            from testbed import hf_families

            for family in hf_families.FAMILIES:
                (work / family).mkdir()
                model = hf_families.build(family)
                data = hf_families.write_data(model, work / family)
                feeds = hf_families.user_feeds(model, 1, 7)
                forms = hf_families.export_as_users_do(model, feeds, work / family)
                for form, path in forms.items():
                    rows += _rows_for(family, form, "families", path, work / family, data)
        if only in (None, "scale"):
            from testbed import hf_families

            (work / "bert-base").mkdir()
            model = _bert_base()
            data = hf_families.write_data(model, work / "bert-base")
            feeds = hf_families.user_feeds(model, 1, 7)
            path = hf_families.export_as_users_do(model, feeds, work / "bert-base", ["directory"])
            rows += _rows_for("bert-base", "directory", "scale", path["directory"],
                              work / "bert-base", data, bars="off")  # fmt: skip
    return {"rows": rows, "host": describe_host().model_dump(), "commit": commit,
            "uncommitted": uncommitted, "run_s": time.perf_counter() - started, "rerun": only,
            "note": note, "load_average_at_end": os.getloadavg()}  # fmt: skip


def _bert_base() -> Any:
    """BERT-base (HF's default config), UN swapped in, trained-looking norm statistics."""
    import edge_un
    from testbed import hf_families

    transformers = edge_un.hf.require_transformers()
    model = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2))
    edge_un.swap_layernorm(model, kind="un")
    return hf_families.randomize_norm_state(model, 0).eval()


def _uncommitted() -> bool:
    """Whether the tracked code measured differs from HEAD (read only: no index refresh); the
    results of a group run just before (this benchmark's own files) are not code."""
    diff = ["git", "--no-optional-locks", "diff", "--quiet", "HEAD", "--", ".",
            ":(exclude)benchmarks/results"]  # fmt: skip
    return subprocess.run(diff, cwd=ROOT, check=False).returncode != 0


def _built(row: dict) -> bool:
    return row["status"] in ("ok", "over_bar")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _f(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(scale * value, spec)


def _status(row: dict) -> str:
    if row["status"] in ("ok", "over_bar"):
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
    lines = [
        "| model | form | route | status | agreement | drop pt | Vela NPU/CPU ops | Vela est ms "
        "| XNNPACK ops taken | LiteRT p50 ms (1 thread) | TFLite build s | peak RSS GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vela = "-" if r.get("npu_ops") is None else f"{r['npu_ops']}/{len(r['cpu_ops'])}"
        taken = r.get("xnnpack_taken")
        lines.append(
            f"| {r['model']} | {r['form']} | {r['route']} | {_status(r)} | "
            f"{_f(r.get('agreement'), '.1f', 100)} % | {_f(r.get('top1_drop_pts'), '.1f')} | "
            f"{vela} | {_f(r.get('vela_est_ms'), '.2f')} | "
            f"{'-' if taken is None else f'{taken[0]}/{taken[1]}'} | "
            f"{_f(r.get('p50_ms_1t'), '.2f')} | {_f(r.get('build_s'), '.0f')} | "
            f"{_f(r.get('peak_rss_gb'), '.2f')} |"
        )
    return lines


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
        "and drop: the shipped int8 file against fp32 (top-1); Vela: ops on the Ethos-U65 / on "
        "the Cortex-A55, and its estimated ms; XNNPACK: ops its delegate took / ops in the file; "
        "LiteRT p50 on this host at 1 thread; TFLite build: the imx93 target's seconds (progress "
        "events: conversion, Vela, drift, latency); peak RSS: the worker's process tree at once. "
        f'"other route": the report names another route than asked. On {host.label()}, '
        f"commit {results['commit']}{' (with uncommitted changes)' * results['uncommitted']}, "
        f"{results['run_s'] / 60:.0f} min. Produced by `python -m benchmarks.tflite_routes`.",
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
            lines += [f"## {group.capitalize()}", "", *_table(mine), ""]
            if group == "scale":
                lines += ["Random weights, drift bars off: the pure int8 file ships whatever "
                          "its agreement, which measures nothing here (no margins); the row "
                          "is for the TFLite build's time and peak memory.", ""]  # fmt: skip
    pairs = {}
    for r in rows:
        pairs.setdefault((r["model"], r["form"]), {})[r["route"]] = r
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
    keys = list(dict.fromkeys((r["model"], r["form"]) for r in rows))
    by_key = {(r["model"], r["form"], r["route"]): r for r in rows}
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
    axes[1].set_xticks(x, [f"{m}\n{f}" for m, f in keys], rotation=90, fontsize=7)
    axes[0].set_title("imx93: litert-torch against onnx2tf, per model and form")
    save_figure(figure, NAME)


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--only", choices=GROUPS)
    parser.add_argument("--note", help="a sentence for the results: how or where it ran")
    args, rest = parser.parse_known_args()
    sys.argv[1:] = rest
    benchmark_main(NAME, __doc__, functools.partial(run, args.only, args.note), markdown, plot)


if __name__ == "__main__":
    main()
