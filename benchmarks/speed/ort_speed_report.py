"""The Markdown table, the plot and the goals of ``benchmarks.speed.ort_speed``'s results."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.common.results import save_figure

MATRIX_KERNELS = ("QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "QLinearConv", "MatMulInteger")
SETTING_KEYS = ("b1_t1", "b1_t2", "b8_t1", "b8_t2")
EAGER, FP32, INT8 = "LN fp32 torch eager", "UN folded fp32 ORT", "UN int8 ORT, cpu file"
TOP_OPS = 12


def markdown(result: dict[str, Any]) -> str:
    steps = result["steps"]
    lines = [
        "# The cpu target's int8 recipe for ONNX Runtime, change by change",
        "",
        f"Made by `.venv/bin/python -m benchmarks.speed.ort_speed`, {result['started_utc']} UTC, "
        f"{result['total_s']:.0f} s, on **{result['host']}**; ONNX Runtime "
        f"{result['onnxruntime']}; load average before {result['load_average_before']}, after "
        f"{result['load_average_after']} (other work shared the 2 cores). Batch 1, one thread, "
        f"p50 of {result['rounds']} interleaved rounds x {result['calls']} calls of the calling "
        "thread's CPU time (a 1-thread call's whole work; on a shared machine wall time also "
        "counts other jobs' time slices: its p50 is in the JSON). Steps are "
        "cumulative; the last one is the cpu target's profile (step 3 is the cpu file before "
        "issue 32's levers). Predicted = estimated before measuring (from the op profile of "
        "the step before; the attention products from their kernels timed alone); measured = "
        "change of p50 vs the step before, in % of step 0. Drift: top-1 agreement with the fp32 "
        "ONNX on the held-out test split and the top-1 drop in points, in the file's exact "
        "arithmetic (the drift bars, agreement >= 99 % and drop <= 0.5 pt, act on it) and on "
        "this host's int8 kernels.",
        "",
        "| step | predicted | why |",
        "|---|---|---|",
    ]
    for step in steps:
        predicted = "-" if step["predicted_pct"] is None else f"{step['predicted_pct']:+.1f} %"
        lines.append(f"| {step['name']} | {predicted} | {step['why']} |")
    lines += ["", "## Where ViT-Tiny UN stands", "", *result["summary"]]
    for name, model in result["models"].items():
        lines += model_table(name, model)
    lines += kernel_table(result["kernels"])
    lines += threads_tables(result["threads_and_batch"])
    return "\n".join(lines) + "\n"


def kernel_table(kernels: dict[str, Any]) -> list[str]:
    """What ORT made of each integer product of ViT-Tiny UN (its optimized graph), by the type
    of the right operand: u8 x s8 (VNNI, or VPMADDUBSW without it) or U8U8 (16-bit products)."""
    lines = [
        "",
        "## What each integer product runs on (ViT-Tiny UN, ONNX Runtime's optimized graph)",
        "",
        "Kernel x type of its right operand (weights, K^T, V); QEMU's Haswell model (AVX2, no "
        "VNNI) shows what a host without VNNI runs, not how fast.",
        "",
        "| file | graph made on | integer kernels |",
        "|---|---|---|",
    ]
    for step, hosts in kernels.items():
        for host, counts in hosts.items():
            listed = ", ".join(f"{count} {kernel}" for kernel, count in counts.items())
            lines.append(f"| {step} | {host} | {listed} |")
    return lines


def model_table(name: str, model: dict[str, Any]) -> list[str]:
    first = model["steps"][0]["latency"]["p50_ms"]
    lines = [
        "",
        f"## {name} ({model['macs'] / 1e6:.1f} M MACs; fp32 ORT "
        f"{model['fp32_latency']['p50_ms']:.3f} ms)",
        "",
        "| step | p50 ms | p90 ms | measured vs step before | vs step 0 | agreement exact | "
        "drop pt exact | agreement host | bars |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    previous = first
    for record in model["steps"]:
        p50 = record["latency"]["p50_ms"]
        lines.append(
            f"| {record['step']} | {p50:.3f} | {record['latency']['p90_ms']:.3f} | "
            f"{100 * (p50 - previous) / first:+.1f} % | {first / p50:.2f}x | {drift_cells(record)}"
        )
        previous = p50
    for record in model.get("alternatives", []):
        p50 = record["latency"]["p50_ms"]
        base = model["steps"][record["base"]]["latency"]["p50_ms"]
        lines.append(
            f"| not taken: {record['step']} (on step {record['base']}) | {p50:.3f} | "
            f"{record['latency']['p90_ms']:.3f} | {100 * (p50 - base) / first:+.1f} % vs step "
            f"{record['base']} | {first / p50:.2f}x | {drift_cells(record)}"
        )
    if "op_profile" in model:
        lines += ["", "Kernel time by op type (ORT profiler, ms per inference, inflated by "
                  "the profiler; top 10):", ""]  # fmt: skip
        for key, ops in model["op_profile"].items():
            lines.append(f"- {key}: {op_line(ops, 10)}")
    return lines


def drift_cells(record: dict[str, Any]) -> str:
    drift = record.get("drift")
    if not drift:
        return "- | - | - | - |"
    exact, host = drift["exact"], drift["host"]
    drop = exact["top1_drop_pts"]
    return (
        f"{100 * exact['agreement']:.2f} % | {'-' if drop is None else f'{drop:.2f}'} | "
        f"{100 * host['agreement']:.2f} % | {'hold' if drift['within_bars'] else 'MISSED'} |"
    )


def op_line(ops: dict[str, float], top: int) -> str:
    total = sum(ops.values())
    shares = ", ".join(
        f"{op} {ms:.2f} ({100 * ms / total:.0f} %)" for op, ms in list(ops.items())[:top]
    )
    return f"total {total:.2f} ms: {shares}"


def threads_tables(data: dict[str, Any]) -> list[str]:
    timings = data["timings"]
    lines = [
        "",
        "## Threads and batch (ViT-Tiny, p50 ms, each configuration in its own process, "
        "round-robin; 1 thread: the calling thread's CPU time, 2 threads: wall time, which "
        "counts whatever else ran on the 2 cores)",
        "",
        "| configuration | b1, 1 thr | b1, 2 thr | b8, 1 thr | b8, 2 thr | 2-thread speed-up "
        "b1 / b8 |",
        "|---|---|---|---|---|---|",
    ]
    for label, per in timings.items():
        cells = " | ".join(f"{per[key]['p50_ms']:.2f}" for key in SETTING_KEYS)
        b1 = per["b1_t1"]["p50_ms"] / per["b1_t2"]["p50_ms"]
        b8 = per["b8_t1"]["p50_ms"] / per["b8_t2"]["p50_ms"]
        lines.append(f"| {label} | {cells} | {b1:.2f}x / {b8:.2f}x |")
    lines += ["", "| speed-up (p50) | b1, 1 thr | b1, 2 thr | b8, 1 thr | b8, 2 thr |",
              "|---|---|---|---|---|"]  # fmt: skip
    for label in timings:
        if "int8" not in label:
            continue
        for base in (FP32, EAGER):
            ratios = " | ".join(f"{ratio(timings, base, label, key):.2f}x" for key in SETTING_KEYS)
            lines.append(f"| {label} vs {base} | {ratios} |")
    lines += ["", "Kernel time by op type at 1 and 2 threads (ORT profiler, ms per inference; "
              "speed-up = 1 thread / 2 threads; pool = the share of the op's nodes that handed "
              "work to ORT's thread pool at 2 threads, which the machine's load does not "
              "change; the int8 file's largest ops):", ""]  # fmt: skip
    profiles, pool = data["op_profiles"], data["thread_pool_share"]
    for batch in ("b1", "b8"):
        lines += [
            f"| op, {batch} | fp32 1 thr | fp32 2 thr | speed-up | pool | int8 1 thr | "
            "int8 2 thr | speed-up | pool |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        fp32 = (profiles[FP32][f"{batch}_t1"], profiles[FP32][f"{batch}_t2"])
        int8 = (profiles[INT8][f"{batch}_t1"], profiles[INT8][f"{batch}_t2"])
        shares = (pool[FP32][f"{batch}_t2"], pool[INT8][f"{batch}_t2"])
        for op in [*list(int8[0])[:TOP_OPS], "total"]:
            cells = [
                f"{op_cells(times, op)} | {share_cell(share, op)}"
                for times, share in zip((fp32, int8), shares, strict=True)
            ]
            lines.append(f"| {op} | {' | '.join(cells)} |")
        lines.append("")
    return lines


def share_cell(shares: dict[str, float], op: str) -> str:
    return "-" if op not in shares else f"{100 * shares[op]:.0f} %"


def op_cells(pair: tuple[dict[str, float], dict[str, float]], op: str) -> str:
    one, two = (sum(p.values()) if op == "total" else p.get(op) for p in pair)
    if not one or not two:
        return "- | - | -"
    return f"{one:.2f} | {two:.2f} | {one / two:.2f}x"


def ratio(timings: dict[str, Any], base: str, label: str, key: str) -> float:
    return timings[base][key]["p50_ms"] / timings[label][key]["p50_ms"]


def summary(result: dict[str, Any]) -> list[str]:
    """The issue's ViT-Tiny goals against this run, and what the profile says is left."""
    un, ln = result["models"]["vit-tiny-un"], result["models"]["vit-tiny-ln"]
    threads = result["threads_and_batch"]
    timings = threads["timings"]
    un_ms, ln_ms = (m["steps"][-1]["latency"]["p50_ms"] for m in (un, ln))
    fp32_ms = un["fp32_latency"]["p50_ms"]
    peak = max(p["t1"] for p in result["int8_peak_gmacs"].values())
    achieved = un["macs"] / (un_ms / 1e3) / 1e9
    ops = un["op_profile"][f"step{len(un['steps']) - 1}"]
    products = sum(ms for op, ms in ops.items() if op in MATRIX_KERNELS)
    vnni = "VNNI" in result["host"] and "no VNNI" not in result["host"]
    eager_goal = 3.0 if vnni else 2.0
    goals = [
        ("UN int8 vs LN fp32 torch eager, b1, 1 thr", ratio(timings, EAGER, INT8, "b1_t1"),
         eager_goal),
        ("UN int8 vs its fp32 ORT twin, b1, 1 thr", ratio(timings, FP32, INT8, "b1_t1"), 1.8),
        ("UN int8 vs its fp32 ORT twin, b1, 2 thr", ratio(timings, FP32, INT8, "b1_t2"), 1.3),
        ("UN int8 vs its fp32 ORT twin, b8, 1 thr", ratio(timings, FP32, INT8, "b8_t1"), 1.3),
        ("UN int8 vs its fp32 ORT twin, b8, 2 thr", ratio(timings, FP32, INT8, "b8_t2"), 1.3),
    ]  # fmt: skip
    lines = [
        f"Host: {result['host']}: the eager goal is {eager_goal:.1f}x "
        f"({'with' if vnni else 'without'} VNNI). Ratios from the threads-and-batch run "
        "(probe processes, round-robin, the same run).",
        "",
        "| goal | measured | target | |",
        "|---|---|---|---|",
    ]
    for label, measured, target in goals:
        lines.append(
            f"| {label} | {measured:.2f}x | >= {target:.1f}x | "
            f"{'met' if measured >= target else 'missed'} |"
        )
    share = 100 * achieved / peak
    lines += [
        f"| share of this host's int8 GEMM peak ({peak:.0f} GMAC/s, 1024^3, 1 thr), b1 | "
        f"{share:.1f} % | >= 30 % | {'met' if share >= 30 else 'missed'} |",
        "",
        f"- In-process rounds, b1, 1 thr: UN int8 {un_ms:.2f} ms, its fp32 twin {fp32_ms:.2f} ms "
        f"({fp32_ms / un_ms:.2f}x); LN int8 through the same recipe {ln_ms:.2f} ms "
        f"({ln_ms / un_ms:.2f}x UN; issue 9's target 1.15x).",
        f"- {achieved:.0f} GMAC/s for the whole model. The integer matrix products take "
        f"{100 * products / sum(ops.values()):.0f} % of the profiled kernel time and run at "
        f"{un['macs'] / (products / 1e3) / 1e9:.0f} GMAC/s there "
        f"({100 * un['macs'] / (products / 1e3) / 1e9 / peak:.0f} % of the peak; the profiler "
        "inflates kernel times a little). The rest: "
        + ", ".join(
            f"{op} {100 * ms / sum(ops.values()):.0f} %"
            for op, ms in list(ops.items())[:8]
            if op not in MATRIX_KERNELS
        )
        + ".",
        *scaling_lines(threads),
    ]
    return lines


def scaling_lines(threads: dict[str, Any]) -> list[str]:
    """Per batch: each file's 2-thread speed-up of kernel time, and its serial share: the
    1-thread kernel time of the op types whose nodes mostly did not use ORT's thread pool at 2
    threads (Amdahl: at most 1 / (s + (1 - s) / n) with n threads)."""
    profiles, pool = threads["op_profiles"], threads["thread_pool_share"]
    lines = []
    for batch in ("b1", "b8"):
        parts = []
        for label, name in ((FP32, "fp32"), (INT8, "int8")):
            one, two = (profiles[label][f"{batch}_t{t}"] for t in (1, 2))
            shares = pool[label][f"{batch}_t2"]
            serial = [op for op in one if shares.get(op, 0.0) < 0.5]
            fraction = sum(one[op] for op in serial) / sum(one.values())
            top = sorted(serial, key=lambda op: -one[op])[:4]
            parts.append(
                f"{name} {sum(one.values()) / sum(two.values()):.2f}x, serial share "
                f"{100 * fraction:.0f} % ({', '.join(f'{op} {one[op]:.2f} ms' for op in top)}; "
                f"Amdahl bound {1 / (fraction + (1 - fraction) / 2):.2f}x at 2 threads, "
                f"{1 / (fraction + (1 - fraction) / 16):.1f}x at 16)"
            )
        lines.append(f"- {batch}, kernel time 1 -> 2 threads: " + "; ".join(parts) + ".")
    return lines


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    names = [n for n in result["models"] if n.startswith("vit-tiny")]
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [s["latency"]["p50_ms"] for s in result["models"][name]["steps"]]
        left.bar(np.arange(len(steps)) + i * width, values, width, label=name)
    left.set_xticks(np.arange(len(steps)) + width * (len(names) - 1) / 2)
    left.set_xticklabels([str(i) for i in range(len(steps))])
    left.set_xlabel("step (see ort_speed.md)")
    left.set_ylabel("p50 ms, batch 1, 1 thread")
    left.set_title("ViT-Tiny int8 in ONNX Runtime, step by step")
    left.legend()
    timings = result["threads_and_batch"]["timings"]
    labels = [label for label in timings if label != EAGER]
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        speedups = [ratio(timings, EAGER, label, key) for key in SETTING_KEYS]
        right.bar(np.arange(len(SETTING_KEYS)) + i * width, speedups, width, label=label)
    right.set_xticks(np.arange(len(SETTING_KEYS)) + width * (len(labels) - 1) / 2)
    right.set_xticklabels(SETTING_KEYS)
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_ylabel("speed-up vs LN fp32 torch eager")
    right.set_title("ViT-Tiny, batch and threads")
    right.legend(fontsize=8)
    save_figure(figure, "ort_speed")
