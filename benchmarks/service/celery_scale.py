"""One BERT-base- or ViT-B/16-sized job, drift bars on, on a real Celery deployment of 1, 2 and
4 worker processes and on the local queue building 3 targets at once: its wall time, each phase
and target stage, and the workers' peak memory.

    .venv/bin/python -m benchmarks.service.celery_scale                # ~75 min on 2 cores
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.service.celery_scale --report-only
    # one model again
    EDGE_UN_BENCH_MODELS=bert-base .venv/bin/python -m benchmarks.service.celery_scale
    EDGE_UN_BENCH_RUNS='1;local, 3 at once' ...  # some deployments again (keys of DEPLOYMENTS)

The models and data are ``benchmarks.speed.hf_scale``'s (random weights, UN in place of LayerNorm,
64 calibration and 100 evaluation samples), uploaded over HTTP as a user would
(``service.client.Client.submit``: the .onnx, its external data, calib and eval) for every
target, with the pipeline's default drift bars: random weights miss them, so each target climbs
its int8 ladder and 16-bit fallback until it is within them, has nothing left to try, or the
job's time budget stops it. Real servers, started as the service's tests start them
(``testbed``): PostgreSQL, Redis, the API and N ``edge-un worker --concurrency 1`` processes,
one deployment at a time (N = 1, 2, 4; then the API alone, its local queue with
``EDGE_UN_JOB_PARALLEL=3``), each running one job. The service's default settings
except ``EDGE_UN_JOB_TIMEOUT_S`` (``JOB_TIMEOUT_S``, as ``hf_scale``'s bars-on runs, so the two
compare) and the tests' quick heartbeat and polling; no warm-up job (a job's targets run in
fresh processes whatever ran before).

Measured: the job record's wall time (``finished_at - created_at``), each phase (``prepare``:
one worker loads, folds and exports; ``targets``; ``report``) and each target's stages, from the
job and target records polled every ``POLL_S``; and the resident memory of every worker's process
tree (the worker, its pool and the job processes) sampled as often with psutil: the sum over all
workers (what the machine held) and the largest single tree. Each job's artifacts (sha256) and
drift figures are compared between deployments. Merges into results/celery_scale.json (a run
replaces the deployments it ran, each recording its commit), writes .md and .png.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import select

from benchmarks.common.results import RESULTS, benchmark_main, git_commit, save_figure
from benchmarks.service.celery_fanout import job_times, outcome
from benchmarks.speed.hf_scale import MODELS, prepare
from benchmarks.speed.latency_stages import tree_memory
from quant.host import describe_host
from service.client import Client
from service.db import Job, JobTarget, session_scope
from service.jobs import PREPARE
from testbed.live import LiveServer
from testbed.servers import PostgresServer, RedisServer

NAME = "celery_scale"
WORKERS = (1, 2, 4)
LOCAL_PARALLEL = 3  # the local queue's job, for comparison: its targets this many at once
LOCAL = f"local, {LOCAL_PARALLEL} at once"
# run key -> (queue, Celery workers or the local job's targets at once)
DEPLOYMENTS = {**{str(n): ("celery", n) for n in WORKERS}, LOCAL: ("local", LOCAL_PARALLEL)}
JOB_TIMEOUT_S = 900
POLL_S = 0.5
ONLY = [m for m in os.environ.get("EDGE_UN_BENCH_MODELS", "").split(",") if m]
# a subset of DEPLOYMENTS' keys ("1,local, 3 at once" splits on ","; so "1;local, 3 at once")
ONLY_RUNS = [r for r in os.environ.get("EDGE_UN_BENCH_RUNS", "").split(";") if r]


class Watch(threading.Thread):
    """Samples one running job: its phase and its targets' stages (first seen, in seconds from
    the start) and the resident memory of the workers' process trees."""

    def __init__(self, server: LiveServer, job_id: str) -> None:
        super().__init__(daemon=True)
        self.server, self.job_id = server, job_id
        self.start_s = time.monotonic()
        # (seconds, "job" or a target, its stage or phase from then on; None: none)
        self.events: list[tuple[float, str, str | None]] = []
        self.peak_total = self.peak_tree = 0
        self.done = threading.Event()

    def run(self) -> None:
        seen: dict[str, str | None] = {}
        while not self.done.wait(POLL_S):
            now = time.monotonic() - self.start_s
            with session_scope(self.server.settings) as session:
                job = session.scalar(select(Job).where(Job.id == self.job_id))
                phase = job.phase if job else None
                if phase == PREPARE and job.stage:  # its steps: load, fold, export
                    phase = f"{PREPARE}, {job.stage}"
                current = {"job": phase}
                for target in session.scalars(
                    select(JobTarget).where(JobTarget.job_id == self.job_id)
                ):
                    current[target.name] = target.stage if target.state == "running" else None
            for who, stage in current.items():
                if stage != seen.get(who):  # None: it ended (or, a job, left its phases)
                    self.events.append((now, who, stage))
                seen[who] = stage
            # Celery: each worker's tree; local queue: the API's, whose job processes do the work
            roots = [w.process.pid for w in self.server.workers] or [self.server.process.pid]
            trees = [_tree_rss(pid) for pid in roots]
            self.peak_total = max(self.peak_total, sum(trees))
            self.peak_tree = max(self.peak_tree, *trees)


def _tree_rss(pid: int) -> int:
    with contextlib.suppress(psutil.NoSuchProcess):  # a worker that has just stopped
        return tree_memory(psutil.Process(pid))[0]
    return 0


def stage_spans(events: list[tuple[float, str, str | None]], end_s: float) -> dict[str, float]:
    """``"who: stage" -> seconds``: each stage lasts until its owner's next event (or
    ``end_s``)."""
    spans: dict[str, float] = {}
    for who in dict.fromkeys(who for _, who, _ in events):
        mine = [(t, stage) for t, w, stage in events if w == who]
        for (t, stage), (t_next, _) in zip(mine, [*mine[1:], (end_s, None)], strict=True):
            if stage is not None:
                key = f"{who}: {stage}"
                spans[key] = spans.get(key, 0.0) + t_next - t
    return spans


def one_job(server: LiveServer, files: dict[str, Any]) -> dict[str, Any]:
    """Upload the model for every target, wait for its job, measure it."""
    with Client(server.url, server.token(), timeout=600) as client:
        job = client.submit(files["model"], model_data=files["model_data"], calib=files["calib"],
                            eval=files["eval"])  # fmt: skip
        watch = Watch(server, job.id)
        watch.start()
        finished = client.wait(job.id, interval_s=2, timeout_s=JOB_TIMEOUT_S + 600)
        watch.done.set()
        watch.join()
        report = client.report(job.id) if finished.state in ("succeeded", "partial") else None
    result: dict[str, Any] = {
        "state": finished.state,
        **job_times(server, job.id),
        "stages_s": stage_spans(watch.events, time.monotonic() - watch.start_s),
        "peak_rss_mb": {
            "all_workers": watch.peak_total / 2**20,
            "one_worker": watch.peak_tree / 2**20,
        },
    }
    if report is not None:
        result["status"] = {
            name: {"status": t.status, "agreement": t.drift.agreement if t.drift else None}
            for name, t in report.targets.items()
        }
        result.update(outcome(report))
    return result


def model_files(name: str, work: Path) -> dict[str, Any]:
    """The upload's files: the .onnx, its external data (if the export wrote any), calib, eval."""
    onnx_path, calib, evaluation, _ = prepare(name, work)
    data = onnx_path.with_name(onnx_path.name + ".data")
    return {"model": onnx_path, "model_data": [data] if data.exists() else [], "calib": calib,
            "eval": evaluation}  # fmt: skip


def deployment(scratch: Path, key: str, postgres: PostgresServer, redis: RedisServer) -> LiveServer:
    queue, count = DEPLOYMENTS[key]
    home = scratch / key.replace(", ", "-").replace(" ", "-")
    home.mkdir()  # the server's and workers' logs go beside the data
    settings = {"EDGE_UN_WORKERS": str(count)} if queue == "celery" else {
        "EDGE_UN_JOB_PARALLEL": str(count)}  # fmt: skip
    server = LiveServer(
        home / "data", queue, postgres, redis, EDGE_UN_JOB_TIMEOUT_S=str(JOB_TIMEOUT_S),
        EDGE_UN_LATENCY_RUNS="100", **settings,
    )  # fmt: skip
    server.env.pop("EDGE_UN_JOB_THREADS")  # the service's default: ONNX Runtime's, torch's own
    return server.start()


def run() -> dict[str, Any]:
    committed = RESULTS / f"{NAME}.json"
    partial = (ONLY or ONLY_RUNS) and committed.exists()  # what is not run keeps its entry
    kept = json.loads(committed.read_text())["models"] if partial else {}
    commit = git_commit()
    results: dict[str, Any] = {"host": describe_host().model_dump(), "models": kept}
    postgres, redis = PostgresServer(), RedisServer(shutil.which("redis-server") or "redis-server")
    postgres.start()
    redis.start()
    try:
        for name in [m for m in MODELS if m in ONLY] if ONLY else MODELS:
            scratch = Path(tempfile.mkdtemp(prefix=f"edge-un-scale-{name}-"))
            try:
                print(f"{name}: export", flush=True)
                files = model_files(name, scratch)
                runs: dict[str, Any] = kept.get(name, {}).get("runs", {})
                for key in [k for k in DEPLOYMENTS if k in ONLY_RUNS] or DEPLOYMENTS:
                    server = deployment(scratch, key, postgres, redis)
                    try:
                        runs[key] = one_job(server, files)
                    finally:
                        server.stop()
                    runs[key].update(commit=commit, when=time.strftime("%Y-%m-%d"))
                    print(f"{name}, {key}: {runs[key]['wall_s']:.0f} s, {runs[key]['state']}",
                          flush=True)  # fmt: skip
                runs = {key: runs[key] for key in DEPLOYMENTS if key in runs}
                results["models"][name] = {
                    "job_timeout_s": JOB_TIMEOUT_S,
                    "runs": runs,
                    "same_across_runs": _same_outcome(runs.values()),
                }
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    finally:
        postgres.cleanup()
        redis.cleanup()
    return results


def _same_outcome(runs: Iterable[dict[str, Any]]) -> bool:
    outcomes = [{k: r.get(k) for k in ("artifacts", "drift")} for r in runs]
    return all(o == outcomes[0] for o in outcomes)


def _phases(run: dict[str, Any]) -> dict[str, float]:
    """Seconds of each phase of the job (the prepare phase's own stages summed)."""
    return {
        p: sum(s for key, s in run["stages_s"].items() if key.startswith(f"job: {p}"))
        for p in (PREPARE, "targets", "report")
    }


def _label(key: str) -> str:
    return key if key == LOCAL else f"{key} Celery worker{'s' if key != '1' else ''}"


def _status(run: dict[str, Any]) -> str:
    figures = [
        f"{t}: {s['status']}"
        + ("" if s["agreement"] is None else f" ({100 * s['agreement']:.0f} %)")
        for t, s in sorted(run.get("status", {}).items())
    ]
    return ", ".join(figures) or run["state"]


def markdown(results: dict[str, Any]) -> str:
    host = results["host"]
    lines = [
        "# One BERT-base- / ViT-B/16-sized job on 1, 2 and 4 Celery workers, drift bars on",
        "",
        f"`python -m benchmarks.service.celery_scale` on {host['cpu']} ({host['cores']} cores): a "
        "real "
        "deployment per row (PostgreSQL, Redis, the API and N `edge-un worker --concurrency 1`; "
        f"`{LOCAL}`: the API's local queue with `EDGE_UN_JOB_PARALLEL={LOCAL_PARALLEL}`), one "
        "job each, every target, uploaded over HTTP; random weights, so every target searches "
        "its ladder and fallback until within the bars, out of options or out of budget. "
        "Memory: resident, all workers' process trees together (local: the API's) and the "
        "largest one, sampled every 0.5 s.",
        "",
    ]
    for name, entry in results["models"].items():
        runs = entry["runs"]
        one = runs["1"]["wall_s"] if "1" in runs else None
        lines += [
            f"## {name} (job time limit {entry['job_timeout_s']} s)",
            "",
            "| deployment | commit, day | job wall | 1 worker / this | prepare | targets | report "
            "| build per target (s) | peak RSS, all workers | largest worker | status per target |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key, run in runs.items():
            phases = _phases(run)
            builds = ", ".join(f"{t} {s:.0f}" for t, s in sorted(run["build_s"].items()))
            memory = run["peak_rss_mb"]
            # side by side only: the 1-worker job of the same invocation (the same commit)
            same_run = one is not None and run["commit"] == runs["1"]["commit"]
            ratio = f"{one / run['wall_s']:.2f}x" if same_run else "-"
            spans = (
                [f"{phases[p]:.0f} s" for p in (PREPARE, "targets", "report")]
                if key != LOCAL
                else ["-"] * 3  # the local queue's job has no phases
            )
            lines.append(
                f"| {_label(key)} | {run['commit']}, {run['when']} | {run['wall_s'] / 60:.1f} min "
                f"({run['wall_s']:.0f} s) | {ratio} | {' | '.join(spans)} | {builds or '-'} | "
                f"{memory['all_workers'] / 1024:.1f} GB | {memory['one_worker'] / 1024:.1f} GB | "
                f"{_status(run)} |"
            )
        same = "yes" if entry["same_across_runs"] else "**no**"
        lines += ["", "`1 worker / this`: against the 1-worker job of the same invocation (the "
                  "rows of one commit ran one after the other in one invocation).", "",
                  f"Artifacts (sha256) and drift figures the same in every row: {same}.", "",
                  "Stages (s), as the job and target records showed them (the local queue "
                  "records no phases):", "",
                  "| stage | " + " | ".join(_label(k) for k in runs) + " |",
                  "|---|" + "---|" * len(runs)]  # fmt: skip
        stages = dict.fromkeys(s for run in runs.values() for s in run["stages_s"])
        for stage in stages:
            cells = [f"{run['stages_s'].get(stage, 0):.0f}" for run in runs.values()]
            lines.append(f"| {stage} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5.5, 3.5))
    for name, entry in results["models"].items():
        celery = {int(k): r["wall_s"] / 60 for k, r in entry["runs"].items() if k != LOCAL}
        (line,) = axis.plot(list(celery), list(celery.values()), "o-", label=f"{name}, Celery")
        if LOCAL in entry["runs"]:
            axis.axhline(entry["runs"][LOCAL]["wall_s"] / 60, color=line.get_color(),
                         linestyle="--", label=f"{name}, {LOCAL}")  # fmt: skip
    axis.axhline(8, color="grey", linestyle=":", label="8 min goal")
    axis.set_xticks(list(WORKERS))
    axis.set_xlabel("Celery worker processes")
    axis.set_ylabel("job wall time (min)")
    axis.set_title(f"one job, every target, bars on, {results['host']['cores']} cores")
    axis.legend(fontsize=7)
    save_figure(figure, NAME)


if __name__ == "__main__":
    benchmark_main(NAME, __doc__, run, markdown, plot)
