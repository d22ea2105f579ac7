"""20 clients upload at once (20 threads, 20 tokens): every job is accepted once, runs once and
succeeds; none is lost or duplicated, and each client sees exactly its own job.

Marked ``slow`` (20 conversions, 2 at a time, about a minute per queue mode on 2 cores alone):
``.ci/run`` runs it after the default suite, and ``benchmarks.service.service_load --burst 20``
times the same burst (``testbed.burst``)."""

from __future__ import annotations

import pytest

from testbed.burst import concurrent_uploads

CLIENTS = 20

pytestmark = pytest.mark.slow


def test_twenty_concurrent_uploads_all_complete_once(tmp_path, service_mode):
    server = service_mode.server(tmp_path / "data", EDGE_UN_WORKERS="2").start()
    try:
        burst = concurrent_uploads(server, CLIENTS)
    finally:
        server.stop()
    assert [run.status for run in burst.clients] == [202] * CLIENTS
    assert len(set(burst.job_ids)) == CLIENTS
    for run in burst.clients:
        assert run.job["state"] == "succeeded" and run.job["attempts"] == 1, run.job
        assert run.listed == [run.job["id"]]  # each client sees its own job, only it
    assert f'edge_un_jobs{{state="succeeded"}} {CLIENTS:.1f}' in burst.metrics
    assert "edge_un_queue_depth 0.0" in burst.metrics
    print(f"{CLIENTS} concurrent conversions in {burst.seconds:.0f} s")
