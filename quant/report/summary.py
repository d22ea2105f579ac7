"""``report.md`` and the terminal summary: the report for a person, from the report.json model."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from .schema import Host, Report, TargetReport, power_of_two_counts


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _pts(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} pt"


def drift_rows(report: Report) -> list[list[str]]:
    """One row per target: status, top-1 fp32 -> int8, drop, agreement, cosine, 16-bit tensors."""
    rows = []
    for target in report.targets.values():
        drift = target.drift
        if drift is None:
            rows.append([target.name, target.status, "-", "-", "-", "-", target.error or ""])
            continue
        rows.append([
            target.name,
            target.status,
            f"{_pct(drift.top1_fp32)} -> {_pct(drift.top1_int8)}",
            _pts(drift.top1_drop_pts),
            _pct(drift.agreement),
            f"{drift.cosine:.4f}",
            precision_cell(target),
        ])  # fmt: skip
    return rows


def precision_cell(target: TargetReport) -> str:
    """What the shipped file keeps wider than int8: some tensors, every activation, or none."""
    if target.int16_tensors:
        return f"{len(target.int16_tensors)} tensors int16"
    if any(step.action.startswith("16-bit activations") for step in target.excluded):
        return "16x8 (int16 activations)"
    return "pure int8"


LATENCY_HEADERS = ["target", "runtime", "artifact", "threads", "p50 ms", "p90 ms", "p99 ms",
                   "XNNPACK took"]  # fmt: skip


def delegated_cell(counts: Mapping[str, Sequence[int]] | None) -> str:
    """The ops XNNPACK's delegate took of a TFLite file's ops, and of its BATCH_MATMULs (the
    attention products, which it takes only with a symmetric right operand); ``-`` elsewhere."""
    if not counts:
        return "-"
    total, taken = (sum(pair[i] for pair in counts.values()) for i in (0, 1))
    cell = f"{taken} / {total}"
    if "BATCH_MATMUL" in counts:
        cell += " (BATCH_MATMUL {1} / {0})".format(*counts["BATCH_MATMUL"])
    return cell


def latency_rows(report: Report) -> list[list[str]]:
    """One row a target, runtime and thread count (``LATENCY_HEADERS``), and Vela's estimate."""
    rows = []
    for target in report.targets.values():
        for timing in target.latency:
            rows.append([
                target.name, timing.runtime, timing.artifact, str(timing.threads),
                f"{timing.p50_ms:.3f}", f"{timing.p90_ms:.3f}", f"{timing.p99_ms:.3f}",
                delegated_cell(timing.xnnpack_ops),
            ])  # fmt: skip
        if target.vela is not None:
            vela = target.vela
            rows.append([
                target.name, f"Vela ({vela.accelerator})", vela.system_config, "NPU",
                f"{vela.est_ms:.3f}", "-", "-", "-",
            ])  # fmt: skip
    return rows


WORST_LAYER_HEADERS = ["module", "tensor", "op", "SQNR dB", "own SQNR dB"]


def _db(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def worst_layer_rows(target: TargetReport) -> list[list[str]]:
    """The target's worst layers, each with the module of the user's model it belongs to
    (``-`` when the model file records none) beside the artifact graph's own tensor name."""
    if target.drift is None:
        return []
    return [
        [
            layer.module or "-",
            layer.name,
            layer.op,
            _db(layer.sqnr_db),
            _db(layer.own_sqnr_db),
        ]
        for layer in target.drift.worst_layers
    ]


def fallback_op_lines(target: TargetReport) -> list[str]:
    """Each op left off the accelerator: ``SOFTMAX in blocks.0.attn.softmax (tensor ...)``;
    the bare op names of a report without ``fallback_op_sources`` (written before them)."""
    if not target.fallback_op_sources:
        return list(target.fallback_ops)
    return [
        f"{op.op} in {op.module or '(no module recorded)'} ({op.name})"
        for op in target.fallback_op_sources
    ]


def norms_line(report: Report) -> str:
    """``9 offline norms, all folded into the weights`` / ``5 offline norms: 1 folded, 4
    kept as one per-channel Mul + Add ...; WARNING: ...``: what folding did, in one line, and the
    fold's warnings, which name what stayed in the graph (a report written before them names
    the kept norms here)."""
    norms = report.fold.get("norms", [])
    warnings = report.fold.get("warnings")
    kept = [n["name"] for n in norms if n["action"] == "scale_shift"]
    line = f"{len(norms)} offline norms"
    if not kept:
        line += ", all folded into the weights" if norms else ""
    else:
        line += (
            f": {len(norms) - len(kept)} folded into the weights, {len(kept)} kept as one "
            "per-channel Mul + Add, integer on every target"
        )
        if warnings is None:
            line += f" ({', '.join(kept)})"
    if not report.fold.get("fully_integer", True):
        line += "; online norms left: NOT fully integer"
    return line + "".join(f"; WARNING: {warning}" for warning in warnings or [])


def inputs_line(target: TargetReport) -> str:
    """What the shipped file takes: ``pixel_values int8 [28, 28, 1] (scale 0.0078, zero point
    -128)``, ``input_ids int64 [48]``, ..."""
    parts = []
    for value in target.inputs:
        quantized = (
            f" (scale {value.scale:.4g}, zero point {value.zero_point})"
            if value.scale is not None
            else ""
        )
        parts.append(f"{value.name} {value.dtype} {value.shape}{quantized}")
    return "; ".join(parts)


def matmul_operands_line(target: TargetReport) -> str | None:
    """What the int8 TFLite file changed so that XNNPACK runs its BATCH_MATMULs (or why not)."""
    done = [group for group in target.matmul_operands if group.new_scale is not None]
    left = [group for group in target.matmul_operands if group.new_scale is None]
    parts = []
    if done:
        kinds = Counter(group.producer for group in done)
        producers = ", ".join(f"{op} x{count}" for op, count in sorted(kinds.items()))
        zero_points = ", ".join(str(zp) for zp in sorted({group.zero_point for group in done}))
        step = max(group.new_scale / group.scale - 1 for group in done if group.new_scale)
        parts.append(
            f"the right operands of {sum(group.matmuls for group in done)} int8 BATCH_MATMULs "
            f"made symmetric by the ops that compute them ({producers}; zero points "
            f"{zero_points} -> 0, int8 step up to {100 * step:+.1f} %), so that LiteRT's "
            "XNNPACK runs them"
        )
    if left:
        reasons = "; ".join(f"`{group.tensor}`: {group.reason}" for group in left)
        parts.append(
            f"{sum(group.matmuls for group in left)} BATCH_MATMULs keep an asymmetric right "
            f"operand and run on TFLite's reference kernel ({reasons})"
        )
    return "; ".join(parts) or None


def route_line(target: TargetReport) -> str | None:
    """Which converter made a TFLite target's files, why, and how long its two steps took."""
    route = target.tflite_route
    if route is None:
        return None
    steps = [
        f"{what} {seconds:.0f} s"
        for what, seconds in (("to float", route.convert_s), ("to int8", route.quantize_s))
        if seconds is not None
    ]
    timing = f" ({', '.join(steps)})" if steps else ""
    return f"TFLite route: {route.name}{timing}: {route.reason}"


def power_of_two_line(target: TargetReport) -> str | None:
    """A power-of-two target's scales in one line: which way they were rounded, and each
    residual stream's factor (``quant.ort.pow2.grid``)."""
    scales = target.power_of_two_scales
    if not scales:
        return None
    parts = []
    counts = power_of_two_counts(scales)
    for kind, unit in (("activation", "activations"), ("weight", "weight channels")):
        up, down, further = counts[kind]
        parts.append(
            f"{unit} {up} rounded up / {down} down"
            + (f" ({further} of them by two powers of two or more)" if further else "")
        )
    for found in target.stream_factors:
        parts.append(
            f"residual stream `{found.stream}` ({found.tensors} tensors) x{found.factor:.3f} "
            f"(calibration logits' MSE {found.logits_mse_at_one:.4g} at 1, "
            f"{found.logits_mse:.4g} chosen)"
        )
    return "power-of-two scales: " + "; ".join(parts)


def latency_notes(report: Report) -> list[str]:
    """What a person reading the latency table should know: which figures were timed while
    other work kept the host busy (``Latency.contended``), even when timed again once the
    builds were done (``quant.quiet_latency``), and so are slower than the file."""
    contended = [
        f"{target.name} ({timing.runtime}, {timing.artifact}, {timing.threads} thread"
        f"{'s' * (timing.threads > 1)}): {timing.others_busy_cores:.1f}"
        for target in report.targets.values()
        for timing in target.latency
        if timing.contended()
    ]
    if not contended:
        return []
    return [
        "timed while other work (other jobs, other programs; or other targets' builds, where "
        "the job had no time left to time them again after) kept this many of the host's cores "
        f"busy: {'; '.join(contended)}. These figures are slower than the file is on a quiet host"
    ]


def latency_title(report: Report) -> str:
    """Where the latency was measured: int8 speed differs by CPU (VNNI or not, Arm dot product)."""
    where = report.host.label() if report.host is not None else "this machine"
    return f"Latency, measured on {where}; Vela: estimated on the NPU"


def host_kernel_lines(report: Report) -> list[str]:
    """For each target also measured on the host's own int8 kernels: that figure, and any gap
    to the target's (exact) figure that a user should know about."""
    lines = []
    for target in report.targets.values():
        host = target.host_drift
        if host is not None:
            lines.append(
                f"{target.name} on this host's ONNX Runtime int8 kernels: agreement "
                f"{_pct(host.agreement)}, drop {_pts(host.top1_drop_pts)}"
            )
        lines += [f"{target.name}: {warning}" for warning in target.warnings]
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def summary_markdown(report: Report) -> str:
    ref = report.reference
    lines = [
        f"# edge-un conversion: {report.model.name}",
        "",
        f"- fp32 top-1 {_pct(ref.top1_fp32)} on {ref.samples} samples ({ref.eval_source}); "
        f"calibrated on {ref.calibration_samples} ({ref.calibration_source})",
        f"- bars: top-1 drop <= {report.max_drift_pts} pt and agreement >= "
        f"{100 * report.min_agreement:.0f} %",
        f"- norms: {norms_line(report)}",
        "",
        "## Drift (int8 vs fp32, held-out data, in each target's arithmetic)",
        "",
    ]
    lines += _table(
        ["target", "status", "top-1 fp32 -> int8", "drop", "agreement", "cosine", "precision"],
        drift_rows(report),
    )
    extra = host_kernel_lines(report)
    lines += ([""] + [f"- {line}" for line in extra]) if extra else []
    lines += ["", f"## {latency_title(report)}", ""]
    lines += _table(LATENCY_HEADERS, latency_rows(report))
    slowed = latency_notes(report)
    lines += ([""] + [f"- {line}" for line in slowed]) if slowed else []
    users = _artifact_users(report)
    for target in report.targets.values():
        lines += ["", f"## {target.name}: {target.board}", ""]
        lines += [f"- runtime: {target.runtime}; rules: {'; '.join(target.rules)}"]
        if target.error:
            lines.append(f"- FAILED: {target.error}")
        if route := route_line(target):
            lines.append(f"- {route}")
        if target.inputs:
            lines.append(f"- takes (batch 1 shown without its batch axis): {inputs_line(target)}")
        for item in target.artifacts:
            if users[item.name][0] != target.name:
                continue  # listed once, under the first target that uses it
            shared = [name for name in users[item.name] if name != target.name]
            also = f" (also {', '.join(shared)}'s)" if shared else ""
            lines.append(f"- `{item.name}` ({item.bytes:,} bytes, sha256 {item.sha256[:12]}...): "
                         f"{item.description}{also}")  # fmt: skip
        if target.drift and target.drift.worst_layers:
            worst = ", ".join(
                f"{layer.module + ' ' if layer.module else ''}`{layer.name}` ({layer.op}, "
                f"{_db(layer.sqnr_db)} dB)"
                for layer in target.drift.worst_layers
            )
            lines.append(f"- worst layers (SQNR vs fp32): {worst}")
        if target.pure_int8_drift is not None:
            pure = target.pure_int8_drift
            lines.append(f"- pure int8 before the fallback: drop {_pts(pure.top1_drop_pts)}, "
                         f"agreement {_pct(pure.agreement)}")  # fmt: skip
        for step in target.excluded:
            cost = f"; cost: {step.est_cost}" if step.est_cost else ""
            lines.append(
                f"- fallback step {step.step}: {step.action} -> drop "
                f"{_pts(step.top1_drop_pts)}, agreement {_pct(step.agreement)}{cost}"
            )
        if target.fallback_ops:
            lines.append(f"- ops off the accelerator: {'; '.join(fallback_op_lines(target))}")
        if operands := matmul_operands_line(target):
            lines.append(f"- {operands}")
        if power_of_two := power_of_two_line(target):
            lines.append(f"- {power_of_two}")
        if target.vela is not None:
            vela = target.vela
            lines.append(
                f"- Vela {vela.accelerator}, {vela.system_config} / {vela.memory_mode}: "
                f"{vela.npu_ops} ops on the NPU, {len(vela.cpu_ops)} on the CPU"
                f"{' (' + ', '.join(vela.cpu_ops) + ')' if vela.cpu_ops else ''}; "
                f"{vela.cycles:,} cycles, {vela.est_ms:.3f} ms, SRAM {vela.sram_kib:.1f} KiB, "
                f"DRAM {vela.dram_kib:.1f} KiB"
            )
        if target.vela_pure_int8 is not None:
            pure_vela = target.vela_pure_int8
            lines.append(f"- Vela, pure int8 file: {pure_vela.cycles:,} cycles, "
                         f"{pure_vela.est_ms:.3f} ms")  # fmt: skip
    lines += [""] + [f"- note: {note}" for note in report.notes]
    if report.host is not None:
        lines += ["", "## Host", "", *host_markdown(report.host)]
    return "\n".join(lines) + "\n"


def _artifact_users(report: Report) -> dict[str, list[str]]:
    """Each artifact's name -> the targets that list it, in report order (an fp32 file two
    targets share, e.g. imx93's and imx8mp's opset-20 batch-1 export, is one file)."""
    users: dict[str, list[str]] = {}
    for target in report.targets.values():
        for item in target.artifacts:
            users.setdefault(item.name, []).append(target.name)
    return users


def host_markdown(host: Host) -> list[str]:
    versions = ", ".join(f"{name} {version}" for name, version in host.versions.items())
    return [
        f"- {host.label()}, {host.machine}, {host.os}",
        f"- int8 kernels: {host.int8_kernels}",
        f"- versions: {versions}",
    ]
