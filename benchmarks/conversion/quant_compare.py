"""UN vs its LayerNorm twin through the same pipeline, every target, side by side.

    python -m benchmarks.conversion.quant_compare                 # every model, ~15 min on 2 cores
    # only these, merged into the JSON
    python -m benchmarks.conversion.quant_compare vit-mnist-ln-to-un
    # tables and plot from the JSON only
    python -m benchmarks.conversion.quant_compare --report-only

Runs ``quant.convert`` (all targets) on each bundled example; the LN twins go through with
``allow_online=True``: LayerNorm stays as decomposed int8 ops in the TFLite files (MEAN,
SQUARED_DIFFERENCE, RSQRT...), and in float inside ONNX Runtime's QDQ files (its quantizer has
no integer LayerNorm). Writes ``benchmarks/results/quant_compare.json`` (the four reports) and
``quant_compare.md`` (the comparison), and a plot ``quant_compare.png``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.common.results import RESULTS, save_figure
from converters.progress import ProgressEvent
from edge_un import examples
from quant.measure.bars import DEFAULT_BARS
from quant.pipeline import convert
from quant.report import Report, TargetReport

PAIRS = (("vit-mnist-un", "vit-mnist-ln"), ("text-rt-un", "text-rt-ln"))
# UN models migrated from the LN twins (edge-un migrate): listed in the table, not in the pairs.
MIGRATED = ("vit-mnist-ln-to-un", "text-rt-ln-to-un")


def convert_all(scratch: Path, names: list[str]) -> dict[str, dict]:
    runs = {}
    for name in names:
        start = time.perf_counter()

        def progress(event: ProgressEvent, name: str = name) -> None:
            print(f"  {name} [{100 * event.fraction:3.0f}%] {event.label}", flush=True)

        report = convert(
            examples.path(name), out_dir=scratch / name, allow_online=name.endswith("-ln"),
            progress=progress,
        )  # fmt: skip
        runs[name] = {"seconds": round(time.perf_counter() - start, 1),
                      "report": json.loads(report.model_dump_json())}  # fmt: skip
    return runs


def _precision(target: TargetReport) -> str:
    if target.int16_tensors:
        return f"{len(target.int16_tensors)} tensors int16"
    if target.excluded:
        return "16x8"
    return "pure int8"


def _op_types(ops: list[str]) -> str:
    """ "BATCH_MATMUL name", ... -> "BATCH_MATMUL x8, GELU x4" (names are in the report)."""
    counts: dict[str, int] = {}
    for op in ops:
        counts[op.split()[0]] = counts.get(op.split()[0], 0) + 1
    return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in counts.items()) or "none"


def _cell(target: TargetReport | None) -> list[str]:
    if target is None or target.drift is None:
        reason = "-" if target is None else f"failed: {target.error}"
        return [reason, "", "", "", "", "", ""]
    drift = target.drift
    latency = next((t for t in target.latency if t.threads == 1), None)
    pure = target.pure_int8_drift or drift
    vela = target.vela
    return [
        f"{100 * drift.agreement:.1f} % / {drift.top1_drop_pts:.1f}",
        f"{100 * pure.agreement:.1f} %",
        _precision(target),
        f"{latency.p50_ms:.3f}" if latency else "-",
        _op_types(target.fallback_ops),
        f"{vela.npu_ops} / {len(vela.cpu_ops)}" if vela else "-",
        f"{vela.cycles:,} ({vela.est_ms:.3f} ms)" if vela else "-",
    ]


def write_markdown(runs: dict[str, dict]) -> str:
    lines = [
        "# UN vs LayerNorm, through the same int8 pipeline",
        "",
        "Made by `python -m benchmarks.conversion.quant_compare`: `quant.convert` on each bundled "
        "example,",
        f"all targets, default bars (drop <= {DEFAULT_BARS.max_drift:g} pt, agreement >= "
        f"{100 * DEFAULT_BARS.min_agreement:.0f} %). Drift on the held-out test",
        "split in each target's arithmetic (exact integer for ONNX targets, LiteRT for TFLite);",
        f"measured on {_hosts(runs)}; latency (one thread, batch 1, median of 100 runs;",
        "other jobs shared the machine, so compare within a row, not across runs). LN models",
        "keep LayerNorm: decomposed int8 ops in TFLite, float in ONNX Runtime (listed as ops",
        "off the accelerator).",
        "",
        "| model | target | shipped: agreement / drop (pt) | pure int8 agreement | precision "
        "| p50 ms (1 thread) | ops off the accelerator | Vela NPU / CPU ops | Vela cycles |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in [n for pair in PAIRS for n in pair] + list(MIGRATED):
        if name in runs:
            report = Report.model_validate(runs[name]["report"])
            for target_name, target in report.targets.items():
                lines.append(f"| {name} | {target_name} | " + " | ".join(_cell(target)) + " |")
    lines += ["", "## Where LN wins, where UN wins (read off the table above)", ""]
    lines += comparisons(runs)
    lines += ["", "Conversion wall time (all targets): " + ", ".join(
        f"{name} {run['seconds']} s" for name, run in runs.items())]  # fmt: skip
    return "\n".join(lines) + "\n"


def _hosts(runs: dict[str, dict]) -> str:
    """The machine(s) the reports name (a run from before reports named it says so)."""
    labels = {
        Report.model_validate(run["report"]).host.label()
        if run["report"].get("host")
        else "a host not recorded"
        for run in runs.values()
    }
    return " and ".join(sorted(labels))


def comparisons(runs: dict[str, dict]) -> list[str]:
    lines = []
    migrated = tuple((un, un.replace("-to-un", "")) for un in MIGRATED)
    for un, ln in PAIRS + migrated:
        if un not in runs or ln not in runs:
            continue
        a, b = (Report.model_validate(runs[n]["report"]) for n in (un, ln))
        for target in a.targets:
            ta, tb = a.targets[target], b.targets.get(target)
            if tb is None or ta.drift is None or tb.drift is None:
                continue
            pa = (ta.pure_int8_drift or ta.drift).agreement
            pb = (tb.pure_int8_drift or tb.drift).agreement
            who = "LN" if pb > pa else "UN" if pa > pb else "tie"
            line = (f"- {target}, pure int8 agreement: {un} {100 * pa:.1f} % vs {ln} "
                    f"{100 * pb:.1f} % ({who})")  # fmt: skip
            va, vb = (t.vela_pure_int8 or t.vela for t in (ta, tb))
            if va and vb:
                ratio = vb.cycles / va.cycles
                line += (f"; Vela cycles, pure int8 files: UN {va.cycles:,} vs LN "
                         f"{vb.cycles:,} (LN/UN {ratio:.2f}x)")  # fmt: skip
            la = next((t.p50_ms for t in ta.latency if t.threads == 1), None)
            lb = next((t.p50_ms for t in tb.latency if t.threads == 1), None)
            if la and lb:
                line += f"; p50 1 thread UN {la:.3f} ms vs LN {lb:.3f} ms"
            lines.append(line)
    return lines


def plot(runs: dict[str, dict]) -> None:
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, (un, ln) in zip(axes, PAIRS, strict=True):
        reports = [Report.model_validate(runs[n]["report"]) for n in (un, ln)]
        targets = list(reports[0].targets)
        width = 0.2
        for i, (report, label) in enumerate(zip(reports, ("UN", "LN"), strict=True)):
            pure = [100 * (report.targets[t].pure_int8_drift or report.targets[t].drift).agreement
                    if report.targets[t].drift else 0 for t in targets]  # fmt: skip
            shipped = [100 * report.targets[t].drift.agreement if report.targets[t].drift else 0
                       for t in targets]  # fmt: skip
            xs = [x + (2 * i - 1.5) * width for x in range(len(targets))]
            axis.bar(xs, pure, width, label=f"{label} pure int8")
            axis.bar([x + width for x in xs], shipped, width, label=f"{label} shipped")
        axis.axhline(99, color="k", linestyle="--", linewidth=0.8)
        axis.set_xticks(range(len(targets)), targets)
        axis.set_ylim(90, 100.5)
        axis.set_title(f"{un} vs {ln}: top-1 agreement with fp32 (%)")
        axis.legend(fontsize=7, loc="lower left")
    save_figure(figure, "quant_compare")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="only these bundled examples, merged into the "
                        "JSON (default: every pair and migrated model)")  # fmt: skip
    parser.add_argument("--report-only", action="store_true", help="tables and plot from the JSON")
    args = parser.parse_args()
    committed = RESULTS / "quant_compare.json"
    runs = json.loads(committed.read_text()) if committed.exists() else {}
    if not args.report_only:  # else: re-write the tables and plot from the JSON
        names = args.models or [n for pair in PAIRS for n in pair] + [
            n for n in MIGRATED if n in examples.names()
        ]
        with tempfile.TemporaryDirectory() as scratch:
            runs.update(convert_all(Path(scratch), names))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quant_compare.json").write_text(json.dumps(runs, indent=2) + "\n")
    (RESULTS / "quant_compare.md").write_text(write_markdown(runs))
    plot(runs)
    print((RESULTS / "quant_compare.md").read_text())


if __name__ == "__main__":
    main()
