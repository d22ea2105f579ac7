"""Celery mode: how long a job takes to recover from a worker killed (kill -9 of its whole
process group) in each window of its run, and whether any job is lost, stuck or built twice
when workers are killed at random moments.

    .venv/bin/python -m benchmarks.service.fault_recovery                # ~30 min on 2 cores
    # Markdown and plot from the JSON
    .venv/bin/python -m benchmarks.service.fault_recovery --report-only

Real servers, started as the service's tests start them (``testbed``): PostgreSQL, Redis, the
API in Celery mode and two ``edge-un worker --concurrency 1`` (heartbeat HEARTBEAT_S, so a lease
of 3 beats; the tests' quick settings otherwise: one math thread per job process, 3 latency
runs). The job is the tests' quick one (``testbed.live.upload_fast``: the bundled UN ViT as a
folded fp32 ONNX file, target cpu).

- Undisturbed: a warm-up job, then UNDISTURBED jobs one at a time: their wall time
  (``finished_at - created_at``), the cpu target's build (claimed to ended) and artifacts.
- Each window (``testbed.faults.WINDOWS``: the prepare, target or report step sent to a worker
  but not started, or running), WINDOW_REPEATS times: one job, and the worker holding its run
  there killed (a test-only pause holds it there until the kill); the killed worker is started
  again for the next job. Recovery: the job's wall time minus the undisturbed median (what the
  kill cost it), beside the time from the kill to the job's end. The goal: at most 2 leases
  plus the target's own build time.
- Random kills: RANDOM_RUNS runs of RANDOM_JOBS jobs submitted at once, one worker (chosen at
  random) killed at a random moment of the run (uniform over an undisturbed run's makespan),
  then started again. Each job must succeed with the undisturbed artifacts (sha256); none lost
  or stuck (not succeeded within STUCK_S), no target built twice (two builds that both ended
  well, from the workers' logs).

Writes benchmarks/results/fault_recovery.json, .md and .png.
"""

from __future__ import annotations

import os
import platform
import random
import re
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from sqlalchemy import select

from benchmarks.common.results import benchmark_main, git_commit, save_figure
from service.db import Job, JobTarget, Worker, session_scope
from testbed.faults import WINDOWS, Pauses, kill_in, pause_env
from testbed.live import LiveServer, fast_job_files, upload_fast, wait_for
from testbed.servers import PostgresServer, RedisServer

NAME = "fault_recovery"
HEARTBEAT_S = 2.0
UNDISTURBED = 2
WINDOW_REPEATS = 2
RANDOM_RUNS, RANDOM_JOBS = 20, 4
STUCK_S = 600.0
BUILT = re.compile(r"'job (\w+) attempt \d+ target (\w+) build \d+: exit code 0'")


def artifacts(client, job_id: str) -> dict[str, str]:
    """The built files (name -> sha256) as the job's report lists them; none without one."""
    answer = client.get(f"/v1/conversions/{job_id}/report")
    if answer.status_code != 200:
        return {}
    targets = answer.json()["targets"].values()
    return {a["name"]: a["sha256"] for t in targets for a in t["artifacts"]}


def ended(client, job_id: str) -> bool:
    """Wait for the job to succeed; False if it did not (failed, or stuck for STUCK_S)."""
    try:
        wait_for(client, job_id, ("succeeded",), timeout=STUCK_S)
    except AssertionError:
        return False
    return True


def record(server: LiveServer, job_id: str) -> dict[str, Any]:
    """A finished job's times from its records."""
    with session_scope(server.settings) as session:
        job = session.scalar(select(Job).where(Job.id == job_id))
        builds = session.scalars(select(JobTarget).where(JobTarget.job_id == job_id)).all()
        return {
            "id": job_id,
            "state": job.state,
            "created": job.created_at.timestamp(),
            "finished": job.finished_at.timestamp() if job.finished_at else None,
            "wall_s": (job.finished_at - job.created_at).total_seconds()
            if job.finished_at
            else None,
            "attempts": job.attempts,
            "build_s": {b.name: (b.updated_at - b.started_at).total_seconds() for b in builds},
            "target_attempts": {b.name: b.attempts for b in builds},
        }


def one_job(server: LiveServer, token: str) -> dict[str, Any]:
    with server.client(token) as client:
        job_id = upload_fast(client).json()["id"]
        wait_for(client, job_id, ("succeeded",), timeout=STUCK_S)
        return {**record(server, job_id), "artifacts": artifacts(client, job_id)}


def two_workers(server: LiveServer) -> None:
    assert server.backend is not None
    server.backend.ensure_workers(2, server._environ(), server.data_dir.parent)


def killed_in(server: LiveServer, token: str, pauses: Pauses, window: str) -> dict[str, Any]:
    """One job whose worker is killed in ``window``, after an undisturbed one (its pair: the
    host's other work changes over a run of the benchmark)."""
    two_workers(server)
    pair = one_job(server, token)["wall_s"]
    with server.client(token) as client:
        job_id, killed = kill_in(server, pauses, window, lambda: upload_fast(client).json()["id"])
        ended(client, job_id)
        job = {**record(server, job_id), "artifacts": artifacts(client, job_id)}
    end = job["finished"] if job["state"] == "succeeded" else None
    return {**job, "window": window, "kill_to_end_s": end - killed if end else None,
            "undisturbed_pair_s": pair}  # fmt: skip


def held_by(server: LiveServer, name: str) -> list:
    """What the worker ``name`` said it held at its last beat."""
    with session_scope(server.settings) as session:
        rows = session.scalars(select(Worker).where(Worker.name.startswith(f"{name}@"))).all()
        return [held for row in rows for held in row.held]


def random_run(server: LiveServer, token: str, seed: int, makespan: float) -> dict[str, Any]:
    """RANDOM_JOBS jobs at once, a random worker killed at a random moment."""
    rng = random.Random(seed)
    two_workers(server)
    with server.client(token) as client:
        start = time.time()
        ids = [upload_fast(client).json()["id"] for _ in range(RANDOM_JOBS)]
        time.sleep(rng.uniform(0, makespan))
        victim = rng.choice(server.workers)
        held = held_by(server, victim.name)
        victim.kill()
        killed = time.time()
        two_workers(server)
        jobs, stuck = [], []
        for job_id in ids:
            if not ended(client, job_id):
                stuck.append(job_id)
            jobs.append({**record(server, job_id), "artifacts": artifacts(client, job_id)})
    ends = [j["finished"] for j in jobs if j["finished"]]
    return {
        "seed": seed,
        "kill_at_s": killed - start,
        "held": held,
        "stuck": stuck,
        "makespan_s": max(ends) - start if ends else None,
        "jobs": jobs,
    }


def duplicate_builds(scratch: Path) -> int:
    """Targets built well more than once, from every worker's log (the killed ones' too)."""
    built = Counter()
    for log in scratch.glob("worker-*.log"):
        built.update(BUILT.findall(log.read_text(errors="replace")))
    return sum(count - 1 for count in built.values() if count > 1)


def run() -> dict[str, Any]:
    fast_job_files()
    scratch = Path(tempfile.mkdtemp(prefix="edge-un-faults-"))
    postgres, redis = PostgresServer(), RedisServer(shutil.which("redis-server") or "redis-server")
    postgres.start()
    redis.start()
    pauses = Pauses(scratch / "pause")
    server = LiveServer(
        scratch / "data", "celery", postgres, redis, EDGE_UN_WORKERS="2",
        EDGE_UN_HEARTBEAT_S=str(HEARTBEAT_S), **pause_env(scratch / "pause"),
    )  # fmt: skip
    try:
        server.start()
        token = server.token()
        one_job(server, token)  # warm-up
        alone = [one_job(server, token) for _ in range(UNDISTURBED)]
        reference = alone[0]["artifacts"]
        with server.client(token) as client:  # an undisturbed run of the random runs' size
            start = time.time()
            ids = [upload_fast(client).json()["id"] for _ in range(RANDOM_JOBS)]
            for job_id in ids:
                wait_for(client, job_id, ("succeeded",), timeout=STUCK_S)
            makespan = max(record(server, i)["finished"] for i in ids) - start
        windows = [
            killed_in(server, token, pauses, window)
            for window in WINDOWS
            for _ in range(WINDOW_REPEATS)
        ]
        randoms = [random_run(server, token, seed, makespan) for seed in range(RANDOM_RUNS)]
        duplicates = duplicate_builds(scratch)
    finally:
        pauses.disarm()
        pauses.release()
        server.stop()
        postgres.cleanup()
        redis.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    settings = server.settings
    return {
        "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        "(shared with other work)",
        "when": time.strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "settings": {
            "heartbeat_s": settings.heartbeat_s,
            "lease_s": settings.lease_s,
            "workers": 2,
            "concurrency": 1,
            "targets": "cpu",
        },
        "undisturbed": alone,
        "undisturbed_wall_s": statistics.median(j["wall_s"] for j in alone),
        "undisturbed_build_s": statistics.median(j["build_s"]["cpu"] for j in alone),
        "undisturbed_makespan_s": makespan,
        "windows": windows,
        "random": randoms,
        "duplicate_builds": duplicates,
        "same_artifacts": all(
            j["artifacts"] == reference
            for j in [*alone, *windows, *(j for r in randoms for j in r["jobs"])]
        ),
    }


def _delay(results: dict[str, Any], job: dict[str, Any]) -> float:
    """What the kill cost the job (infinite: it did not succeed)."""
    if job["state"] != "succeeded":
        return float("inf")
    return job["wall_s"] - job.get("undisturbed_pair_s", results["undisturbed_wall_s"])


def bound(results: dict[str, Any]) -> float:
    return 2 * results["settings"]["lease_s"] + results["undisturbed_build_s"]


def markdown(results: dict[str, Any]) -> str:
    limit = bound(results)
    rows = []
    for window in WINDOWS:
        jobs = [j for j in results["windows"] if j["window"] == window]
        delays = ", ".join(f"{_delay(results, j):.1f}" for j in jobs)
        to_end = ", ".join(
            f"{j['kill_to_end_s']:.1f}" if j["kill_to_end_s"] else j["state"] for j in jobs
        )
        runs = ", ".join(f"{j['attempts']}/{j['target_attempts']['cpu']}" for j in jobs)
        ok = "yes" if max(_delay(results, j) for j in jobs) <= limit else "**no**"
        rows.append(f"| {window} | {delays} | {to_end} | {runs} | {ok} |")
    randoms = results["random"]
    jobs = [j for r in randoms for j in r["jobs"]]
    stuck = sum(len(r["stuck"]) for r in randoms)
    succeeded = sum(j["state"] == "succeeded" for j in jobs)
    extra = [r["makespan_s"] - results["undisturbed_makespan_s"] for r in randoms]
    held = Counter(h[0] for r in randoms for h in r["held"]) or {"nothing": 0}
    s = results["settings"]
    return "\n".join([
        "# Recovery from a killed Celery worker, window by window",
        "",
        f"`python -m benchmarks.service.fault_recovery` at {results['commit']}, {results['when']}, "
        f"{results['host']}; heartbeat {s['heartbeat_s']:g} s, lease {s['lease_s']:g} s "
        f"(3 beats), {s['workers']} workers of concurrency {s['concurrency']}, target "
        f"{s['targets']}.",
        "",
        f"Undisturbed job: {results['undisturbed_wall_s']:.1f} s (median of "
        f"{len(results['undisturbed'])}), its cpu target's build "
        f"{results['undisturbed_build_s']:.1f} s. Goal per window: recovery at most 2 leases "
        f"+ the target's build = **{limit:.1f} s**.",
        "",
        "| window (worker killed) | recovery: job's time - its undisturbed pair's (s) | "
        "kill to job's end (s) | job runs / cpu builds | within the goal |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Random kills: {len(randoms)} runs of {RANDOM_JOBS} jobs at once, one worker killed "
        f"at a random moment of each (what the killed workers held: "
        f"{', '.join(f'{k} {v}' for k, v in sorted(held.items()))}): "
        f"**{succeeded} of {len(jobs)} jobs succeeded, {stuck} lost or stuck, "
        f"{results['duplicate_builds']} targets built twice**; each run's makespan less one "
        f"undisturbed run's ({results['undisturbed_makespan_s']:.1f} s): median "
        f"{statistics.median(extra):.1f} s, at most {max(extra):.1f} s (against a single "
        "reference run on a shared host: a bound on the delay, not a timing). Every "
        f"job's artifacts (sha256) equal an undisturbed run's: "
        f"{'yes' if results['same_artifacts'] else '**no**'}.",
        "",
    ])  # fmt: skip


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.2))
    names = list(WINDOWS)
    for index, window in enumerate(names):
        delays = [_delay(results, j) for j in results["windows"] if j["window"] == window]
        delays = [d for d in delays if d != float("inf")]  # (the table says which failed)
        axis.scatter([index] * len(delays), delays, color="tab:blue", zorder=3)
    axis.axhline(bound(results), color="tab:red", linestyle="--", label="2 leases + build")
    axis.set_xticks(range(len(names)), names, rotation=20, ha="right")
    axis.set_ylabel("recovery (s)")
    axis.set_title(f"a worker killed in each window (lease {results['settings']['lease_s']:g} s)")
    axis.legend()
    save_figure(figure, NAME)


if __name__ == "__main__":
    benchmark_main(NAME, __doc__, run, markdown, plot)
