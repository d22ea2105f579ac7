"""Each target's outcome at a glance, from a report: what a person reads first (the web page's
job and job list show these before any file)."""

from __future__ import annotations

from dataclasses import dataclass

from .schema import Report, TargetReport
from .summary import precision_cell


@dataclass(frozen=True)
class Verdict:
    """One target of a conversion: whether it shipped, what int8 cost, how fast, where it runs."""

    target: str
    status: str  # "ok", "over_bar" or "failed" (the report's)
    error: str | None  # a failed target's one-line reason
    agreement: float | None  # top-1 agreement of the shipped file with fp32 (0..1)
    drop_pts: float | None  # its top-1 drop, in points
    precision: str  # "pure int8", "4 tensors int16", ...
    runtime: str | None  # what the latency was measured on
    p50_ms: float | None  # the shipped file at its fewest threads, on the converting host
    npu_ops: int | None  # Vela (Ethos-U): ops on the NPU
    cpu_ops: int | None  # and those left to the Cortex-A


def _fastest_setting(target: TargetReport) -> tuple[str | None, float | None]:
    if not target.latency:
        return None, None
    timing = min(target.latency, key=lambda t: t.threads)  # one thread: the comparable figure
    return timing.runtime, timing.p50_ms


def verdict(target: TargetReport) -> Verdict:
    drift, vela = target.drift, target.vela
    runtime, p50_ms = _fastest_setting(target)
    return Verdict(
        target=target.name,
        status=target.status,
        error=target.error,
        agreement=None if drift is None else drift.agreement,
        drop_pts=None if drift is None else drift.top1_drop_pts,
        precision=precision_cell(target) if drift is not None else "-",
        runtime=runtime,
        p50_ms=p50_ms,
        npu_ops=None if vela is None else vela.npu_ops,
        cpu_ops=None if vela is None else len(vela.cpu_ops),
    )


def verdicts(report: Report) -> list[Verdict]:
    """One verdict per target, in the report's order."""
    return [verdict(target) for target in report.targets.values()]
