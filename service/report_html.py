"""A conversion report as one self-contained HTML page: tables and inline SVG plots.

The page loads nothing (no CDN, no script, no font or image from anywhere; its own
Content-Security-Policy says so), so it reads the same offline or saved to disk. Plots are drawn
with matplotlib's ``Figure`` directly (no pyplot, no GUI backend, no global state) and inlined as
SVG. Every string that came from a report is escaped: model, layer and artifact names come from
users' files.
"""

from __future__ import annotations

import html
import importlib.util
import re
from collections.abc import Iterable
from pathlib import Path

from quant.report import REPORT_FILE, Host, Report, TargetReport
from quant.report.summary import (
    LATENCY_HEADERS,
    WORST_LAYER_HEADERS,
    drift_rows,
    fallback_op_lines,
    host_kernel_lines,
    inputs_line,
    latency_notes,
    latency_rows,
    latency_title,
    matmul_operands_line,
    norms_line,
    route_line,
    worst_layer_rows,
)

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
STATUS_TEXT = {"ok": "ok", "over_bar": "over the bar", "failed": "failed"}
CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2330;
background:#f6f7f9}main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:1.6em;margin:0 0 4px}
h2{margin-top:1.8em;border-bottom:1px solid #d6dae1;padding-bottom:4px}h3{margin-bottom:.3em}
table{border-collapse:collapse;margin:8px 0 16px;background:#fff;font-size:.92em}
th,td{border:1px solid #d6dae1;padding:4px 9px;text-align:left;vertical-align:top;
overflow-wrap:anywhere}
th{background:#eef0f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.status-ok{color:#0a7a2f;font-weight:600}.status-over_bar{color:#a35a00;font-weight:600}
.status-failed{color:#b3261e;font-weight:600}.error{color:#b3261e}
figure{margin:12px 0 20px;background:#fff;border:1px solid #d6dae1;padding:8px}
figure svg{max-width:100%;height:auto;display:block}figcaption{font-size:.9em;color:#555}
dl{display:grid;grid-template-columns:max-content auto;gap:2px 14px}dt{font-weight:600}dd{margin:0}
code{font-size:.9em;word-break:break-all}.muted{color:#666}
"""


def escape(value: object) -> str:
    """Escaped for text and attribute values: names come from users' files."""
    return html.escape(str(value), quote=True)


REPORT_HTML = "report.html"


def write_report_html(out_dir: Path) -> Path:
    """``out_dir/report.html`` from ``out_dir/report.json``: the page the service serves, which
    renders the file too (not the report in memory: JSON has no infinity, an SQNR of inf is
    written as null)."""
    path = out_dir / REPORT_HTML
    path.write_text(report_page(out_dir / REPORT_FILE), encoding="utf-8")
    return path


def report_page(report_json: Path) -> str:
    """The page for the report.json at ``report_json``."""
    return render_report_html(Report.read(report_json))


def render_report_html(report: Report) -> str:
    """The whole page for ``report``: summary, drift and latency tables, plots, failures."""
    title = f"edge-un conversion: {report.model.name}"
    slowed = latency_notes(report)
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="muted">edge-un {escape(report.edge_un_version)}, report schema '
        f"{escape(report.schema_version)}</p>",
        _summary(report),
        "<h2>Drift (int8 vs fp32, held-out data, in each target's arithmetic)</h2>",
        _table(
            ["target", "status", "top-1 fp32 → int8", "drop", "agreement", "cosine", "precision"],
            drift_rows(report),
            "drift",
            status_column=1,
        ),
        _list(host_kernel_lines(report)) if host_kernel_lines(report) else "",
        "<h2>Latency</h2>",
        f'<p class="muted" id="latency-host">{escape(latency_title(report))}; batch 1.</p>',
        _table(
            LATENCY_HEADERS,
            latency_rows(report),
            "latency",
            numeric=(3, 4, 5, 6),
        ),
        _list(slowed) if slowed else "",
        _failures(report),
        "<h2>Plots</h2>",
        *_plots(report),
        "<h2>Targets</h2>",
        *(_target_details(target) for target in report.targets.values()),
    ]
    if report.notes:
        body += ["<h2>Notes</h2>", _list(report.notes)]
    if report.host is not None:
        body += ["<h2>Host</h2>", _host(report.host)]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>"
        f"<body><main>{''.join(body)}</main></body></html>\n"
    )


def _summary(report: Report) -> str:
    model, ref = report.model, report.reference
    top1 = "-" if ref.top1_fp32 is None else f"{100 * ref.top1_fp32:.2f} %"
    parameters = "-" if model.parameters is None else f"{model.parameters:,}"
    items = [
        ("model", model.name),
        ("source format", model.source_format),
        ("parameters", parameters),
        ("input", f"{list(model.input_shape)} {model.input_dtype} (one sample)"),
        ("fp32 top-1", f"{top1} on {ref.samples:,} samples ({ref.eval_source})"),
        ("calibration", f"{ref.calibration_samples:,} samples ({ref.calibration_source})"),
        (
            "bars",
            f"top-1 drop ≤ {report.max_drift_pts} pt, agreement ≥ "
            f"{100 * report.min_agreement:.0f} %",
        ),
        ("norms", norms_line(report)),
    ]
    rows = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in items)
    return f'<dl id="summary">{rows}</dl>'


def _host(host: Host) -> str:
    items = [
        ("CPU", host.label()),
        ("machine", f"{host.machine}, {host.os}"),
        ("int8 kernels", host.int8_kernels),
        *((name, version) for name, version in host.versions.items()),
    ]
    rows = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in items)
    return f'<dl id="host">{rows}</dl>'


def _table(
    header: list[str],
    rows: list[list[str]],
    name: str,
    *,
    status_column: int | None = None,
    numeric: Iterable[int] = (),
) -> str:
    numeric = set(numeric)
    head = "".join(f'<th scope="col">{escape(h)}</th>' for h in header)
    lines = []
    for row in rows:
        cells = []
        for index, cell in enumerate(row):
            if index == status_column:
                text = STATUS_TEXT.get(cell, cell)
                cells.append(f'<td class="status-{escape(cell)}">{escape(text)}</td>')
            else:
                cells.append(
                    f'<td class="num">{escape(cell)}</td>'
                    if index in numeric
                    else f"<td>{escape(cell)}</td>"
                )
        lines.append(f"<tr>{''.join(cells)}</tr>")
    if not lines:
        lines.append(f'<tr><td colspan="{len(header)}" class="muted">none</td></tr>')
    return (
        f'<table id="{name}-table"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(lines)}</tbody></table>"
    )


def _failures(report: Report) -> str:
    failed = [t for t in report.targets.values() if t.status == "failed"]
    if not failed:
        return ""
    items = "".join(
        f'<li><strong>{escape(t.name)}</strong> ({escape(t.board)}): <span class="error">'
        f"{escape(t.error or 'failed without a message')}</span></li>"
        for t in failed
    )
    return f'<h2>Failed targets</h2><ul id="failed-targets">{items}</ul>'


def _list(items: Iterable[str]) -> str:
    return "<ul>" + "".join(f"<li>{escape(item)}</li>" for item in items) + "</ul>"


def _target_details(target: TargetReport) -> str:
    parts = [
        f'<section class="target" id="target-{escape(target.name)}">',
        f"<h3>{escape(target.name)}: {escape(target.board)}</h3>",
        f"<p>runtime: {escape(target.runtime)}; status: "
        f'<span class="status-{escape(target.status)}">{escape(STATUS_TEXT.get(target.status, ""))}'
        "</span></p>",
        _list(target.rules),
    ]
    if target.inputs:
        parts.append(f"<p>takes: {escape(inputs_line(target))}</p>")
    if target.error:
        parts.append(f'<p class="error">error: {escape(target.error)}</p>')
    if target.artifacts:
        rows = [[a.name, a.format, f"{a.bytes:,}", a.sha256] for a in target.artifacts]
        parts.append(
            _table(
                ["artifact", "format", "bytes", "sha256"], rows, f"{target.name}-art", numeric=(2,)
            )
        )
    if target.pure_int8_drift is not None and target.drift is not None:
        pure = target.pure_int8_drift
        drop = "-" if pure.top1_drop_pts is None else f"{pure.top1_drop_pts:.1f} pt"
        parts.append(
            f"<p>pure int8 before the drift fallback: drop {escape(drop)}, agreement "
            f"{100 * pure.agreement:.1f} %</p>"
        )
    steps = [
        f"step {s.step}: {s.action} → drop "
        f"{'-' if s.top1_drop_pts is None else f'{s.top1_drop_pts:.1f} pt'}, agreement "
        f"{100 * s.agreement:.1f} %" + (f" (cost: {s.est_cost})" if s.est_cost else "")
        for s in target.excluded
    ]
    if steps:
        parts += ["<p>drift fallback:</p>", _list(steps)]
    worst = worst_layer_rows(target)
    if worst:
        parts += [
            "<p>worst layers (SQNR, int8 vs fp32; the module of your model beside the "
            "artifact's tensor):</p>",
            _table(WORST_LAYER_HEADERS, worst, f"{target.name}-worst", numeric=(3, 4)),
        ]
    if target.vela is not None:
        v = target.vela
        parts.append(
            f"<p>Vela {escape(v.accelerator)}, {escape(v.system_config)} / "
            f"{escape(v.memory_mode)}: "
            f"{v.npu_ops} ops on the NPU, {len(v.cpu_ops)} on the CPU; {v.cycles:,} cycles, "
            f"{v.est_ms:.3f} ms, SRAM {v.sram_kib:.1f} KiB, DRAM {v.dram_kib:.1f} KiB</p>"
        )
    if target.fallback_ops:
        parts += ["<p>ops off the accelerator:</p>", _list(fallback_op_lines(target))]
    if operands := matmul_operands_line(target):
        parts.append(f"<p>{escape(operands)}</p>")
    if route := route_line(target):
        parts.append(f"<p>{escape(route)}</p>")
    parts.append("</section>")
    return "".join(parts)


# -- plots -----------------------------------------------------------------------------------


def _plots(report: Report) -> list[str]:
    from . import report_plots

    if importlib.util.find_spec("matplotlib") is None:  # the service's extra, not quant's
        return [
            '<p class="muted">No plots: matplotlib is not installed '
            "(pip install 'edge-un[service]').</p>"
        ]

    figures = []
    for target in report.targets.values():
        if target.drift is not None and target.drift.worst_layers:
            svg = report_plots.sqnr_svg(target)
            figures.append(
                _figure(
                    f"sqnr-{target.name}",
                    svg,
                    f"{target.name}: worst layers by SQNR (int8 vs fp32, dB; higher is better)",
                )
            )
    svg = report_plots.latency_svg(report)
    if svg:
        figures.append(
            _figure(
                "latency",
                svg,
                "Latency per target and runtime (p50 bar, p90 and "
                "p99 marks; Vela: estimated on the NPU)",
            )
        )
    svg = report_plots.vela_svg(report)
    if svg:
        figures.append(_figure("vela", svg, "Vela: ops on the NPU and ops left to the CPU"))
    return figures or ['<p class="muted">No plots: no target produced measurements.</p>']


def _figure(name: str, svg: str, caption: str) -> str:
    return (
        f'<figure id="plot-{escape(name)}" class="plot">{_inline_svg(svg, name)}'
        f"<figcaption>{escape(caption)}</figcaption></figure>"
    )


_ID_REFERENCES = re.compile(r'(\bid="|url\(#|xlink:href="#|\bhref="#)')


def _inline_svg(svg: str, prefix: str) -> str:
    """matplotlib's SVG document as an element of this page: no XML prolog or DOCTYPE, and ids
    made unique per plot (two plots would otherwise share glyph and clip-path ids)."""
    start = svg.index("<svg")
    tag = re.sub(r"[^A-Za-z0-9_-]", "_", prefix)
    return _ID_REFERENCES.sub(lambda m: f"{m.group(1)}{tag}-", svg[start:])
