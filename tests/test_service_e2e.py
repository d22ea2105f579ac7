"""End to end over HTTP against a real server: upload the bundled UN ViT, poll, read the report,
download and verify every artifact, and run the int8 ONNX file with ONNX Runtime; an ONNX
export with its weights in external data (model_data); a Hugging Face directory as a .zip;
cancelling, listing and deleting;
tokens (isolation, 401s, revocation); metrics."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
import zipfile

import numpy as np
import pytest
from sqlalchemy import select

from edge_un import examples
from service import tokens
from service.db import Token, session_scope
from service.job_states import STATES
from testbed.live import upload, wait_for

from .service_live import converted, fast_data_parts, is_problem, job_processes

MODEL = examples.path("vit-mnist-un")
SERVER_ENV = {"EDGE_UN_WORKERS": "1"}  # the conftest's server, token


@pytest.fixture(scope="module")
def finished(server, token) -> dict:
    """One succeeded conversion, shared by the tests that read it."""
    with server.client(token) as client:
        response = upload(client, MODEL, targets="cpu")
        assert response.status_code == 202, response.text
        job = response.json()
        assert response.headers["location"].endswith(f"/v1/conversions/{job['id']}")
        assert job["state"] == "queued" and job["inputs"]["model"] == MODEL.name
        return wait_for(client, job["id"], ("succeeded",))


def test_end_to_end_artifacts_verify_and_run(server, token, finished):
    import onnxruntime as ort

    from edge_un import load_checkpoint
    from quant.samples import checkpoint_samples

    job_id = finished["id"]
    assert finished["percent"] == 100 and finished["error"] is None
    assert finished["started_at"] <= finished["finished_at"]
    with server.client(token) as client:
        report = client.get(f"/v1/conversions/{job_id}/report").json()
        assert report["schema_version"] == "1.0" and report["targets"]["cpu"]["status"] == "ok"
        page = client.get(f"/v1/conversions/{job_id}/report.html")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<svg" in page.text and "cpu" in page.text

        listing = client.get(f"/v1/conversions/{job_id}/artifacts").json()
        names = {a["name"] for a in listing}
        reported = {a["name"]: a["sha256"] for a in report["targets"]["cpu"]["artifacts"]}
        assert set(reported) <= names and {"report.json", "report.md"} <= names
        files = {}
        for artifact in listing:
            response = client.get(f"/v1/conversions/{job_id}/artifacts/{artifact['name']}")
            assert response.status_code == 200
            body = response.content
            digest = hashlib.sha256(body).digest()
            assert len(body) == artifact["bytes"]
            assert (
                digest.hex() == artifact["sha256"] == reported.get(artifact["name"], digest.hex())
            )
            assert (
                response.headers["repr-digest"] == f"sha-256=:{base64.b64encode(digest).decode()}:"
            )
            assert response.headers["etag"] == f'"{artifact["sha256"]}"'
            again = client.get(response.url, headers={"If-None-Match": response.headers["etag"]})
            assert again.status_code == 304
            files[artifact["name"]] = body

        bundle = client.get(f"/v1/conversions/{job_id}/bundle.zip")
        assert bundle.status_code == 200 and bundle.headers["content-type"] == "application/zip"
        with zipfile.ZipFile(io.BytesIO(bundle.content)) as archive:
            inside = {n.split("/", 1)[1]: archive.read(n) for n in archive.namelist()}
        assert inside == files
        assert json.loads(files["report.json"]) == report

    # The downloaded int8 file on the checkpoint's test split gives the top-1 the report states:
    # the drift figure in the file's exact arithmetic (no graph optimization: no fused int8
    # kernel), the same on every host; the host figure with this host's kernels (the server ran
    # on this machine, so its kernels are these whether or not the CPU has VNNI).
    cpu = report["targets"]["cpu"]
    _, info = load_checkpoint(MODEL)
    test = checkpoint_samples(info, "test")
    assert len(test) == report["reference"]["samples"] == cpu["drift"]["samples"]
    for drift, optimized in ((cpu["drift"], False), (cpu["host_drift"], True)):
        options = ort.SessionOptions()
        if not optimized:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(
            files[drift["artifact"]], options, providers=["CPUExecutionProvider"]
        )
        logits = session.run(None, {session.get_inputs()[0].name: test.inputs})[0]
        top1 = float((logits.argmax(-1) == test.labels).mean())
        assert abs(top1 - drift["top1_int8"]) <= 1 / len(test), (optimized, top1, drift)
        assert np.isfinite(logits).all()


def test_onnx_export_with_external_data_converts(server, tmp_path):
    """torch.onnx.export's default layout, model.onnx beside model.onnx.data, uploaded as
    'model' and 'model_data', converts like any model (its own token: the other tests' listings
    stay as they are)."""
    import onnx
    import torch

    from converters import export_onnx
    from edge_un import load_checkpoint

    model, _ = load_checkpoint(MODEL)
    export_onnx(model, torch.randn(2, 1, 28, 28), tmp_path / "whole.onnx", opset=21)
    split = tmp_path / "split"
    split.mkdir()
    onnx.save_model(
        onnx.load(str(tmp_path / "whole.onnx")),
        str(split / "model.onnx"),
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=0,
    )
    assert (split / "model.onnx.data").stat().st_size > 100_000  # the weights are out there
    parts = [
        ("model", ("model.onnx", (split / "model.onnx").read_bytes())),
        ("model_data", ("model.onnx.data", (split / "model.onnx.data").read_bytes())),
        *fast_data_parts(),  # calibration and evaluation samples of the example's data set
    ]
    with server.client(server.token("carol")) as client:
        job, report = converted(client, parts)
    assert job["inputs"]["model_format"] == "onnx"
    assert job["inputs"]["bytes"] == sum(len(part[1][1]) for part in parts)
    assert report["targets"]["cpu"]["status"] in ("ok", "over_bar"), report["targets"]["cpu"]
    assert not (server.data_dir / "uploads" / job["id"]).exists()  # data file removed too


def test_a_hugging_face_directory_as_a_zip_converts(server, tmp_path):
    """A save_pretrained directory zipped as ``zip -r`` makes it (with a tokenizer file that is
    never read) converts as the directory: traced with its own forward argument, the report
    says hf, the int8 file downloads; the uploads are gone afterwards."""
    source = examples.path("hf-vit-mnist-un")
    archive = tmp_path / "my-vit.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as bundle:
        for path in source.iterdir():
            bundle.write(path, f"my-vit/{path.name}")
        bundle.writestr("my-vit/tokenizer.json", "{}")
    # 'inputs' names the one input of a one-input model
    parts = [("model", ("my-vit.zip", archive.read_bytes())), *fast_data_parts()]
    with server.client(server.token("dave")) as client:
        job, report = converted(client, parts)
        cpu = report["targets"]["cpu"]
        onnx_file = next(a for a in cpu["artifacts"] if a["name"].endswith("int8.onnx"))
        int8 = client.get(f"/v1/conversions/{job['id']}/artifacts/{onnx_file['name']}")
    assert job["inputs"]["model_format"] == "hf" and job["inputs"]["model"] == "my-vit.zip"
    assert report["model"]["source_format"] == "hf", report["model"]
    assert [i["name"] for i in report["model"]["inputs"]] == ["pixel_values"]
    # Measured on the 100 uploaded samples, where the 0.5-pt drop bar is one sample: either
    # outcome of the bars is a conversion (the bars on the whole split: test_hf_convert).
    assert cpu["status"] in ("ok", "over_bar") and cpu["drift"]["samples"] == 100, cpu
    assert int8.status_code == 200
    assert hashlib.sha256(int8.content).hexdigest() == onnx_file["sha256"]
    assert not (server.data_dir / "uploads" / job["id"]).exists()


def _scrape(server) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (comments, blank lines and the counters' creation
    times dropped)."""
    values: dict[str, float] = {}
    for line in server.client().get("/metrics").text.splitlines():
        if line and not line.startswith("#") and "_created{" not in line:
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def test_metrics_count_jobs_stages_and_uploads(server, token, finished):
    from service.db import Job, JobStage

    before = _scrape(server)
    # Jobs by state and queue depth are the database's rows, read here without the service.
    with session_scope(server.settings) as session:
        states = [row.state for row in session.scalars(select(Job))]
        rows = [(r.job_id, r.stage, r.seconds) for r in session.scalars(select(JobStage))]
    stages = [(stage, seconds) for _, stage, seconds in rows]
    mine = [stage for job_id, stage, _ in rows if job_id == finished["id"]]
    assert states.count("succeeded") >= 1 and "quantize" in mine, (states, mine)
    for state in STATES:
        assert before[f'edge_un_jobs{{state="{state}"}}'] == states.count(state), state
    assert before["edge_un_queue_depth"] == states.count("queued")
    for stage in {name for name, _ in stages}:
        seconds = [t for name, t in stages if name == stage]
        key = f'edge_un_stage_duration_seconds_{{}}{{{{stage="{stage}"}}}}'
        assert before[key.format("count")] == len(seconds), stage
        assert before[key.format("sum")] == pytest.approx(sum(seconds)), stage
    assert before['edge_un_stage_duration_seconds_sum{stage="quantize"}'] > 0
    # Every job so far was an accepted upload; its bytes were all counted.
    assert before['edge_un_uploads_total{outcome="accepted"}'] == len(states)
    with session_scope(server.settings) as session:
        stored = sum(session.scalars(select(Job.upload_bytes)))
    counted = sum(v for k, v in before.items() if k.startswith("edge_un_upload_bytes_total{"))
    assert counted == stored and before['edge_un_upload_bytes_total{field="model"}'] >= (
        MODEL.stat().st_size
    )
    # A rejected upload of a known size moves exactly its counters, and creates no job.
    junk = b"not a checkpoint " * 100
    with server.client(token) as client:
        response = client.post("/v1/conversions", files={"model": ("junk.pt", junk)})
    is_problem(response, 422)
    after = _scrape(server)
    moved = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert moved == {
        'edge_un_uploads_total{outcome="rejected"}': 1.0,
        'edge_un_upload_bytes_total{field="model"}': float(len(junk)),
    }, moved


def test_other_tokens_see_nothing(server, token, finished):
    job = f"/v1/conversions/{finished['id']}"
    with server.client(server.token("bob")) as bob:
        for path in (job, f"{job}/report", f"{job}/report.html", f"{job}/artifacts",
                     f"{job}/artifacts/report.json", f"{job}/bundle.zip"):  # fmt: skip
            is_problem(bob.get(path), 404)
        is_problem(bob.delete(job), 404)
        assert bob.get("/v1/conversions").json()["total"] == 0
    with server.client(token) as alice:  # still there for its owner
        assert alice.get(job).json()["state"] == "succeeded"


def test_every_v1_route_needs_a_valid_token(server, token, finished):
    job_id = finished["id"]
    spec = server.client().get("/openapi.json").json()
    routes = [(method, path) for path, item in spec["paths"].items() if path.startswith("/v1")
              for method in item]  # fmt: skip
    assert len(routes) >= 9
    revoked_info, revoked = tokens.create_token(server.settings, "revoked")
    tokens.revoke_token(server.settings, revoked_info.id)
    for credentials in (None, "not-a-token", "eun_" + "x" * 43, revoked):
        with server.client(credentials) as client:
            for method, path in routes:
                url = path.replace("{job_id}", job_id).replace("{name}", "report.json")
                body = is_problem(client.request(method.upper(), url), 401)
                assert "token" in body["detail"]
                assert client.request(method.upper(), url).headers["www-authenticate"]
    with server.client(token) as client:  # the job was not touched by any of it
        assert client.get(f"/v1/conversions/{job_id}").json()["state"] == "succeeded"
    # tokens are stored hashed: the secret appears in no row (nor in SQLite's file)
    with session_scope(server.settings) as session:
        rows = session.execute(select(Token)).scalars().all()
    assert len(rows) >= 2 and not any(token in repr(vars(row)) for row in rows)
    if server.mode == "local":
        assert token.encode() not in (server.data_dir / "edge-un.db").read_bytes()


def test_cancel_list_and_delete(server, token, finished):
    with server.client(token) as client:
        ids = [upload(client, MODEL, targets="cpu").json()["id"] for _ in range(3)]
        running, queued, last = ids
        # the queued one is cancelled before it starts (workers=1: it waits for `running`)
        cancelled = client.delete(f"/v1/conversions/{queued}")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        # the running one: its process is stopped, and the queue moves on
        wait_for(client, running, ("running",), stage_not_in=("starting", None))
        pids = job_processes(server, running)
        assert pids
        assert client.delete(f"/v1/conversions/{running}").json()["state"] == "cancelled"
        deadline = time.monotonic() + 30
        while job_processes(server, running) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not job_processes(server, running)
        wait_for(client, last, ("running",))
        client.delete(f"/v1/conversions/{last}")
        for job_id in ids:
            job = client.get(f"/v1/conversions/{job_id}").json()
            assert job["state"] == "cancelled" and job["error"] == "cancelled by the client"
            is_problem(client.get(f"/v1/conversions/{job_id}/artifacts"), 409)
        # the queue cleans up after a stopped process: in Celery mode a lease after its cancel,
        # so the job cancelled first may be cleaned after the last one
        deadline = time.monotonic() + 10
        uploads = [server.data_dir / "uploads" / job_id for job_id in ids]
        while any(path.exists() for path in uploads) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list((server.data_dir / "uploads").iterdir()) == []
        assert list((server.data_dir / "artifacts" / ".staging").iterdir()) == []

        # newest first, paginated
        listing = client.get("/v1/conversions", params={"limit": 2}).json()
        assert listing["total"] == 4
        assert [j["id"] for j in listing["items"]] == [last, queued]
        rest = client.get(listing["next"]).json()
        assert [j["id"] for j in rest["items"]] == [running, finished["id"]]
        assert rest["next"] is None

        # deleting a finished job removes it and its files
        assert client.delete(f"/v1/conversions/{queued}").status_code == 204
        assert client.delete(f"/v1/conversions/{finished['id']}").status_code == 204
        is_problem(client.get(f"/v1/conversions/{finished['id']}"), 404)
        assert not (server.data_dir / "artifacts" / finished["id"]).exists()
        assert client.get("/v1/conversions").json()["total"] == 2
