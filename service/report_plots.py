"""The report page's plots as SVG text: worst-layer SQNR, latency, the Vela NPU/CPU op split.

Drawn on ``matplotlib.figure.Figure`` objects (not pyplot): no GUI backend, no global figure
registry, safe to call from the server's worker threads. Labels come from users' models, so
``$`` is escaped (matplotlib would parse ``$...$`` as math); the SVG backend escapes XML.
"""

from __future__ import annotations

import io
from collections import Counter

from quant.report import Report, TargetReport

LABEL_CHARS = 44
COLORS = {
    "bar": "#4a77b4",
    "own": "#d1495b",
    "p90": "#e39b2d",
    "p99": "#b3261e",
    "vela": "#2e9e5b",
    "npu": "#2e9e5b",
    "cpu": "#d1495b",
}


def _label(text: str) -> str:
    text = text if len(text) <= LABEL_CHARS else "…" + text[-(LABEL_CHARS - 1) :]
    return text.replace("$", r"\$")


def _figure(rows: int, width: float = 7.5):  # -> matplotlib.figure.Figure
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, 0.9 + 0.34 * max(rows, 1)), layout="constrained")
    return figure, figure.add_subplot()


def _svg(figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    return buffer.getvalue()


def sqnr_svg(target: TargetReport) -> str:
    """The target's worst layers: accumulated SQNR bars, each tensor's own step as a dot (a
    layer without a finite SQNR has no bar: the report's table lists it)."""
    assert target.drift is not None
    finite = [layer for layer in target.drift.worst_layers if layer.sqnr_db is not None]
    layers = sorted(finite, key=lambda layer: layer.sqnr_db or 0.0, reverse=True)
    figure, axes = _figure(len(layers))
    positions = list(range(len(layers)))
    axes.barh(
        positions,
        [layer.sqnr_db for layer in layers],
        color=COLORS["bar"],
        label="accumulated (int8 vs fp32)",
    )
    own = [
        (i, layer.own_sqnr_db) for i, layer in enumerate(layers) if layer.own_sqnr_db is not None
    ]
    if own:
        axes.plot(
            [v for _, v in own],
            [i for i, _ in own],
            "o",
            color=COLORS["own"],
            label="its own quantization step",
        )
        figure.legend(loc="outside lower center", ncols=2, fontsize=8)
    axes.set_yticks(
        positions,
        labels=[_label(f"{layer.module or layer.name} ({layer.op})") for layer in layers],
        fontsize=8,
    )
    axes.set_xlabel("SQNR (dB)")
    axes.grid(axis="x", alpha=0.3)
    return _svg(figure)


def latency_svg(report: Report) -> str | None:
    """p50 bars with p90/p99 marks per target, runtime and thread count; Vela estimates."""
    rows: list[tuple[str, float, float | None, float | None, str]] = []
    for target in report.targets.values():
        for timing in target.latency:
            rows.append(
                (
                    f"{target.name} · {timing.runtime} · {timing.threads} thr",
                    timing.p50_ms,
                    timing.p90_ms,
                    timing.p99_ms,
                    COLORS["bar"],
                )
            )
        if target.vela is not None:
            rows.append(
                (
                    f"{target.name} · Vela {target.vela.accelerator} (estimate)",
                    target.vela.est_ms,
                    None,
                    None,
                    COLORS["vela"],
                )
            )
    if not rows:
        return None
    rows.reverse()  # the first target at the top
    figure, axes = _figure(len(rows))
    positions = list(range(len(rows)))
    axes.barh(positions, [r[1] for r in rows], color=[r[4] for r in rows])
    for mark, column in (("p90", 2), ("p99", 3)):
        points = [(r[column], i) for i, r in enumerate(rows) if r[column] is not None]
        if points:
            axes.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                "|",
                markersize=14,
                markeredgewidth=2,
                color=COLORS[mark],
                label=mark,
            )
    if any(r[2] is not None for r in rows):
        figure.legend(loc="outside lower center", ncols=2, fontsize=8)
    values = [v for r in rows for v in r[1:4] if v is not None and v > 0]
    if values and max(values) / min(values) > 50:
        axes.set_xscale("log")
    axes.set_yticks(positions, labels=[_label(r[0]) for r in rows], fontsize=8)
    axes.set_xlabel("latency per sample (ms)")
    axes.grid(axis="x", alpha=0.3)
    return _svg(figure)


def vela_svg(report: Report) -> str | None:
    """Per Vela target: ops the NPU runs and ops left to the CPU (by op type)."""
    targets = [t for t in report.targets.values() if t.vela is not None]
    if not targets:
        return None
    figure, axes = _figure(len(targets), width=7.5)
    positions = list(range(len(targets)))
    npu = [t.vela.npu_ops for t in targets]  # type: ignore[union-attr]
    cpu = [len(t.vela.cpu_ops) for t in targets]  # type: ignore[union-attr]
    axes.barh(positions, npu, color=COLORS["npu"], label="NPU ops")
    axes.barh(positions, cpu, left=npu, color=COLORS["cpu"], label="CPU ops")
    for index, target in enumerate(targets):
        kinds = Counter(source.op for source in target.fallback_op_sources)  # Vela's CPU ops
        text = ", ".join(f"{kind} ×{count}" for kind, count in kinds.most_common(4)) or "none"
        axes.annotate(
            f"CPU: {text}".replace("$", r"\$"),
            (npu[index] + cpu[index], index),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    axes.set_yticks(positions, labels=[_label(t.name) for t in targets], fontsize=9)
    axes.set_xlabel("operators")
    axes.set_xlim(0, max(n + c for n, c in zip(npu, cpu, strict=True)) * 2.0 + 1)
    figure.legend(loc="outside lower center", ncols=2, fontsize=8)
    return _svg(figure)
