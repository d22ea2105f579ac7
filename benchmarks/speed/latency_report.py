"""Markdown tables and plots for benchmarks.speed.latency, from its JSON (``--report-only``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from quant.report.summary import delegated_cell

STAGE_GROUPS = (  # (substring of the pipeline's stage name, group), first match wins
    ("import", "import"),
    ("load", "load + fold"),
    ("export", "export"),
    ("fallback", "quantize (+ drift, fallback)"),
    ("quantize", "quantize (+ drift, fallback)"),
    ("onnx2tf", "onnx2tf + TF converter"),
    ("Vela", "Vela"),
    ("drift", "drift"),
    ("SQNR", "per-tensor SQNR"),
    ("latency", "latency"),
    ("report", "report"),
    ("done", "report"),
)


def peak(result: dict[str, Any], dtype: str, key: str) -> float | None:
    """The best GMAC/s of any ``dtype`` graph at ``key`` (b1_t1, b1_t2), before or after."""
    values = [
        row[key]["gmacs"]
        for when in result.get("peaks", {}).values()
        for name, row in when.items()
        if name.startswith(dtype) and key in row
    ]
    return max(values) if values else None


def fraction(result: dict[str, Any], row: dict[str, Any], label: str, key: str) -> float | None:
    """The model's share of the peak, where both were read from the same clock (a run that
    timed the models in CPU time and the peaks in wall time has none)."""
    if result.get("clock") != result.get("peak_clock"):
        return None
    timing = row["timing"].get(key)
    threads = key.split("_t")[1]
    top = peak(result, "int8" if "int8" in label else "fp32", f"b1_t{threads}")
    if timing is None or not top:
        return None
    batch = int(key.split("_")[0][1:])
    return row["macs"] * batch / (timing["p50_ms"] * 1e6) / top


def _clock_phrase(result: dict[str, Any]) -> str:
    """Which of the probe's clocks the figures are: runs before the choice was recorded are
    wall time throughout."""
    if result.get("clock", {}).get("1") == "cpu_ms":
        return (
            "1-thread figures are the calling thread's CPU time (a 1-thread call's whole work; "
            "on a shared machine wall time also counts other jobs' time slices), 2-thread "
            "figures wall time. "
        )
    return "All figures are wall time. "


def _cell(timing: dict[str, Any] | None, field: str, fmt: str = "{:.3f}") -> str:
    return "-" if timing is None else fmt.format(timing[field])


def ratio_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    def p50(label: str, key: str = "b1_t1") -> float | None:
        timing = rows.get(label, {}).get("timing", {}).get(key)
        return None if timing is None else timing["p50_ms"]

    pairs = (
        ("UN int8 ORT vs LN fp32 torch eager", "LN fp32 torch eager", "UN int8 ORT"),
        ("UN int8 ORT vs LN int8 ORT", "LN int8 ORT", "UN int8 ORT"),
        ("UN int8 LiteRT vs LN int8 LiteRT", "LN int8 LiteRT", "UN int8 LiteRT"),
        ("UN int8 LiteRT vs UN fp32 LiteRT", "UN fp32 LiteRT", "UN int8 LiteRT"),
        ("LN int8 LiteRT vs LN fp32 LiteRT", "LN fp32 LiteRT", "LN int8 LiteRT"),
        ("UN folded fp32 ORT vs LN fp32 ORT", "LN fp32 ORT", "UN folded fp32 ORT"),
        ("UN int8 LiteRT vs LN fp32 torch eager", "LN fp32 torch eager", "UN int8 LiteRT"),
    )
    lines = []
    for text, slow, fast in pairs:
        cells = []
        for key in ("b1_t1", "b1_t2", "b32_t1", "b32_t2"):
            a, b = p50(slow, key), p50(fast, key)
            cells.append(f"{a / b:.2f}x" if a and b else "-")
        lines.append(f"| {text} | " + " | ".join(cells) + " |")
    return lines


def _host_phrase(result: dict[str, Any]) -> str:
    """The host as ``quant.host`` describes it; int8 figures from hosts with and without VNNI
    are not comparable. Runs before the host was recorded say so."""
    if "host" not in result:
        return (f"{result['machine'].get('cores')} cores ({result['machine'].get('cpu')}; "
                "CPU model and int8 features not recorded)")  # fmt: skip
    from quant.report import Host

    host = Host.model_validate(result["host"])
    return f"**{host.label()}** ({host.int8_kernels})"


def write_report(result: dict[str, Any], results: Path, stem: str = "latency") -> None:
    """``STEM.md`` and ``STEM_configs.png`` / ``STEM_stages.png`` in ``results``."""
    lines = [
        "# Latency, memory and conversion time: UN vs LayerNorm, and against this machine's limit",
        "",
        "Made by `"
        + " ".join([".venv/bin/python -m benchmarks.speed.latency", *result.get("arguments", [])])
        + "`"
        + (" (`--quick`: 2 rounds, shorter budgets)" if result.get("quick") else "")
        + f", started {result['started_utc']} UTC, {result['total_s']:.0f} s in all. Machine: "
        + _host_phrase(result)
        + ", torch "
        f"{result['machine'].get('torch')}, ONNX Runtime {result['machine'].get('onnxruntime')},"
        f" LiteRT {result['machine'].get('ai_edge_litert')}. Load average (1/5/15 min) before "
        f"{result['load_average_before']}, after the latency part "
        f"{result['load_average_after_latency']}, at the end {result['load_average_after']}: "
        "other work shared the machine.",
        "",
        "**Ratios are measured interleaved in one run**: each configuration in its own probe "
        f"process, all alive at once, round-robin over configurations for {result['rounds']} "
        "rounds (the order rotates each round), so machine drift hits all alike; compare within "
        "a table, not across runs. Latency: median (p50) and p90 of every timed call pooled over "
        "the rounds. "
        + _clock_phrase(result)
        + "Batch 32: one call with 32 samples (torch, ORT, dynamic batch) or 32 invokes "
        "of the batch-1 TFLite file (LiteRT), 1 and 2 threads; throughput = samples/s at the "
        "median. "
        "Peak RSS: the probe's own maximum resident set (imports included; the imports-only "
        "figure is in the JSON) after the batch-1 runs. int8 ORT files: `quant.ort.quantize` "
        "with the `cpu` target's settings (QDQ, per-channel s8 weights, u8 activations, MinMax; "
        "Linears as Gemm, Softmax and GELU fed in float: `ort_speed.md`), the same for LN and UN; "
        "int8 TFLite: "
        "`quant.tflite.onnx2tf.convert_tflite` (onnx2tf + TF converter, full "
        "int8, int8 I/O, every int8 BATCH_MATMUL's right operand at zero point 0 so that "
        "XNNPACK's delegate takes it: `quant.tflite.symmetric`), run by LiteRT with XNNPACK "
        "(the ops its delegate took, read from the interpreter, in the table); LiteRT fp32 is "
        "onnx2tf's fp32 file. "
        "ViT-Tiny has random weights (timing only). With other jobs on the 2 cores, every "
        "2-thread figure is contended (torch eager's OpenMP with 2 threads collapses: 1.7 s "
        "instead of ~28 ms for ViT-Tiny; measured alone it matches 1 thread); read the 1-thread "
        "columns.",
        "",
        "Fraction of peak = model MACs (MatMul/Gemm/Conv, counted on the ONNX graph) / p50 / the "
        "measured peak of the same data type and thread count (int8 configurations against the "
        "int8 peak, fp32 against fp32; LiteRT against ONNX Runtime's GEMM peak).",
    ]
    for pair, rows in result["latency"].items():
        macs = next(iter(rows.values()))["macs"]
        lines += [
            "",
            f"## {pair} ({macs / 1e6:.1f} M MACs per sample)",
            "",
            "| configuration | p50 ms 1 thr | p90 ms 1 thr | p50 ms 2 thr | p90 ms 2 thr "
            "| b32 samples/s 1 / 2 thr | peak RSS MB | file KiB | % of peak b1 / b32, 1 thr "
            "| XNNPACK took |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label, row in rows.items():
            t = row["timing"]
            f1, f32 = fraction(result, row, label, "b1_t1"), fraction(result, row, label, "b32_t1")
            cells = [
                _cell(t.get("b1_t1"), "p50_ms"),
                _cell(t.get("b1_t1"), "p90_ms"),
                _cell(t.get("b1_t2"), "p50_ms"),
                _cell(t.get("b1_t2"), "p90_ms"),
                f"{_cell(t.get('b32_t1'), 'throughput_per_s', '{:.0f}')} / "
                f"{_cell(t.get('b32_t2'), 'throughput_per_s', '{:.0f}')}",
                f"{row['peak_rss_b1_mb']:.0f}",
                f"{row['size_kib']:.0f}",
                " / ".join(f"{100 * f:.1f} %" if f else "-" for f in (f1, f32)),
                delegated_cell(row.get("xnnpack_ops")),
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "| ratio (speed-up, p50) | b1, 1 thr | b1, 2 thr | b32, 1 thr | b32, 2 thr |",
            "|---|---|---|---|---|",
            *ratio_lines(rows),
        ]
    lines += [
        "",
        "## Vela (imx93: Ethos-U65-256, both files full int8)",
        "",
        "| model | NPU / CPU ops | cycles | NPU cycles | est. ms | SRAM / DRAM KiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, art in result["artifacts"].items():
        v = art["vela"]
        lines.append(
            f"| {name} | {v['npu_ops']} / {v['cpu_ops']} | {v['cycles']:,} | "
            f"{v['npu_cycles']:,} | {v['est_ms']:.3f} | {v['sram_kib']:.0f} / "
            f"{v['dram_kib']:.0f} |"
        )
    for pair in result["latency"]:
        ln, un = (result["artifacts"].get(f"{pair}-{n}") for n in ("ln", "un"))
        if ln and un:
            lines.append(
                f"\n{pair}: LN/UN Vela cycles {ln['vela']['cycles'] / un['vela']['cycles']:.3f}x"
            )
    system = next(iter(result["artifacts"].values()))["vela"]
    lines += ["", f"System config {system['system_config']}, memory mode {system['memory_mode']}."]
    lines += [
        "",
        "## This machine's matrix-multiply peak (ONNX Runtime, 1024 x 1024 x 1024, "
        "constant weights)",
        "",
        *(
            []
            if result.get("clock") == result.get("peak_clock")
            else [
                "Wall time, unlike the models' 1-thread figures (CPU time): no share of the "
                "peak is computed from it.",
                "",
            ]
        ),
        "| graph | when | GMAC/s 1 thr | GMAC/s 2 thr |",
        "|---|---|---|---|",
    ]
    for when, graphs in result["peaks"].items():
        for name, row in graphs.items():
            cells = [f"{row[k]['gmacs']:.1f}" if k in row else "-" for k in ("b1_t1", "b1_t2")]
            lines.append(f"| {name} | {when} the models | " + " | ".join(cells) + " |")
    lines += stage_lines(result)
    lines += target_lines(result)
    if result.get("notes"):
        lines += ["", "## Notes", "", *(f"- {note}" for note in result["notes"])]
    (results / f"{stem}.md").write_text("\n".join(lines) + "\n")
    plot(result, results, stem)


def grouped(stages: list[dict[str, Any]]) -> dict[str, float]:
    groups: dict[str, float] = {}
    for stage in stages:
        group = next((g for key, g in STAGE_GROUPS if key in stage["stage"]), stage["stage"])
        groups[group] = groups.get(group, 0.0) + stage["seconds"]
    return groups


def stage_lines(result: dict[str, Any]) -> list[str]:
    stages = {n: s for n, s in result.get("stages", {}).items() if "stages" in s}
    if not result.get("stages"):  # a run without them (--no-stages)
        return []
    lines = [
        "",
        "## Conversion: `quant.pipeline.convert`, every target, one fresh process each",
        "",
        "Wall time between successive progress events, summed by kind "
        "over the four targets (cpu's `quantize` stage includes its drift run and any "
        "fallback steps). ViT-Tiny: random calibration/evaluation data, drift bars off. "
        "Peak RSS: the pipeline's own process / the largest tool subprocess (onnx2tf, TF "
        "converter, Vela) / the whole tree sampled every 0.2 s.",
        "",
    ]
    for name, s in result.get("stages", {}).items():
        if "error" in s:
            lines.append(f"- {name}: FAILED {s['error']}")
    if not stages:
        return lines
    groups = list(dict.fromkeys(g for s in stages.values() for g in grouped(s["stages"])))
    lines += ["| stage | " + " | ".join(stages) + " |", "|---|" + "---|" * len(stages)]
    for group in groups:
        cells = [f"{grouped(s['stages']).get(group, 0):.1f}" for s in stages.values()]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    lines.append(
        "| **total s** | " + " | ".join(f"**{s['total_s']:.1f}**" for s in stages.values()) + " |"
    )
    lines.append(
        "| peak RSS MB (own / tool / tree) | "
        + " | ".join(
            f"{s['peak_rss_mb']:.0f} / {s['peak_child_rss_mb']:.0f} / {s['peak_tree_rss_mb']:.0f}"
            for s in stages.values()
        )
        + " |"
    )
    lines.append(
        "| targets | "
        + " | ".join(
            ", ".join(f"{t} {v['status']}" for t, v in s["targets"].items())
            for s in stages.values()
        )
        + " |"
    )
    lines += ["", "Per target (s):", ""]
    for name, s in stages.items():
        per = per_target(s["stages"])
        lines.append(f"- {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in per.items()))
    return lines


def per_target(stages: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per target (stage names start with "<target>:"), the rest as "common"."""
    per: dict[str, float] = {}
    for stage in stages:
        target = stage["stage"].split(":")[0] if ":" in stage["stage"] else "common"
        per[target] = per.get(target, 0.0) + stage["seconds"]
    return per


# issue 9's targets on ViT-Tiny, batch 1, one thread: (what, slower config, faster config, bar,
# what stands in the way when missed: the evidence is in the files named)
SPEED_TARGETS = (
    (
        "UN int8 ORT vs LN fp32 torch eager",
        "LN fp32 torch eager",
        "UN int8 ORT",
        3.0,
        "the integer products are most of the int8 file's kernel time yet run far below the "
        "1024^3 peak at 197 rows; GELU, Transpose, Q/DQ and Softmax take the rest (ort_speed.md: "
        "op profile and measured peak)",
    ),
    (
        "UN int8 ORT vs LN int8 ORT",
        "LN int8 ORT",
        "UN int8 ORT",
        1.15,
        "in ORT the LN twin keeps LayerNormalization as one fast float kernel: UN saves only "
        "those 25 kernels and their Q/DQ (their share of the LN file's kernel time: ort_speed.md)",
    ),
    (
        "UN int8 LiteRT vs UN fp32 LiteRT",
        "UN fp32 LiteRT",
        "UN int8 LiteRT",
        1.0,
        "XNNPACK has no int8 BATCH_MATMUL: the 24 attention products run on TFLite's own int8 "
        "kernel, an order of magnitude slower than fp32 in XNNPACK (litert_kernels.md); a fully "
        "integer file cannot avoid them: per-head unrolling converts back to BATCH_MATMUL",
    ),
)


def target_lines(result: dict[str, Any]) -> list[str]:
    """Each ViT-Tiny speed target, met or missed by how much, and the pipeline time targets."""
    rows = result["latency"].get("vit-tiny")
    lines = ["", "## Targets (issue 9; ViT-Tiny, batch 1, one thread)", ""]
    if rows:
        lines += ["| target | measured | bar | | what stands in the way |", "|---|---|---|---|---|"]
        for text, slow, fast, bar, why in SPEED_TARGETS:
            a, b = (rows[label]["timing"]["b1_t1"]["p50_ms"] for label in (slow, fast))
            met = a / b >= bar
            lines.append(
                f"| {text} | {a / b:.2f}x | >= {bar:.2f}x | {'met' if met else 'missed'} | "
                f"{'' if met else why} |"
            )
        share = fraction(result, rows["UN int8 ORT"], "UN int8 ORT", "b1_t1")
        if share is not None:
            lines.append(
                f"| UN int8 ORT, share of the int8 peak | {100 * share:.1f} % | >= 60 % | "
                f"{'met' if share >= 0.6 else 'missed'} | {SPEED_TARGETS[0][4]} |"
            )
    stages = {n: s for n, s in result.get("stages", {}).items() if "stages" in s}
    examples = {n: s for n, s in stages.items() if not n.startswith("vit-tiny")}
    if examples:
        lines += ["", "Pipeline, example models (bars: one target <= 60 s, all <= 180 s):", ""]
        for name, s in examples.items():
            per = per_target(s["stages"])
            common = per.pop("common", 0.0)
            slowest = max(per, key=per.__getitem__)
            one = common + per[slowest]
            lines.append(
                f"- {name}: all targets {s['total_s']:.0f} s "
                f"({'met' if s['total_s'] <= 180 else 'missed'}); the slowest single target, "
                f"{slowest}, ~{one:.0f} s = shared steps {common:.0f} s + its own "
                f"{per[slowest]:.0f} s ({'met' if one <= 60 else 'missed'})"
            )
    return lines


def plot(result: dict[str, Any], results: Path, stem: str = "latency") -> None:
    pairs = list(result["latency"])
    figure, axes = plt.subplots(1, len(pairs), figsize=(5 * len(pairs), 4.5), squeeze=False)
    for axis, pair in zip(axes[0], pairs, strict=True):
        rows = result["latency"][pair]
        labels = list(rows)
        for offset, key in ((-0.2, "b1_t1"), (0.2, "b1_t2")):
            values = [rows[label]["timing"].get(key, {}).get("p50_ms", 0) for label in labels]
            axis.barh(
                [i + offset for i in range(len(labels))],
                values,
                0.4,
                label=f"p50, {key[-1]} thread(s)",
            )
        axis.set_yticks(range(len(labels)), labels, fontsize=8)
        axis.invert_yaxis()
        axis.set_xscale("log")  # contended 2-thread outliers would flatten the rest
        axis.set_xlabel("ms, batch 1 (log scale)")
        axis.set_title(pair)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(results / f"{stem}_configs.png", dpi=110)
    plt.close(figure)
    stages = {n: s for n, s in result.get("stages", {}).items() if "stages" in s}
    if not stages:
        return
    figure, axis = plt.subplots(figsize=(8, 1.2 + 0.7 * len(stages)))
    groups = list(dict.fromkeys(g for s in stages.values() for g in grouped(s["stages"])))
    left = [0.0] * len(stages)
    for group in groups:
        widths = [grouped(s["stages"]).get(group, 0.0) for s in stages.values()]
        axis.barh(list(stages), widths, left=left, label=group)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    axis.set_xlabel("seconds (quant.pipeline.convert, all targets)")
    axis.legend(fontsize=7, ncol=3, loc="lower right")
    figure.tight_layout()
    figure.savefig(results / f"{stem}_stages.png", dpi=110)
    plt.close(figure)
