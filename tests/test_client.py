"""service.client.Client and ``edge-un submit / jobs / status / download / cancel`` against a
real server (testbed.live, local queue mode: the client only speaks HTTP, and the
end-to-end tests cover both queue modes), plus the retry policy on a scripted transport.

The acceptance of issue 21: one command, ``edge-un submit MODEL --wait --download DIR``, gives
the files and the summary ``convert`` gives, every file checked against the report's sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from edge_un import examples
from service.client import Client, ServiceError
from service.schemas import JobOut
from testbed.live import ROOT, LiveServer, ServiceMode, fast_job_files, wait_for

from .service_live import hold_hook, is_problem
from .test_cli import ANSI, run_in_terminal

MODEL = examples.path("vit-mnist-un")
SERVER_ENV = {"EDGE_UN_WORKERS": "1"}  # the conftest's server, token


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def service_mode() -> ServiceMode:
    """The conftest's server in the local queue mode only (the client only speaks HTTP)."""
    return ServiceMode("local")


@pytest.fixture(scope="module")
def finished(server: LiveServer, token: str) -> tuple[JobOut, list[JobOut]]:
    """One conversion through the client (the fast ONNX job), and what wait() reported."""
    files = fast_job_files()
    seen: list[JobOut] = []
    with Client(server.url, token) as client:
        job = client.submit(files["model"], targets=["cpu"], calib=files["calib"],
                            eval=files["eval"])  # fmt: skip
        assert job.state == "queued" and job.targets == ["cpu"]
        return client.wait(job.id, progress=seen.append, interval_s=0.2, timeout_s=300), seen


class Recording(httpx.HTTPTransport):
    """The real transport, remembering each request's Range header."""

    def __init__(self) -> None:
        super().__init__()
        self.ranges: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.ranges.append(request.headers.get("range"))
        return super().handle_request(request)


def test_client_waits_then_downloads_every_file_checked(server, token, finished, tmp_path):
    job, seen = finished
    assert job.state == "succeeded", job.error
    assert seen[-1] == job and job.percent == 100
    percents = [j.percent for j in seen]
    assert percents == sorted(percents), "progress went backwards"
    transport = Recording()
    with Client(server.url, token, transport=transport) as client:
        report = client.report(job.id)
        listing = {a.name: a.sha256 for a in client.artifacts(job.id)}
        paths = client.download(job.id, tmp_path)
        reported = {a.name: a.sha256 for t in report.targets.values() for a in t.artifacts}
        assert {p.relative_to(tmp_path).as_posix() for p in paths} == set(listing)
        assert set(reported) <= set(listing) and {"report.json", "report.md"} <= set(listing)
        for path in paths:
            name = path.relative_to(tmp_path).as_posix()
            assert sha256(path) == listing[name] == reported.get(name, listing[name])

        # an interrupted download resumes from where it stopped (Range), and is checked
        int8 = tmp_path / "cpu" / "model_int8.onnx"
        whole = int8.read_bytes()
        int8.unlink()
        (tmp_path / "cpu" / "model_int8.onnx.part").write_bytes(whole[:1000])
        transport.ranges.clear()
        client.download(job.id, tmp_path, names=["cpu/model_int8.onnx"])
        assert "bytes=1000-" in transport.ranges and int8.read_bytes() == whole
        # a part that is not the start of this file fails the digest, and is removed
        int8.unlink()
        (tmp_path / "cpu" / "model_int8.onnx.part").write_bytes(b"\0" * 1000)
        with pytest.raises(ServiceError, match="sha256"):
            client.download(job.id, tmp_path, names=["cpu/model_int8.onnx"])
        assert not (tmp_path / "cpu" / "model_int8.onnx.part").exists()
        assert client.download(job.id, tmp_path, names=["cpu/model_int8.onnx"]) == [int8]
        assert int8.read_bytes() == whole
        assert "<svg" in client.report_html(job.id)
        assert client.jobs().items[0].id == job.id
        assert [j.id for j in client.all_jobs()] == [j.id for j in client.jobs(limit=100).items]


def test_errors_carry_the_servers_detail(server, token, finished):
    job, _ = finished
    with Client(server.url, token) as client:
        with pytest.raises(ServiceError) as error:
            client.job("no-such-job")
        assert error.value.status == 404 and error.value.problem is not None
        assert "GET /v1/conversions lists yours" in str(error.value)
        with pytest.raises(ServiceError) as error:
            client.submit(MODEL, targets="cpu,npu9000")
        assert error.value.status == 422 and "npu9000" in error.value.detail
        with pytest.raises(ServiceError, match="already succeeded") as error:
            client.cancel(job.id)
        assert error.value.status == 409
    for address in ("not-a-url", "127.0.0.1:8000", "ftp://host/"):  # refused, never retried
        with pytest.raises(ServiceError, match="is not a service address: give http://"):
            Client(address, token)
    with Client(server.url, "eun_not-a-token") as stranger, pytest.raises(ServiceError) as error:
        stranger.job(job.id)
    assert error.value.status == 401 and "unknown or revoked" in error.value.detail
    with Client(server.url, server.token("other")) as other, pytest.raises(ServiceError) as error:
        other.report(job.id)  # another token's job does not exist for it
    assert error.value.status == 404


def test_cancel_a_running_job(server, token):
    files = fast_job_files()
    with Client(server.url, token) as client:
        job = client.submit(files["model"], targets="cpu", calib=files["calib"],
                            eval=files["eval"])  # fmt: skip
        cancelled = client.cancel(job.id)
        assert cancelled.state == "cancelled" and cancelled.id == job.id
        assert client.wait(job.id, timeout_s=60).state == "cancelled"


def test_cancel_never_deletes_a_finished_job(server, token, finished):
    """POST /v1/conversions/{id}/cancel of a finished job: a 409 naming its state, and the job
    and its files as they were (DELETE, which the client used to cancel with, removes both
    when the job finishes between a look at its state and the request)."""
    job, _ = finished
    with server.client(token) as api:
        files = api.get(f"/v1/conversions/{job.id}/artifacts").json()
        refused = is_problem(api.post(f"/v1/conversions/{job.id}/cancel"), 409)
        assert refused["detail"] == f"the conversion {job.id} already succeeded: nothing to cancel"
        still = api.get(f"/v1/conversions/{job.id}")
        assert still.status_code == 200 and still.json()["state"] == "succeeded", still.text
        assert api.get(f"/v1/conversions/{job.id}/artifacts").json() == files
        int8 = api.get(f"/v1/conversions/{job.id}/artifacts/cpu/model_int8.onnx")
        assert int8.status_code == 200 and int8.content
        is_problem(api.post("/v1/conversions/no-such-job/cancel"), 404)
    with server.client(server.token("stranger")) as other:  # another token's job: not found
        is_problem(other.post(f"/v1/conversions/{job.id}/cancel"), 404)
    with server.client(token) as api:
        assert api.get(f"/v1/conversions/{job.id}").json()["state"] == "succeeded"


def test_cancel_a_queued_and_a_held_running_job(tmp_path):
    """The cancel of a job that is running (held running by the hold hook, however fast the
    machine) and of one queued behind it (one worker): both cancelled, through the client and
    `edge-un cancel`; a second cancel is the 409 of a finished job."""
    env, hold = hold_hook(tmp_path / "hook")
    live = LiveServer(tmp_path / "data", EDGE_UN_WORKERS="1", **env).start()
    try:
        token = live.token("canceller")
        files = fast_job_files()
        with Client(live.url, token) as client:
            running, queued = (
                client.submit(
                    files["model"], targets="cpu", calib=files["calib"], eval=files["eval"]
                )
                for _ in range(2)
            )
            with live.client(token) as api:
                wait_for(api, running.id, ("running",), stage_not_in=("starting", None))
            assert client.job(queued.id).state == "queued"
            cancelled = client.cancel(queued.id)
            assert (cancelled.id, cancelled.state) == (queued.id, "cancelled")
            result = run_cli("cancel", running.id, server=live, token=token)
            assert result.returncode == 0, result.stderr
            assert result.stdout.startswith(f"{running.id} cancelled"), result.stdout
            hold.unlink()
            for job in (running, queued):
                assert client.wait(job.id, timeout_s=60).state == "cancelled"
                with pytest.raises(ServiceError, match="already cancelled: nothing to cancel"):
                    client.cancel(job.id)
    finally:
        hold.unlink(missing_ok=True)
        live.stop()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client closing a kept-alive connection (as the client under test does)


RESTARTING = {"title": "Service unavailable", "status": 503, "detail": "the service is restarting"}


class Front:
    """A real HTTP front on a socket of its own before the live server (a load balancer while
    the service restarts): the requests whose ``METHOD /path`` contains ``when`` get, in order, what
    ``script`` says, then every request is forwarded. ``503:N`` a problem+json 503 with
    ``Retry-After: N`` (``503`` without one), ``drop`` the request read and the connection
    closed without an answer, ``half`` the server's answer cut off after half its body,
    ``301`` a redirect to the same path on https://edge-un.example (a proxy that wants TLS),
    ``html`` a 200 that is a proxy's HTML page. Bound at once but listening only after
    ``listen()``: until then a connection is refused."""

    def __init__(self, upstream: str, script: list[str], when: str = "") -> None:
        self.script, self.when = list(script), when
        self.seen: list[tuple[str, str, str | None]] = []  # method, path, Range
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                front.seen.append((self.command, self.path, self.headers.get("range")))
                action = "pass"
                if front.when in f"{self.command} {self.path}" and front.script:
                    action = front.script.pop(0)
                if action == "drop":
                    self.close_connection = True
                    return
                if action in ("301", "html"):
                    page = b"<html><body>Moved, or a sign-in page of the proxy</body></html>"
                    self.send_response(301 if action == "301" else 200)
                    if action == "301":
                        self.send_header("Location", f"https://edge-un.example{self.path}")
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(page)))
                    self.end_headers()
                    self.wfile.write(page)
                    return
                if action.startswith("503"):
                    problem = json.dumps(RESTARTING).encode()
                    self.send_response(503)
                    self.send_header("Content-Type", "application/problem+json")
                    if ":" in action:
                        self.send_header("Retry-After", action.split(":")[1])
                    self.send_header("Content-Length", str(len(problem)))
                    self.end_headers()
                    self.wfile.write(problem)
                    return
                hop = ("host", "content-length", "connection")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
                with httpx.Client(base_url=upstream, timeout=60) as client:
                    answer = client.request(self.command, self.path, headers=headers,
                                            content=body)  # fmt: skip
                self.send_response(answer.status_code)
                for key, value in answer.headers.multi_items():
                    if key not in ("content-length", "transfer-encoding", "connection",
                                   "content-encoding", "date", "server"):  # fmt: skip
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                if action == "half":
                    self.wfile.write(answer.content[: len(answer.content) // 2])
                    self.close_connection = True
                    return
                self.wfile.write(answer.content)

            do_GET = do_POST = do_DELETE = handle_one

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler, bind_and_activate=False)
        self.httpd.daemon_threads = True
        self.httpd.server_bind()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.serving = False

    def listen(self) -> None:
        self.httpd.server_activate()
        self.serving = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self) -> Front:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.serving:
            self.httpd.shutdown()
        self.httpd.server_close()


def test_retries_503_and_lost_connections_with_backoff(server, token, finished, tmp_path):
    """Through a real front before the real server: a refused connection, 503s (Retry-After
    honoured, else the backoff doubles), a dropped connection; an upload is never re-sent
    once it may have reached the server; a download cut off mid-body resumes."""
    job, _ = finished
    said: list[tuple[str, float]] = []
    with Front(server.url, ["503:1", "503", "drop"]) as front:

        def retrying(why: str, seconds: float) -> None:
            said.append((why, seconds))
            if not front.serving:  # the first try was refused: now the front comes up
                front.listen()

        with Client(front.url, token, backoff_s=0.1, on_retry=retrying) as client:
            assert client.job(job.id).state == "succeeded"
        whys = [why.split(":")[0] for why, _ in said]
        assert whys == ["ConnectError", "HTTP 503", "HTTP 503", "RemoteProtocolError"], said
        # the backoff doubles from 0.1 s at each try; the front's Retry-After wins
        assert [seconds for _, seconds in said] == [0.1, 1.0, 0.4, 0.8], said
        assert [m for m, _, _ in front.seen] == ["GET"] * 4

    # an upload the front read and dropped is not sent again (the server might have made a job)
    with Front(server.url, ["drop"], when="POST /v1/conversions") as front, \
            Client(front.url, token, backoff_s=0.1) as client:  # fmt: skip
        front.listen()
        before = client.jobs().total
        with pytest.raises(ServiceError, match="RemoteProtocolError"):
            client.submit(MODEL, targets="cpu")
        assert [m for m, _, _ in front.seen].count("POST") == 1
        assert client.jobs().total == before

    # a server that stays at 503: one error, with its problem's detail
    with Front(server.url, ["503"] * 3) as front, \
            Client(front.url, token, retries=2, backoff_s=0.05) as client:  # fmt: skip
        front.listen()
        with pytest.raises(ServiceError, match="the service is restarting") as error:
            client.job(job.id)
        assert error.value.status == 503 and len(front.seen) == 3

    # a download answered 503, then cut off half way: resumed from what arrived, checked
    name = "cpu/model_int8.onnx"
    with Front(server.url, ["503", "half"], when=f"/artifacts/{name}") as front, \
            Client(front.url, token, backoff_s=0.05) as client:  # fmt: skip
        front.listen()
        (path,) = client.download(job.id, tmp_path, names=[name])
        ranges = [r for _, p, r in front.seen if p.endswith(name)]
        size = path.stat().st_size
        assert ranges == [None, None, f"bytes={size // 2}-"], ranges
        assert sha256(path) == {a.name: a.sha256 for a in client.artifacts(job.id)}[name]


def test_a_redirect_or_a_page_that_is_no_answer_is_one_service_error(server, token, finished):
    """A proxy before the service answers 301 (to https://) or its own HTML page: the client
    follows nothing, parses nothing it cannot read, and says what to do in one ServiceError."""
    job, _ = finished
    path = f"/v1/conversions/{job.id}"
    with Front(server.url, ["301"] * 4) as front, Client(front.url, token) as client:
        front.listen()
        for call in (lambda: client.job(job.id), lambda: client.cancel(job.id),
                     client.jobs, lambda: client.download(job.id, ".")):  # fmt: skip
            with pytest.raises(ServiceError) as error:
                call()
            assert error.value.status == 301
            assert "use https://edge-un.example as --server" in str(error.value), error.value
        assert f"to https://edge-un.example{path}/artifacts; use" in str(error.value)
        assert [m for m, _, _ in front.seen] == ["GET", "POST", "GET", "GET"]  # none followed
    with Front(server.url, ["html"] * 2) as front, Client(front.url, token) as client:
        front.listen()
        with pytest.raises(ServiceError) as error:
            client.job(job.id)
        assert str(error.value) == (
            f"the answer to GET {front.url}{path} (HTTP 200, text/html) is not the JobOut this "
            f"client reads (1 problem(s)); is {front.url} an edge-un service?"
        )
        with pytest.raises(ServiceError, match=r"is not the list of ArtifactOut this client"):
            client.artifacts(job.id)
        assert client.job(job.id).state == "succeeded"  # through the front: it passes now
    # the command line: that one line, exit 1, no traceback
    with Front(server.url, ["301"]) as front:
        front.listen()
        result = run_cli("status", job.id, "--server", front.url, server=server, token=token)
    assert result.returncode == 1 and result.stderr == (
        f"edge-un status: error: GET {front.url}{path}: the server redirected (HTTP 301) to "
        f"https://edge-un.example{path}; use https://edge-un.example as --server\n"
    )


def run_cli(*args: str, server: LiveServer, token: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EDGE_UN_SERVER": server.url,
           "EDGE_UN_TOKEN": token}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True,
                          text=True, timeout=600, env=env, cwd=ROOT)  # fmt: skip


def test_submit_wait_download_is_convert_over_http(server, token, tmp_path):
    """``edge-un submit MODEL --wait --download DIR`` on a terminal: the job's stages in
    convert's progress bar, then convert's summary, exit code and files."""
    out = tmp_path / "out"
    code, screen = run_in_terminal("submit", str(MODEL), "--target", "cpu", "--wait",
                                   "--download", str(out), "--server", server.url,
                                   "--token", token)  # fmt: skip
    assert code == 0, screen[-3000:]
    assert "convert: cpu: " in screen and "\x1b[" in screen  # the bar follows the job's stages
    lines = [ANSI.sub("", line).rstrip("\r").split("\r")[-1] for line in screen.split("\n")]
    assert next(line for line in lines if line.startswith("cpu ")).split()[1] == "ok"
    assert any(line.startswith("vit-mnist-un: 1000 evaluation samples") for line in lines)
    assert f"wrote {out}/ (report.md, report.json, report.html and the artifacts)" in lines
    assert "Traceback" not in screen
    from quant.report import Report

    report = Report.read(out / "report.json")
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    made = {a.name: a.sha256 for t in report.targets.values() for a in t.artifacts}
    # what convert writes: the artifacts the report lists, report.json, .md and .html
    assert written == set(made) | {"report.json", "report.md", "report.html"}
    for name, digest in made.items():
        assert sha256(out / name) == digest, name
    html = (out / "report.html").read_text()
    assert "<title>edge-un conversion: vit-mnist-un</title>" in html and "cpu-worst-table" in html
    # the module names reach the CLI too: `report` shows each worst layer's module
    details = run_cli("report", str(out), server=server, token=token).stdout.splitlines()
    cpu = report.targets["cpu"]
    assert cpu.drift is not None and all(layer.module for layer in cpu.drift.worst_layers)
    assert any(cpu.drift.worst_layers[0].module in line for line in details)

    job_id = run_cli("jobs", server=server, token=token).stdout.splitlines()[2].split()[0]
    status = run_cli("status", job_id, server=server, token=token)  # piped: plain text
    assert status.returncode == 0 and status.stdout.startswith(f"{job_id} succeeded (100 %")
    summary = status.stdout.splitlines()
    assert summary[1].startswith("vit-mnist-un: 1000 evaluation samples")
    drift_row = next(line for line in summary if line.startswith("cpu "))
    assert drift_row in details  # convert's table, as `edge-un report` prints it too
    assert "\x1b" not in status.stdout
    again = tmp_path / "again"
    fetched = run_cli("download", job_id, "--dir", str(again), server=server, token=token)
    assert fetched.returncode == 0, fetched.stderr
    assert {p.relative_to(again).as_posix() for p in again.rglob("*") if p.is_file()} == written
    assert all(sha256(again / name) == digest for name, digest in made.items())

    # errors: the server's detail in one line, exit 1, no traceback
    cancel = run_cli("cancel", job_id, server=server, token=token)
    assert cancel.returncode == 1
    assert cancel.stderr == (
        f"edge-un cancel: error: the conversion {job_id} already "
        "succeeded: nothing to cancel (HTTP 409 Already finished)\n"
    )
    missing = run_cli("status", "nope", server=server, token=token)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert missing.stderr.startswith("edge-un status: error: no conversion 'nope' for this token")
    unknown = run_cli("submit", str(MODEL), "--target", "npu9000", server=server, token=token)
    assert unknown.returncode == 1 and "npu9000" in unknown.stderr
    assert unknown.stderr.count("\n") == 1 and "Traceback" not in unknown.stderr
    typo = run_cli("jobs", "--server", "127.0.0.1:8000", server=server, token=token)
    assert typo.returncode == 1 and typo.stderr == (
        "edge-un jobs: error: '127.0.0.1:8000' is not a service address: give "
        "http://HOST:PORT (or https://)\n"
    )


def test_submit_wait_of_a_job_that_fails_exits_1_with_its_reason(tmp_path):
    """``convert``'s exit code: a job that fails is exit 1 and its reason in one line. Its
    server gives a job 1 s, far less than any conversion takes (tests/test_service_faults.py)."""
    live = LiveServer(tmp_path / "data", EDGE_UN_JOB_TIMEOUT_S="1").start()
    try:
        token = live.token("fails")
        result = run_cli("submit", str(MODEL), "--target", "cpu", "--wait", server=live,
                         token=token)  # fmt: skip
        with Client(live.url, token) as client:
            (job,) = client.jobs().items
    finally:
        live.stop()
    assert job.state == "failed" and "timed out after 1 s" in (job.error or "")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"edge-un submit: error: the conversion {job.id} failed (")
    assert last.endswith(f": {job.error}") and result.stdout == ""


# What only the server and the workers need: a client machine may have none of it.
SERVER_ONLY = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "celery", "kombu")


def test_the_client_and_the_remote_commands_need_none_of_the_servers_dependencies() -> None:
    """service.client and the remote commands import with every server-only package made
    unimportable (the client reads the API's schemas from service.schemas, beside the
    server, not from it)."""
    code = (
        "import importlib.abc, sys\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name.split('.')[0] in {SERVER_ONLY!r}:\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        "from service.client import Client\n"
        "from service.cli import main\n"
        "print(main(['submit', '--help']), sorted({m.split('.')[1] for m in sys.modules\n"
        "      if m.startswith('service.')}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    code, loaded = result.stdout.splitlines()[-1].split(" ", 1)
    assert code == "0" and "server" not in loaded and "worker" not in loaded, result.stdout
