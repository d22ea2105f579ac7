"""One job's targets spread over Celery workers: the wall time of a job of every target on one
worker and on two, side by side, and its artifacts and drift against a one-process conversion.

    .venv/bin/python -m benchmarks.service.celery_fanout                # ~25 min on 2 cores
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.service.celery_fanout --report-only

Real servers, started as the service's tests start them (``testbed``): PostgreSQL, Redis, and
two Celery-mode services at once, one with 1 ``edge-un worker`` and one with 2 (each
``--concurrency 1``, the tests' settings: one math thread per job process, 3 latency runs).
The job is the tests' quick one (``testbed.live.upload_fast``: the bundled UN ViT as a folded
fp32 ONNX file, 32 calibration and 100 evaluation samples of its data set) for all 4 targets
(cpu and tda4vm: QDQ ONNX; imx93 and imx8mp: TFLite, which share one onnx2tf conversion
under a file lock). One warm-up job per service first, not counted; then
ROUNDS rounds, each one job on the 1-worker service then one on the 2-worker service (never
at once). Wall time is the job record's ``finished_at - created_at``; each target's build time
is its record's (``job_targets``: claimed to ended). Every job's artifacts (name, sha256) and
drift figures (each target's ``drift``) are compared with those of ``edge-un convert`` of the
same files in one process with one math thread. Writes benchmarks/results/celery_fanout.json,
.md and .png.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select

from benchmarks.common.results import ROOT, benchmark_main, save_figure
from quant.report import Report
from service.db import Job, JobTarget, session_scope
from service.worker.job_process import THREAD_VARIABLES
from testbed.live import LiveServer, fast_job_files, upload_fast, wait_for
from testbed.servers import PostgresServer, RedisServer

NAME = "celery_fanout"
TARGETS = "cpu,imx93,imx8mp,tda4vm"
ROUNDS = 2
WORKERS = (1, 2)


def one_process_conversion(out: Path) -> dict[str, Any]:
    """``edge-un convert`` of the quick job's files, one math thread: its artifacts and drift."""
    files = fast_job_files()
    command = [sys.executable, "-m", "service.cli", "convert", str(files["model"]),
               "--target", TARGETS, "--calib", str(files["calib"]), "--eval", str(files["eval"]),
               "-o", str(out)]  # fmt: skip
    env = {**os.environ, **dict.fromkeys(THREAD_VARIABLES, "1")}
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    return outcome(Report.read(out / "report.json"))


def outcome(report: Report) -> dict[str, Any]:
    """What must not depend on where the targets were built: every artifact's sha256 (name ->
    sha256) and every target's drift figures."""
    return {
        "artifacts": {a.name: a.sha256 for t in report.targets.values() for a in t.artifacts},
        "drift": {name: t.model_dump(mode="json")["drift"] for name, t in report.targets.items()},
    }


def one_job(server: LiveServer, token: str) -> dict[str, Any]:
    """Submit the quick job, wait for it: its wall time, its targets' build times, its files."""
    with server.client(token) as client:
        job_id = upload_fast(client, targets=TARGETS).json()["id"]
        wait_for(client, job_id, ("succeeded",), timeout=1800)
        report = Report.model_validate(client.get(f"/v1/conversions/{job_id}/report").json())
    return {**job_times(server, job_id), **outcome(report)}


def job_times(server: LiveServer, job_id: str) -> dict[str, Any]:
    """A finished job's times from its records: its wall time (``finished_at - created_at``),
    each target's build (claimed to ended; Celery mode only) and how many runs each took."""
    with session_scope(server.settings) as session:
        job = session.scalar(select(Job).where(Job.id == job_id))
        builds = session.scalars(select(JobTarget).where(JobTarget.job_id == job_id)).all()
        return {
            "wall_s": (job.finished_at - job.created_at).total_seconds(),
            "build_s": {b.name: (b.updated_at - b.started_at).total_seconds() for b in builds},
            "target_attempts": {b.name: b.attempts for b in builds},
        }


def run() -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="edge-un-fanout-"))
    postgres, redis = PostgresServer(), RedisServer(shutil.which("redis-server") or "redis-server")
    postgres.start()
    redis.start()
    servers: dict[int, LiveServer] = {}
    try:
        reference = one_process_conversion(scratch / "one-process")
        for count in WORKERS:
            (scratch / f"w{count}").mkdir()  # the server's log goes beside its data directory
            server = LiveServer(
                scratch / f"w{count}" / "data", "celery", postgres, redis,
                EDGE_UN_WORKERS=str(count),
            )  # fmt: skip
            servers[count] = server.start()
        tokens = {count: server.token() for count, server in servers.items()}
        for count, server in servers.items():
            one_job(server, tokens[count])  # warm-up
        jobs: dict[int, list[dict[str, Any]]] = {count: [] for count in WORKERS}
        for _ in range(ROUNDS):
            for count, server in servers.items():
                jobs[count].append(one_job(server, tokens[count]))
    finally:
        for server in servers.values():
            server.stop()
        postgres.cleanup()
        redis.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    medians = {count: statistics.median(j["wall_s"] for j in jobs[count]) for count in WORKERS}
    return {
        "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "when": time.strftime("%Y-%m-%d"),
        "targets": TARGETS,
        "rounds": ROUNDS,
        "jobs": {str(count): jobs[count] for count in WORKERS},
        "median_wall_s": {str(count): medians[count] for count in WORKERS},
        "speedup": medians[1] / medians[2],
        "same_as_one_process": all(
            {k: job[k] for k in reference} == reference for runs in jobs.values() for job in runs
        ),
        "one_process": reference,
    }


def markdown(results: dict[str, Any]) -> str:
    rows = []
    for count, runs in results["jobs"].items():
        walls = ", ".join(f"{job['wall_s']:.1f}" for job in runs)
        builds = {
            name: statistics.median(job["build_s"][name] for job in runs)
            for name in runs[0]["build_s"]
        }
        build = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in sorted(builds.items()))
        median = results["median_wall_s"][count]
        rows.append(f"| {count} | {median:.1f} s | {walls} | {build} |")
    same = "yes" if results["same_as_one_process"] else "**no**"
    builds = {  # the targets' builds of a job together: they compete for the cores
        count: statistics.median(sum(job["build_s"].values()) for job in runs)
        for count, runs in results["jobs"].items()
    }
    return "\n".join([
        f"# One job's targets on Celery workers ({results['targets']})",
        "",
        f"`python -m benchmarks.service.celery_fanout`, {results['when']}, {results['host']}; "
        f"{results['rounds']} interleaved rounds after a warm-up job per service.",
        "",
        "| workers | median wall time | each job (s) | median build per target |",
        "|---|---|---|---|",
        *rows,
        "",
        f"Two workers: **{results['speedup']:.2f}x** faster per job. Every job's artifacts "
        f"(name and sha256) and drift figures equal a one-process `edge-un convert` of the "
        f"same files: {same}.",
        "",
        f"What limits it on {results['host'].split(', ')[-1]}: the targets' builds of a job "
        f"took {builds['1']:.0f} s together on one worker and {builds['2']:.0f} s on two "
        "(two builds at once share the cores, with the API, PostgreSQL and Redis, and the "
        "host's other work); imx8mp reuses imx93's onnx2tf conversion, so on two workers it "
        "waits for it (a file lock) instead of following it.",
        "",
    ])  # fmt: skip


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3))
    counts = list(results["median_wall_s"])
    axis.bar([f"{c} worker(s)" for c in counts], [results["median_wall_s"][c] for c in counts])
    axis.set_ylabel("median wall time per job (s)")
    axis.set_title(f"one job, targets {results['targets']}")
    save_figure(figure, NAME)


if __name__ == "__main__":
    benchmark_main(NAME, __doc__, run, markdown, plot)
