"""The HTTP service under load: conversions per hour with 1 and 2 workers, and the latency of
the status, download and metrics endpoints while conversions run, in both queue modes.

    .venv/bin/python -m benchmarks.service.service_load            # everything, ~13 min on 2 cores
    .venv/bin/python -m benchmarks.service.service_load --quick  # 2 jobs per run, 4 clients, ~6 min
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.service.service_load --report-only
    # only the 20-upload burst, ~3 min
    .venv/bin/python -m benchmarks.service.service_load --burst-only

Real servers, started as the service's tests start them (``testbed``): for each
queue mode, ``local`` (SQLite, the API server's own job processes) and ``celery`` (PostgreSQL +
Redis, ``edge-un worker`` processes, each ``--concurrency 1``), and W in {1, 2} workers, a fresh
server and data directory. Each run submits a fixed batch of conversions of the bundled example
``vit-mnist-un`` (target ``cpu``) as users do: the real ``.safetensors`` checkpoint upload
(``testbed.live.upload``), so
every job includes the checkpoint load, the fold and the torch export (``--fast-upload``
sends the folded ONNX file and small .npz files instead, ``upload_fast``). One warm-up
conversion runs first, not counted: in local mode the fork server imports the pipeline after
the server starts, and the API's first upload pays for lazy imports (~3-4 s).

While the batch converts, N client threads (one token, shared with the submitter) loop: GET
/v1/conversions/{id} round-robin over the batch; the first time a client sees a job succeeded,
it downloads ``artifacts/cpu/model_int8.onnx`` (sha256 checked against the ETag) and
``bundle.zip``; every 10th request GET /metrics; a think time between requests. Every
request's latency and status is recorded; a failure is a transport error, an unexpected status
or a bad body. The clients stop once every job has finished and every client has downloaded
every job. Conversions per hour = jobs / (last ``finished_at`` - first ``created_at``, from the
job records); per-job queue wait and run time from the same records; the stage durations from
the final /metrics. A sampler thread reads the peak RSS of the API process, its job processes,
the celery workers and their pool processes (psutil, every 0.5 s). In celery mode the
database's own counters (``pg_stat_database``, reset before the batch, read after the servers
stopped) give the transactions and rows written per conversion; the data directory is measured
after the run (uploads, artifacts, logs). Writes benchmarks/results/service_load.json,
service_load.md and service_load.png.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common.results import RESULTS, ROOT
from testbed.burst import concurrent_uploads
from testbed.live import (
    CELERY_FAST,
    FAST,
    LiveServer,
    ServiceMode,
    fast_job_files,
    upload,
    upload_fast,
    wait_for,
)
from testbed.servers import PG_BIN, PostgresServer, RedisServer

JSON_PATH = RESULTS / "service_load.json"
MD_PATH = RESULTS / "service_load.md"
PNG_PATH = RESULTS / "service_load.png"
MODES = ("local", "celery")
WORKER_COUNTS = (1, 2)
ENDPOINTS = ("submit", "status", "artifact", "bundle", "metrics")
ARTIFACT = "cpu/model_int8.onnx"
METRICS_EVERY = 10
# What the runs change from the service's defaults (the rest are the defaults): the tests'
# compute knobs (few latency runs, one thread per job: W jobs on 2 cores), and the database
# knobs left at their production values, so the database figures are those of a deployment.
SETTINGS = {
    "EDGE_UN_LATENCY_RUNS": FAST["EDGE_UN_LATENCY_RUNS"],
    "EDGE_UN_JOB_THREADS": FAST["EDGE_UN_JOB_THREADS"],
    "EDGE_UN_PROGRESS_INTERVAL_S": "0.5",
    "EDGE_UN_POLL_INTERVAL_S": "0.5",
}
CELERY_SETTINGS = {"EDGE_UN_HEARTBEAT_S": "10"}
# every fast setting a LiveServer would add is overridden here: the rest are the defaults
assert set(FAST) == set(SETTINGS)
assert set(CELERY_FAST) == set(CELERY_SETTINGS)


# -- the clients ---------------------------------------------------------------------------
class Recorder:
    """Every request: (endpoint, start time, seconds, status, ok, bytes, error)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float, int, bool, int, str]] = []
        self.lock = threading.Lock()
        self.t0 = time.monotonic()

    def call(self, endpoint: str, check, send, *args: Any) -> Any:
        start = time.monotonic()
        status, ok, size, error, response = 0, False, 0, "", None
        try:
            response = send(*args)
            status, size = response.status_code, len(response.content)
            error = check(response)
            ok = not error
        except Exception as caught:  # a transport error is a failure, recorded, not raised
            error = f"{type(caught).__name__}: {caught}"[:300]
        seconds = time.monotonic() - start
        with self.lock:
            self.rows.append((endpoint, start - self.t0, seconds, status, ok, size, error))
        return response if ok else None


def expect(status: int):
    def check(response) -> str:
        return "" if response.status_code == status else f"status {response.status_code}"

    return check


def check_artifact(response) -> str:
    if response.status_code != 200:
        return f"status {response.status_code}"
    etag = response.headers.get("etag", "").strip('"')
    return "" if hashlib.sha256(response.content).hexdigest() == etag else "sha256 != ETag"


def check_bundle(response) -> str:
    if response.status_code != 200:
        return f"status {response.status_code}"
    return "" if response.content[:2] == b"PK" and len(response.content) > 100 else "not a zip"


class Client(threading.Thread):
    """One polling, downloading client."""

    def __init__(self, index, server, secret, ids, recorder, stop, think_s) -> None:
        super().__init__(name=f"client-{index}", daemon=True)
        self.index, self.server, self.secret = index, server, secret
        self.ids, self.recorder, self.stop, self.think_s = ids, recorder, stop, think_s
        self.downloaded: set[str] = set()

    def run(self) -> None:
        rec = self.recorder
        with self.server.client(self.secret) as http:
            i = self.index
            while not self.stop.is_set():
                ids = list(self.ids)
                if not ids:
                    time.sleep(0.05)
                    continue
                i += 1
                if i % METRICS_EVERY == 0:
                    rec.call("metrics", expect(200), http.get, "/metrics")
                else:
                    job_id = ids[i % len(ids)]
                    url = f"/v1/conversions/{job_id}"
                    got = rec.call("status", expect(200), http.get, url)
                    done = got is not None and got.json()["state"] == "succeeded"
                    if done and job_id not in self.downloaded:
                        self.downloaded.add(job_id)
                        path = f"{url}/artifacts/{ARTIFACT}"
                        rec.call("artifact", check_artifact, http.get, path)
                        rec.call("bundle", check_bundle, http.get, f"{url}/bundle.zip")
                self.stop.wait(self.think_s)


# -- process memory ------------------------------------------------------------------------
class RssSampler(threading.Thread):
    """Every 0.5 s: peak RSS (MB) by role (the API process; its children: local mode's fork
    server and job processes; the celery worker processes; their pool processes), and, in
    celery mode, the TCP connections each process holds to PostgreSQL (psutil, no query)."""

    def __init__(self, server: LiveServer, postgres: PostgresServer | None = None) -> None:
        super().__init__(name="rss", daemon=True)
        self.server = server
        self.pg_port = postgres.port if postgres is not None else None
        self.peak: dict[str, float] = {}
        self.connections: dict[str, int] = {}  # peak: per process by role, and in all
        self.stop = threading.Event()

    def _note(self, role: str, proc) -> int:
        self.peak[role] = max(self.peak.get(role, 0.0), proc.memory_info().rss / 2**20)
        if self.pg_port is None:
            return 0
        count = sum(
            1 for c in proc.net_connections(kind="tcp") if c.raddr and c.raddr.port == self.pg_port
        )
        self.connections[role] = max(self.connections.get(role, 0), count)
        return count

    def sample(self) -> None:
        import psutil

        roots: list[tuple[str, int]] = []
        if self.server.process is not None:
            roots.append(("api", self.server.process.pid))
        roots += [("worker", w.process.pid) for w in self.server.workers]
        total = 0
        for role, pid in roots:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                total += self._note(role, proc)
                for child in proc.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        total += self._note(f"{role}_child", child)
        self.connections["all"] = max(self.connections.get("all", 0), total)

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.sample()


# -- one run -------------------------------------------------------------------------------
def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def parse_stage_metrics(text: str) -> dict[str, dict[str, float]]:
    stages: dict[str, dict[str, float]] = {}
    pattern = r'edge_un_stage_duration_seconds_(count|sum)\{stage="([^"]+)"\} ([0-9.e+-]+)'
    for kind, stage, value in re.findall(pattern, text):
        stages.setdefault(stage, {})[kind] = float(value)
    return {
        s: {"count": v.get("count", 0), "mean_s": v.get("sum", 0) / max(v.get("count", 1), 1)}
        for s, v in stages.items()
    }


def api_cpu_seconds(server: LiveServer) -> float:
    import psutil

    times = psutil.Process(server.process.pid).cpu_times()
    return times.user + times.system


def pg_counters(postgres: PostgresServer, database_url: str) -> dict[str, int]:
    name = database_url.rsplit("/", 1)[1]
    columns = ("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "tup_deleted",
               "tup_returned", "tup_fetched")  # fmt: skip
    with postgres.connect(name) as connection:
        row = connection.execute(
            f"SELECT {', '.join(columns)} FROM pg_stat_database WHERE datname = %s", (name,)
        ).fetchone()
    return dict(zip(columns, (int(v) for v in row), strict=True))


def pg_reset(postgres: PostgresServer, database_url: str) -> None:
    with postgres.connect(database_url.rsplit("/", 1)[1]) as connection:
        connection.execute("SELECT pg_stat_reset()")


def run_one(
    mode: ServiceMode, workers: int, jobs: int, clients: int, think_s: float, fast: bool,
    scratch: Path,
) -> dict[str, Any]:  # fmt: skip
    from edge_un import examples

    data_dir = scratch / f"{mode.name}-w{workers}"
    env = {**SETTINGS, "EDGE_UN_WORKERS": str(workers)}
    if mode.name == "celery":
        env |= CELERY_SETTINGS
    server = mode.server(data_dir, **env)
    model = examples.path("vit-mnist-un")

    def submit(http) -> Any:
        if fast:
            return upload_fast(http)
        return upload(http, model, targets="cpu")

    recorder = Recorder()
    stop = threading.Event()
    sampler = RssSampler(server, mode.postgres)
    threads: list[Client] = []
    result: dict[str, Any] = {"mode": mode.name, "workers": workers, "jobs": jobs}
    t_start = time.monotonic()
    try:
        server.start()
        result["start_s"] = round(time.monotonic() - t_start, 1)
        secret = server.token("bench")
        sampler.start()
        unrecorded = [0]  # the submitter's own polls (wait_for) and the final /metrics

        def count(request) -> None:
            unrecorded[0] += 1

        with server.client(secret, event_hooks={"request": [count]}) as http:
            # One warm-up conversion, not counted: the local fork server imports the pipeline
            # after the server starts, and the API's first upload pays for lazy imports.
            warm = submit(http)
            assert warm.status_code == 202, warm.text
            result["warmup_submit_ms"] = round(warm.elapsed.total_seconds() * 1000, 1)
            wait_for(http, warm.json()["id"], ("succeeded",), timeout=600)
            http.delete(f"/v1/conversions/{warm.json()['id']}")
            if server.backend is not None:
                time.sleep(1.0)  # the warm-up's pool process exits and flushes its statistics
                pg_reset(mode.postgres, server.backend.database_url)
            unrecorded[0] = 0
            ids: list[str] = []
            threads = [
                Client(i, server, secret, ids, recorder, stop, think_s) for i in range(clients)
            ]
            for thread in threads:
                thread.start()
            batch_started = time.monotonic()
            cpu_before = api_cpu_seconds(server)
            for _ in range(jobs):
                response = recorder.call("submit", expect(202), submit, http)
                if response is None:
                    raise RuntimeError(f"upload refused: {recorder.rows[-1]}")
                ids.append(response.json()["id"])
            records = [wait_for(http, job_id, timeout=1800) for job_id in ids]
            batch_done = time.monotonic()
            deadline = time.monotonic() + 120  # the last downloads
            while time.monotonic() < deadline and any(len(t.downloaded) < jobs for t in threads):
                time.sleep(0.2)
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
            metrics_text = http.get("/metrics").text
        sampler.sample()
        # the API process's own CPU over the batch and its downloads (not its children)
        result["api_cpu_s"] = round(api_cpu_seconds(server) - cpu_before, 1)
    finally:
        stop.set()
        sampler.stop.set()
        server.stop()
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    result["batch_wall_s"] = round(batch_done - batch_started, 1)
    if server.backend is not None:  # the backends exited: their statistics are flushed
        time.sleep(1.0)
        result["postgres"] = pg_counters(mode.postgres, server.backend.database_url)
        mode.postgres.drop_database(server.backend.database_url)

    def ts(text: str) -> float:
        return datetime.fromisoformat(text).timestamp()

    states = [r["state"] for r in records]
    created = [ts(r["created_at"]) for r in records]
    started = [ts(r["started_at"]) for r in records if r["started_at"]]
    finished = [ts(r["finished_at"]) for r in records if r["finished_at"]]
    span = max(finished) - min(created)
    result |= {
        "succeeded": states.count("succeeded"),
        "states": states,
        "attempts": [r["attempts"] for r in records],
        "span_s": round(span, 2),
        "conversions_per_hour": round(states.count("succeeded") / span * 3600, 1),
        "run_s": [round(ts(r["finished_at"]) - ts(r["started_at"]), 2) for r in records],
        "wait_s": [round(ts(r["started_at"]) - ts(r["created_at"]), 2) for r in records],
        "first_start_s": round(min(started) - min(created), 2),
        "upload_bytes": [r["inputs"]["bytes"] for r in records],
        "stages": parse_stage_metrics(metrics_text),
        "peak_rss_mb": {k: round(v, 1) for k, v in sampler.peak.items()},
        "peak_db_connections": sampler.connections if server.backend else None,
        "data_dir_bytes": {
            part: dir_bytes(data_dir / part) for part in ("uploads", "artifacts", "logs", "tmp")
        },
        "database_file_bytes": sum(
            p.stat().st_size for p in data_dir.glob("edge-un.db*") if p.is_file()
        ),
    }
    result["requests"] = summarize(recorder.rows, batch_done - recorder.t0)
    result["failures"] = [
        {"endpoint": e, "t": round(t, 2), "status": st, "error": err}
        for e, t, _, st, ok, _, err in recorder.rows
        if not ok
    ][:50]
    result["unrecorded_requests"] = unrecorded[0] - jobs  # the submits are recorded
    result["artifact_files"] = (
        sum(1 for f in (data_dir / "artifacts").rglob("*") if f.is_file())
        if (data_dir / "artifacts").exists()
        else 0
    )
    result["submit_ms"] = [round(s * 1000, 1) for e, _, s, *_ in recorder.rows if e == "submit"]
    artifact_sizes = [size for e, _, _, _, ok, size, _ in recorder.rows if e == "artifact" and ok]
    bundle_sizes = [size for e, _, _, _, ok, size, _ in recorder.rows if e == "bundle" and ok]
    result["artifact_bytes"] = artifact_sizes[0] if artifact_sizes else None
    result["bundle_bytes"] = bundle_sizes[0] if bundle_sizes else None
    return result


def run_burst(mode: ServiceMode, clients: int, scratch: Path) -> dict[str, Any]:
    """tests/test_service_load.py's burst, timed: ``clients`` tokens upload at once to a fresh
    server with 2 workers, each waits for its own job (``upload_fast``, target cpu)."""
    env = {**SETTINGS, "EDGE_UN_WORKERS": "2"}
    if mode.name == "celery":
        env |= CELERY_SETTINGS
    server = mode.server(scratch / f"{mode.name}-burst", **env).start()
    try:
        burst = concurrent_uploads(server, clients)
    finally:
        server.stop()
    jobs = [run.job for run in burst.clients if run.job]
    return {
        "mode": mode.name,
        "clients": clients,
        "accepted": sum(run.status == 202 for run in burst.clients),
        "succeeded": sum(job["state"] == "succeeded" for job in jobs),
        "distinct_ids": len(set(burst.job_ids)),
        "max_attempts": max((job["attempts"] for job in jobs), default=0),
        "own_job_only": sum(run.listed == [run.job.get("id")] for run in burst.clients),
        "seconds": round(burst.seconds, 1),
        "conversions_per_hour": round(len(jobs) / burst.seconds * 3600),
    }


def burst_lines(bursts: list[dict[str, Any]]) -> list[str]:
    if not bursts:
        return []
    out = [
        "## A burst of uploads (the slow test tests/test_service_load.py, timed)",
        "",
        "N clients, each with its own token, upload one conversion (`upload_fast`, target "
        "cpu) at the same moment to a fresh server with 2 workers and wait for it.",
        "",
        "| mode | clients | accepted | succeeded | distinct ids | max attempts | "
        "each lists only its own | burst s | conversions/hour |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in bursts:
        out.append(
            f"| {b['mode']} | {b['clients']} | {b['accepted']} | {b['succeeded']} | "
            f"{b['distinct_ids']} | {b['max_attempts']} | {b['own_job_only']} | "
            f"{b['seconds']:.0f} | {b['conversions_per_hour']} |"
        )
    return [*out, ""]


def summarize(rows, batch_end: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for endpoint in ENDPOINTS:
        mine = [r for r in rows if r[0] == endpoint]
        if not mine:
            continue
        ms = np.array([r[2] for r in mine]) * 1000
        during = np.array([r[2] for r in mine if r[1] <= batch_end]) * 1000
        out[endpoint] = {
            "count": len(mine),
            "failed": sum(not r[4] for r in mine),
            "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p90_ms": round(float(np.percentile(ms, 90)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "max_ms": round(float(ms.max()), 2),
            "count_during_conversions": int(during.size),
            "p99_ms_during_conversions": (
                round(float(np.percentile(during, 99)), 2) if during.size else None
            ),
            # p0, p1, ..., p100: the distribution, for the plot
            "quantiles_ms": [round(float(v), 2) for v in np.percentile(ms, np.arange(101))],
        }
    span = max(r[1] + r[2] for r in rows) - min(r[1] for r in rows) if rows else 0
    out["all"] = {
        "count": len(rows),
        "failed": sum(not r[4] for r in rows),
        "per_second": round(len(rows) / span, 1) if span else None,
    }
    return out


# -- the report ----------------------------------------------------------------------------
def report(data: dict[str, Any]) -> None:
    runs = data["runs"]
    by = {(r["mode"], r["workers"]): r for r in runs}
    lines = ["# The HTTP service under load: conversions per hour, endpoint latency", ""]
    lines.append("<!-- GENERATED: service_load.py -->")
    m = data["machine"]
    quick = " --quick" if data["quick"] else ""
    lines.append(
        f"Made by `.venv/bin/python -m benchmarks.service.service_load{quick}`, started "
        f"{data['started']} UTC, {data['elapsed_s']:.0f} s in all. Machine: "
        f"{m['cpus']} cores ({m['arch']}), Python {m['python']}. Load average (1/5/15 min) "
        f"before {m['load_before']}, after {m['load_after']}: other work shared the machine."
    )
    lines.append("")
    upload_kind = (
        "`upload_fast` (folded ONNX + 32 calibration / 100 evaluation samples as .npz)"
        if data["fast_upload"]
        else "the real checkpoint upload, `vit-mnist-un.safetensors` (the job loads it, "
        "folds, exports with torch, calibrates on 256 training samples, evaluates on the "
        "1000-sample test split)"
    )
    lines.append(
        f"Each run: a fresh server and data directory, a batch of {data['jobs']} conversions of "
        f"the bundled `vit-mnist-un`, target `cpu`, submitted at once by {upload_kind}; "
        f"meanwhile {data['clients']} client threads poll GET /v1/conversions/{{id}} "
        f"round-robin (think time {data['think_ms']:g} ms), download "
        f"`artifacts/{ARTIFACT}` (sha256 checked) and `bundle.zip` once per job and client when "
        f"they see it succeeded, and GET /metrics every {METRICS_EVERY}th request. "
        "Settings: "
        + ", ".join(f"`{k}={v}`" for k, v in data["settings"].items())
        + f"; celery mode also `EDGE_UN_HEARTBEAT_S={CELERY_SETTINGS['EDGE_UN_HEARTBEAT_S']}`"
        " (the rest: the service's defaults). Conversions/hour = succeeded jobs / (last "
        "`finished_at` - first `created_at`) from the job records, so the pipeline's fill and "
        "drain are inside it."
    )
    lines.append("")
    lines.append(
        "| mode | workers | conversions/hour | speed-up 1->2 | run s per job (median) | "
        "status p50 / p99 ms | artifact p50 / p99 ms | bundle p50 / p99 ms | "
        "metrics p50 / p99 ms | requests (per s) | failed |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        base = by.get((r["mode"], 1))
        speed = (
            f"{r['conversions_per_hour'] / base['conversions_per_hour']:.2f}x"
            if base and r["workers"] != 1
            else "-"
        )
        q = r["requests"]

        def pp(endpoint: str, q=q) -> str:
            e = q.get(endpoint)
            return f"{e['p50_ms']:.1f} / {e['p99_ms']:.1f}" if e else "-"

        lines.append(
            f"| {r['mode']} | {r['workers']} | {r['conversions_per_hour']:.0f} | {speed} | "
            f"{statistics.median(r['run_s']):.1f} | {pp('status')} | {pp('artifact')} | "
            f"{pp('bundle')} | {pp('metrics')} | {q['all']['count']} "
            f"({q['all']['per_second']}) | {q['all']['failed']} |"
        )
    lines.append("")
    lines += notes(data, by)
    lines += details(runs)
    lines += scaling(data, by)
    lines += burst_lines(data.get("bursts", []))
    MD_PATH.write_text("\n".join(lines) + "\n")
    plot(data)


def notes(data: dict[str, Any], by) -> list[str]:
    runs = data["runs"]
    failed = sum(r["requests"]["all"]["failed"] for r in runs)
    out = [
        f"- **Failures: {failed}** of {sum(r['requests']['all']['count'] for r in runs)} "
        f"requests; {sum(r['succeeded'] for r in runs)} of {sum(r['jobs'] for r in runs)} "
        "conversions succeeded, each in one attempt"
        + (
            "."
            if all(max(r["attempts"]) == 1 for r in runs)
            else " (no: some needed more, see the JSON)."
        ),
        f"- **This machine has {data['machine']['cpus']} cores**, shared with everything: the "
        "conversions (one thread each), the API process, the client threads, PostgreSQL and "
        "Redis in celery mode, and other people's jobs (see the load averages). So 2 workers "
        "can at best double the rate and do not: each conversion runs slower when two run at "
        "once (the run-time column). The latency figures are those of an API sharing 2 busy "
        "cores with two conversions, not of an idle server. Compare the two worker counts "
        "within a mode; across modes the machine's other load differed (the runs went local "
        "then celery while the load average went from "
        f"{data['machine']['load_before'][0]} to {data['machine']['load_after'][0]}), and "
        "celery mode also runs PostgreSQL and Redis on the same cores.",
        "- **The API process's own CPU** during each batch: "
        + ", ".join(
            f"{r['mode']} W={r['workers']} {r['api_cpu_s']:.0f} s in {r['batch_wall_s']:.0f} s "
            f"({r['api_cpu_s'] / r['batch_wall_s']:.2f} core) for "
            f"{r['requests']['all']['count']} requests"
            for r in runs
        )
        + ".",
        "- **The first upload after a server starts is slow** (the warm-up's POST, not "
        "counted: "
        + ", ".join(
            f"{r['mode']} W={r['workers']} {r['warmup_submit_ms']:.0f} ms"
            for r in runs
            if "warmup_submit_ms" in r
        )
        + "; the counted uploads: p50 "
        + ", ".join(f"{r['requests']['submit']['p50_ms']:.0f} ms" for r in runs)
        + "): an uploaded checkpoint is checked by building it with torch in the API process "
        "(`service/server/uploads/checkpoints.py`), which is also why the API's RSS is ~420 MB; "
        "the API imports torch in the background as it starts, and an upload right after the start "
        "still waits for the rest of that import.",
        "",
    ]
    return out


def details(runs) -> list[str]:
    out = ["## Per run", ""]
    out.append(
        "| mode | workers | succeeded / jobs (attempts) | span s | first job started after s | "
        "queue wait s (median / max) | run s (min / median / max) | max ms status / artifact / "
        "bundle / metrics / submit | peak RSS MB (API / API children / worker / pool) | "
        "API CPU s in the batch | DB connections (peak) |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        q, rss = r["requests"], r["peak_rss_mb"]
        maxes = " / ".join(f"{q[e]['max_ms']:.0f}" if e in q else "-" for e in
                           ("status", "artifact", "bundle", "metrics", "submit"))  # fmt: skip
        rss_text = " / ".join(
            f"{rss[k]:.0f}" if k in rss else "-"
            for k in ("api", "api_child", "worker", "worker_child")
        )
        out.append(
            f"| {r['mode']} | {r['workers']} | {r['succeeded']} / {r['jobs']} "
            f"({max(r['attempts'])} max) | {r['span_s']:.0f} | {r['first_start_s']:.1f} | "
            f"{statistics.median(r['wait_s']):.0f} / {max(r['wait_s']):.0f} | "
            f"{min(r['run_s']):.1f} / {statistics.median(r['run_s']):.1f} / "
            f"{max(r['run_s']):.1f} | {maxes} | {rss_text} | {r.get('api_cpu_s', '-')} | "
            f"{(r.get('peak_db_connections') or {}).get('all', '- (SQLite)')} |"
        )
    out.append("")
    stages = runs[0]["stages"]
    if stages:
        out.append(
            "Stage times of one conversion (mean over the run's jobs, from /metrics; "
            f"{runs[0]['mode']}, {runs[0]['workers']} worker, the warm-up job included): "
            + ", ".join(f"{s} {v['mean_s']:.1f} s" for s, v in stages.items())
            + "."
        )
        out.append("")
    return out


def scaling(data: dict[str, Any], by) -> list[str]:
    out = ["## Scaling to N machines (an estimate from these figures)", ""]
    c1, c2 = by.get(("celery", 1)), by.get(("celery", 2))
    if c1 is None or c2 is None:
        return [*out, "(needs both celery runs)", ""]
    j = c1["jobs"]
    run1, run2 = statistics.median(c1["run_s"]), statistics.median(c2["run_s"])
    per_hour1, per_hour2 = c1["conversions_per_hour"], c2["conversions_per_hour"]
    pg = c1["postgres"]
    rows = pg["tup_inserted"] + pg["tup_updated"] + pg["tup_deleted"]
    writes = rows / j
    xacts = pg["xact_commit"]
    api_requests = c1["requests"]["all"]["count"] + c1.get("unrecorded_requests", 0)
    per_request = xacts / api_requests
    api_ms = 1000 * c1["api_cpu_s"] / api_requests
    upload_b = statistics.median(c1["upload_bytes"])
    artifacts_b = c1["data_dir_bytes"]["artifacts"] / j
    files = c1.get("artifact_files", 0) / j
    bundle_b = c1.get("bundle_bytes") or 0
    heartbeat = float(CELERY_SETTINGS["EDGE_UN_HEARTBEAT_S"])
    progress = float(SETTINGS["EDGE_UN_PROGRESS_INTERVAL_S"])
    conns1, conns2 = c1.get("peak_db_connections") or {}, c2.get("peak_db_connections") or {}
    per_worker_conns = conns1.get("worker_child", 0) + conns1.get("worker", 0) or None
    steady = 3600 / run1
    out.append(
        f"- **What one worker does**: `edge-un worker --concurrency 1` (one thread) converted "
        f"this model in {run1:.0f} s (median run time, celery, 1 worker), i.e. ~{steady:.0f} "
        f"conversions/hour back to back; {per_hour1:.0f}/hour measured end to end over the "
        f"batch. **2 workers on this 2-core machine gave {per_hour2:.0f}/hour, "
        f"{per_hour2 / per_hour1:.2f}x** (local mode: "
        + (
            f"{by[('local', 2)]['conversions_per_hour'] / local1:.2f}x"
            if (local1 := by.get(("local", 1), {}).get("conversions_per_hour"))
            and ("local", 2) in by
            else "-"
        )
        + f"). 2x is the ceiling here, and it is not reached: each job's run time grew from "
        f"{run1:.0f} s to {run2:.0f} s because the two conversions, the API process, the "
        f"{data['clients']} client threads, PostgreSQL, Redis and other people's jobs all share "
        "the same 2 cores. Conversions are CPU-bound and share nothing but the database and the "
        "volume, so N machines with one worker per core should give about N x cores x "
        f"{steady:.0f}/hour; each worker needs ~1 GB of RAM while it converts (peak RSS of a "
        f"pool process: {c1['peak_rss_mb'].get('worker_child', float('nan')):.0f} MB, plus "
        f"{c1['peak_rss_mb'].get('worker', float('nan')):.0f} MB for the worker itself)."
    )
    out.append(
        f"- **What the database sees per conversion** (PostgreSQL's own counters, "
        f"`pg_stat_database`, over the celery 1-worker batch of {j}): **{writes:.0f} rows "
        f"written** ({pg['tup_inserted']} inserted, {pg['tup_updated']} updated, "
        f"{pg['tup_deleted']} deleted in all; the counters are reset after the warm-up job, "
        "but a backend reports its counts up to about a second late, so some of the warm-up's "
        "writes may be in them). From the code: 5 fixed writes (the job's "
        "insert, `mark_dispatched`, the claim, `set_pid`, the outcome), one `job_stages` row "
        f"per stage ({len(c1['stages'])}), a heartbeat every {heartbeat:g} s "
        f"(~{run1 / heartbeat:.0f} per run), a progress write at each new stage and at most every"
        f" {progress:g} s. The API's reconciler reads once every {heartbeat:g} s whatever the "
        f"load. **Reads come from the clients**: {xacts} transactions for {api_requests} API "
        f"requests, ~{per_request:.1f} per request (a status poll opens two sessions, its token "
        "then the job, and each checkout's pre-ping, `pool_pre_ping=True`, most likely counts "
        "as a transaction of its own; a poll is a read, not a write). Connections: "
        + (
            f"at most {conns1.get('all')} in all with 1 worker and {conns2.get('all')} with 2 "
            f"(sampled every 0.5 s, per process: the API {conns1.get('api')}, "
            f"a worker {conns1.get('worker', 0)} and its pool process "
            f"{conns1.get('worker_child', 0)} while converting)"
            if per_worker_conns is not None
            else "not measured"
        )
        + "."
    )
    out.append(
        f"- **What the shared volume sees per conversion**: {upload_b / 1e3:.0f} kB uploaded "
        f"(written by the API, read by the worker, deleted when the job ends) and "
        f"{artifacts_b / 1e3:.0f} kB of artifacts in {files:.0f} files written by the worker, "
        "each fsync'd, then a manifest, a rename into place and a directory fsync; every "
        f"bundle.zip download writes (and deletes) a {bundle_b / 1e3:.0f} kB zip in the data "
        "directory's tmp/, reading every artifact, so downloads, not conversions, can dominate "
        "the volume's writes."
    )
    rows_out = []
    for n in (1, 10, 100):
        rate = n * steady  # n workers converting back to back
        rows_out.append(
            f"| {n} | ~{rate:.0f} | ~{rate * writes / 3600:.1f} | "
            f"~{rate * (upload_b + artifacts_b) / 3600 / 1e3:.0f} | "
            f"~{rate / 3600 * run1 * (per_worker_conns or 2):.0f} |"
        )
    out += [
        "",
        f"Extrapolated, N workers (one per core, {run1:.0f} s per conversion, as the 1-worker "
        "run here; client polling not included):",
        "",
        "| workers | conversions/hour | row writes/s | volume writes kB/s (uploads + artifacts) "
        "| database connections held by workers |",
        "|---|---|---|---|---|",
        *rows_out,
        "",
        "**What would limit it**, in the order we expect it (not measured beyond 2 workers on "
        "one machine): (1) the workers' CPU, linearly: add machines; (2) PostgreSQL's "
        "connections before its writes: "
        f"{writes:.0f} row writes per conversion is ~{100 * steady * writes / 3600:.0f} writes/s "
        "at 100 workers, little for one PostgreSQL, but 100 workers hold ~"
        f"{100 * (per_worker_conns or 1)}-200 connections (1 seen per converting pool process; "
        "2 when its heartbeat thread and a progress write overlap) and each API process's pool "
        "up to 15 (SQLAlchemy's default 5 + 10; 9 seen here with 8 clients), past the default "
        f"`max_connections` of 100: beyond ~40-{(100 - 15) // (per_worker_conns or 1)} workers "
        "with one API process, a PgBouncer in front or a larger `max_connections`; (3) the "
        "clients' polling: "
        f"every API request is ~{per_request:.1f} database transactions and ~{api_ms:.1f} ms of "
        "API CPU here (the mean over every request of the run, uploads and bundle zips "
        "included), so 1000 clients polling once a second need several API processes (stateless:"
        " they share the database and the volume) and send the database more reads than the "
        "workers send writes; (4) the shared volume: a few MB/s of writes even at 100 workers, "
        "but per conversion ~"
        f"{files + 2:.0f} fsyncs and a rename, and a zip per bundle download: on NFS the "
        "metadata and fsync latency, and the bundle writes, matter before the bandwidth does. "
        "Redis carries one small message per conversion (the job id): not a limit.",
        "",
    ]
    return out


def plot(data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = data["runs"]
    endpoints = [e for e in ("status", "artifact", "bundle", "metrics", "submit")
                 if any(e in r["requests"] for r in runs)]  # fmt: skip
    columns = (len(endpoints) + 2) // 2
    fig, grid = plt.subplots(2, columns, figsize=(4.6 * columns, 8))
    axes = list(grid.flat)
    labels = [f"{r['mode']}\nW={r['workers']}" for r in runs]
    styles = {("local", 1): ("tab:blue", "-"), ("local", 2): ("tab:blue", "--"),
              ("celery", 1): ("tab:orange", "-"), ("celery", 2): ("tab:orange", "--")}  # fmt: skip
    for ax, endpoint in zip(axes, endpoints, strict=False):
        for r in runs:
            e = r["requests"].get(endpoint)
            if e is None:
                continue
            color, line = styles.get((r["mode"], r["workers"]), ("gray", ":"))
            ax.plot(range(101), e["quantiles_ms"], color=color, linestyle=line,
                    label=f"{r['mode']} W={r['workers']} (n={e['count']})")  # fmt: skip
        ax.set_yscale("log")
        ax.set_xlabel("percentile", fontsize=8)
        ax.set_title(f"{endpoint}: latency (ms) by percentile", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(endpoints) : -1]:
        ax.set_visible(False)
    ax = axes[-1]
    colors = ["tab:blue" if r["mode"] == "local" else "tab:orange" for r in runs]
    bars = ax.bar(range(len(runs)), [r["conversions_per_hour"] for r in runs], color=colors)
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(runs)), labels, fontsize=8)
    ax.set_title("conversions per hour", fontsize=9)
    fig.suptitle(
        f"edge-un service under load: {data['jobs']} conversions per run, "
        f"{data['clients']} polling clients, {data['machine']['cpus']} shared cores",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(PNG_PATH, dpi=110)
    plt.close(fig)


# -- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 jobs per run, 4 clients")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--jobs", type=int, help="conversions per run (default 6, quick 2)")
    parser.add_argument("--clients", type=int, help="client threads (default 8, quick 4)")
    parser.add_argument("--think-ms", type=float, default=100.0)
    parser.add_argument("--fast-upload", action="store_true", help="upload_fast, not the ckpt")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--burst", type=int, default=20, help="clients of the burst (0: none)")
    parser.add_argument("--burst-only", action="store_true",
                        help="only the burst, kept beside the JSON's batch runs")  # fmt: skip
    args = parser.parse_args(argv)
    if args.report_only:
        report(json.loads(JSON_PATH.read_text()))
        return
    jobs = args.jobs or (2 if args.quick else 6)
    clients = args.clients or (4 if args.quick else 8)
    modes = [m for m in args.modes.split(",") if m]

    # a SIGTERM/SIGHUP must run the finally blocks that stop every server started here
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda number, frame: sys.exit(128 + number))
    started = datetime.now(UTC)
    t0 = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    scratch = Path(tempfile.mkdtemp(prefix="edge-un-service-load-"))
    atexit.register(shutil.rmtree, scratch, True)
    if args.fast_upload:
        fast_job_files()
    postgres = redis = None
    runs, bursts = [], []
    try:
        if "celery" in modes:
            postgres, redis = PostgresServer(PG_BIN), RedisServer(shutil.which("redis-server"))
            postgres.start()
            redis.start()
        for name in modes:
            mode = ServiceMode(name, postgres, redis)
            if args.burst:
                print(f"{name}: a burst of {args.burst} uploads ...", flush=True)
                bursts.append(run_burst(mode, args.burst, scratch))
                print(f"  {bursts[-1]}", flush=True)
            for workers in () if args.burst_only else WORKER_COUNTS:
                print(f"{name}, {workers} worker(s): {jobs} jobs ...", flush=True)
                run = run_one(mode, workers, jobs, clients, args.think_ms / 1000,
                              args.fast_upload, scratch)  # fmt: skip
                q = run["requests"]
                print(
                    f"  {run['conversions_per_hour']:.0f}/hour, {run['succeeded']}/{jobs} "
                    f"succeeded, status p50/p99 {q['status']['p50_ms']}/"
                    f"{q['status']['p99_ms']} ms, {q['all']['count']} requests, "
                    f"{q['all']['failed']} failed, {run['wall_s']:.0f} s",
                    flush=True,
                )
                runs.append(run)
    finally:
        for server in (postgres, redis):
            if server is not None:
                server.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    lost = any(b["succeeded"] != b["clients"] for b in bursts)
    if args.burst_only:
        data = json.loads(JSON_PATH.read_text()) | {"bursts": bursts}
        JSON_PATH.write_text(json.dumps(data, indent=1) + "\n")
        report(data)
        if lost:
            sys.exit("a conversion of the burst did not succeed")
        return
    data = {
        "started": started.strftime("%Y-%m-%d %H:%M:%S"),
        "elapsed_s": round(time.monotonic() - t0, 1),
        "quick": args.quick,
        "jobs": jobs,
        "clients": clients,
        "think_ms": args.think_ms,
        "fast_upload": args.fast_upload,
        "settings": SETTINGS,
        "celery_settings": CELERY_SETTINGS,
        "machine": {
            "cpus": os.cpu_count(),
            "arch": platform.machine(),
            "python": platform.python_version(),
            "load_before": load_before,
            "load_after": [round(x, 2) for x in os.getloadavg()],
        },
        "runs": runs,
        "bursts": bursts,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    JSON_PATH.write_text(json.dumps(data, indent=1) + "\n")
    report(data)
    print(f"wrote {JSON_PATH.relative_to(ROOT)}, {MD_PATH.name}, {PNG_PATH.name}")
    failed = sum(r["requests"]["all"]["failed"] for r in runs)
    if failed or lost or any(r["succeeded"] != r["jobs"] for r in runs):
        sys.exit(f"{failed} request(s) failed or a conversion did not succeed")


if __name__ == "__main__":
    main()
