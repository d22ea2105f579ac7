"""20 clients upload at once (20 threads, 20 tokens): every job is accepted once, runs once and
succeeds; none is lost or duplicated, and each client sees exactly its own job."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from testbed.live import fast_job_files, upload_fast, wait_for

CLIENTS = 20


def test_twenty_concurrent_uploads_all_complete_once(tmp_path, service_mode):
    # ~45 s on the loaded 2-core machine (20 conversions, 2 at a time): not marked slow
    fast_job_files()  # build the inputs before the clock starts
    server = service_mode.server(tmp_path / "data", EDGE_UN_WORKERS="2").start()
    try:
        secrets = [server.token(f"client-{i}") for i in range(CLIENTS)]
        started = time.monotonic()

        def client_run(secret: str) -> tuple[str, dict]:
            with server.client(secret) as client:
                response = upload_fast(client)
                assert response.status_code == 202, response.text
                job = wait_for(client, response.json()["id"], ("succeeded",), timeout=900)
                mine = client.get("/v1/conversions").json()
                assert [j["id"] for j in mine["items"]] == [job["id"]]
                return secret, job

        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(client_run, secrets))
        elapsed = time.monotonic() - started
        ids = [job["id"] for _, job in results]
        assert len(set(ids)) == CLIENTS
        assert all(job["attempts"] == 1 for _, job in results)
        metrics = server.client().get("/metrics").text
        assert f'edge_un_jobs{{state="succeeded"}} {CLIENTS:.1f}' in metrics
        assert "edge_un_queue_depth 0.0" in metrics
        print(f"{CLIENTS} concurrent conversions in {elapsed:.0f} s")
    finally:
        server.stop()
