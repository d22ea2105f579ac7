"""A conversion's report as rich tables: the summary ``convert`` ends with, the details
``report DIR`` shows."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from service.errors import UsageError

from . import output

if TYPE_CHECKING:
    from quant.report import Report

DRIFT_HEADERS = ("target", "status", "top-1 fp32 -> int8", "drop", "agreement", "cosine",
                 "precision")  # fmt: skip


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def print_summary(console: Console, report: Report, headline: bool = True) -> None:
    """The model line, the drift table and the latency table (quant.report.summary's rows)."""
    from quant.report.summary import (
        LATENCY_HEADERS,
        drift_rows,
        host_kernel_lines,
        latency_notes,
        latency_rows,
        latency_title,
        norms_line,
    )

    reference = report.reference
    if headline:
        top1 = "" if reference.top1_fp32 is None else f", fp32 top-1 {_pct(reference.top1_fp32)}"
        console.print(f"{report.model.name}: {reference.samples} evaluation samples{top1}")
        console.print(norms_line(report))
    drift = output.table(
        *DRIFT_HEADERS,
        title=f"Drift, int8 vs fp32, in each target's arithmetic (bar: drop <= "
        f"{report.max_drift_pts} pt, agreement >= {100 * report.min_agreement:.0f} %)",
        numeric=("drop", "agreement", "cosine"),
    )
    for row in drift_rows(report):
        drift.add_row(row[0], output.status_text(row[1]), *row[2:])
    console.print()
    output.print_table(console, drift)
    for line in host_kernel_lines(report):
        console.print(line)
    latency = output.table(
        *LATENCY_HEADERS,
        title=latency_title(report),
        numeric=("threads", "p50 ms", "p90 ms", "p99 ms"),
    )
    for row in latency_rows(report):
        latency.add_row(*row)
    console.print()
    output.print_table(console, latency)
    for line in latency_notes(report):
        console.print(line)


def print_details(console: Console, report: Report) -> None:
    """What ``report`` adds to the summary: the model, the data, each artifact, the failures."""
    from quant.report.summary import norms_line, route_line

    model, reference = report.model, report.reference
    about = output.table("", "", title=f"{model.name} (edge-un {report.edge_un_version})")
    about.show_header = False
    parameters = "-" if model.parameters is None else f"{model.parameters:,}"
    for key, value in (
        ("format", model.source_format),
        ("parameters", parameters),
        ("input", f"{model.input_dtype} {list(model.input_shape)}"),
        ("fp32 top-1", f"{_pct(reference.top1_fp32)} on {reference.samples} samples "
                       f"({reference.eval_source})"),
        ("calibration", f"{reference.calibration_samples} samples "
                        f"({reference.calibration_source})"),
        ("norms", norms_line(report)),
    ):  # fmt: skip
        about.add_row(key, value)
    output.print_table(console, about)
    print_summary(console, report, headline=False)
    artifacts = output.table(
        "target", "artifact", "bytes", "sha256", title="Artifacts", numeric=("bytes",)
    )
    for target in report.targets.values():
        for item in target.artifacts:
            artifacts.add_row(target.name, item.name, f"{item.bytes:,}", item.sha256)
    console.print()
    output.print_table(console, artifacts)
    console.print()
    _print_layers(console, report)
    for target in report.targets.values():
        if route := route_line(target):
            console.print(f"{target.name}: {route}")
    for target in report.targets.values():
        if target.error:
            console.print(f"{target.name} failed: {target.error}", style="red")
    for line in report.notes:
        console.print(f"note: {line}", style="dim")


def _print_layers(console: Console, report: Report) -> None:
    """Per target: the worst layers, named by the module of the user's model beside the
    artifact's tensor, and the ops its accelerator leaves to the CPU, with their modules."""
    from quant.report.summary import WORST_LAYER_HEADERS, fallback_op_lines, worst_layer_rows

    for target in report.targets.values():
        rows = worst_layer_rows(target)
        if rows:
            layers = output.table(
                *WORST_LAYER_HEADERS,
                title=f"{target.name}: worst layers (SQNR, int8 vs fp32)",
                numeric=WORST_LAYER_HEADERS[3:],
            )
            for row in rows:
                layers.add_row(*row)
            output.print_table(console, layers)
            console.print()
        for line in fallback_op_lines(target):
            console.print(f"{target.name}: off the accelerator: {line}")


def read_report(directory: Path) -> Report:
    """DIR/report.json (or the file itself), with a one-line error for anything else."""
    from pydantic import ValidationError

    from quant.report import REPORT_FILE, Report

    if not directory.exists():
        raise FileNotFoundError(f"{directory}: no such file or directory")
    path = directory / REPORT_FILE if directory.is_dir() else directory
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory}: no {REPORT_FILE} here (give the output directory of edge-un convert)"
        )
    try:
        return Report.model_validate_json(path.read_bytes())
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the document"
        raise UsageError(
            f"{path}: not an edge-un report ({error.error_count()} problem(s); first: {where}: "
            f"{first['msg']})"
        ) from None
