"""Fair share between tokens against a real server, in both queue modes: one token's queued
jobs do not hold back another token's job (jobs start in turns between tokens), and a token
may have only EDGE_UN_MAX_QUEUED jobs waiting: one more is a 429 problem with Retry-After,
while another token's upload is still accepted. (The order itself, on SQLite and PostgreSQL:
tests/test_service_steps.py.)"""

from __future__ import annotations

from testbed.live import ServiceMode, fast_job_files, upload_fast, wait_for

from .service_live import hold_hook, is_problem


def test_a_tokens_queue_is_capped_and_does_not_hold_back_another_tokens_job(
    tmp_path, service_mode: ServiceMode
):
    """One worker, held by the first job (a test hook keeps every job process at its first
    stage): alice's two more jobs fill her queue, bob's job comes after them; when alice's
    running job is cancelled, the worker takes bob's job next, not hers."""
    fast_job_files()
    env, hold = hold_hook(tmp_path / "hook")  # a started job waits while `hold` exists
    server = service_mode.server(
        tmp_path / "data", EDGE_UN_WORKERS="1", EDGE_UN_MAX_QUEUED="2", **env
    ).start()
    try:
        with (
            server.client(server.token("alice")) as alice,
            server.client(server.token("bob")) as bob,
        ):
            first = upload_fast(alice).json()["id"]
            wait_for(alice, first, ("running",))  # and held there: the one worker is busy
            waiting = [upload_fast(alice).json()["id"] for _ in range(2)]
            over = upload_fast(alice)
            refused = is_problem(over, 429)
            assert "EDGE_UN_MAX_QUEUED=2" in refused["detail"], refused
            assert refused["title"] == "Too many queued jobs"
            assert over.headers["retry-after"] == "60"
            listing = alice.get("/v1/conversions").json()
            assert listing["total"] == 3  # nothing of the refused upload was kept
            theirs = upload_fast(bob)  # another token's queue: accepted
            assert theirs.status_code == 202, theirs.text
            assert alice.post(f"/v1/conversions/{first}/cancel").status_code == 200
            started = wait_for(bob, theirs.json()["id"], ("running",), timeout=120)
            # bob's job, queued after alice's two, started before either of them
            for job_id in waiting:
                job = alice.get(f"/v1/conversions/{job_id}").json()
                assert (job["state"], job["started_at"]) == ("queued", None), job
            first_run = alice.get(f"/v1/conversions/{first}").json()
            assert first_run["started_at"] < started["started_at"]
            for client, job_id in [(bob, started["id"]), *((alice, i) for i in waiting)]:
                client.post(f"/v1/conversions/{job_id}/cancel")  # no need to convert them
    finally:
        hold.unlink(missing_ok=True)
        server.stop()
