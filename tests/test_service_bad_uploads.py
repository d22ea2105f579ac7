"""The upload corpus (tests/upload_corpus.py) over HTTP against a real server: each bad upload
gets its own status and problem+json detail, no payload ever runs, nothing is kept, and the
server keeps serving throughout; each good upload is accepted (then cancelled)."""

from __future__ import annotations

import time

from .service_live import is_problem
from .upload_corpus import CASE_NAMES, bad_cases, good_cases

LIMIT_MB = 8  # above every bundled example (the largest is ~2.5 MB)
SERVER_ENV = {"EDGE_UN_MAX_UPLOAD_MB": str(LIMIT_MB)}  # the conftest's server, client


def _send(client, case):
    return client.post("/v1/conversions", files=case.parts(), data=case.form)


def test_every_bad_upload_is_refused_with_its_reason(client, server, tmp_path):
    cases = bad_cases(tmp_path, LIMIT_MB * 1024 * 1024)
    assert [c.name for c in cases] == list(CASE_NAMES)
    wrong = []
    for case in cases:
        answer = _send(client, case)
        if answer.status_code != case.status or not answer.headers["content-type"].startswith(
            "application/problem+json"
        ):
            wrong.append((case.name, answer.status_code, answer.text[:300]))
            continue
        body = is_problem(answer, case.status)
        if case.fragment not in body["detail"].lower():
            wrong.append((case.name, case.fragment, body["detail"]))
        assert case.marker is None or not case.marker.exists(), f"{case.name}: the payload ran"
        assert client.get("/readyz").status_code == 200, f"not serving after {case.name}"
    assert not wrong, wrong
    assert client.get("/v1/conversions").json()["total"] == 0
    assert list((server.data_dir / "uploads").iterdir()) == []
    assert " 500 " not in server.log()


def test_every_good_upload_is_accepted(client, server, tmp_path):
    for case in good_cases(tmp_path):
        answer = _send(client, case)
        assert answer.status_code == 202, (case.name, answer.text)
        cancelled = client.delete(f"/v1/conversions/{answer.json()['id']}")
        assert cancelled.json()["state"] == "cancelled"
    deadline = time.monotonic() + 20  # the queue cleans up after a stopped job process
    while list((server.data_dir / "uploads").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list((server.data_dir / "uploads").iterdir()) == []
