"""Every client error is a 4xx application/problem+json whose detail says what to do: unknown
routes and methods, FastAPI's own validation, malformed forms, unknown targets, bad drift
bars, oversize uploads, bad ranges. Nothing a client sends gets a 5xx or leaves files behind."""

from __future__ import annotations

from edge_un import examples
from testbed.live import upload

from .service_live import is_problem

MODEL = examples.path("vit-mnist-un")
SERVER_ENV = {"EDGE_UN_MAX_UPLOAD_MB": "1"}  # the conftest's server, client


def test_unknown_routes_and_methods(client):
    assert "/docs" in is_problem(client.get("/v2/nothing"), 404)["detail"]
    response = client.put("/v1/conversions")
    body = is_problem(response, 405)
    assert response.headers["allow"] == "GET, POST" and "GET, POST" in body["detail"]
    is_problem(client.post("/healthz"), 405)
    is_problem(client.get("/v1/conversions/0123abc"), 404)


def test_fastapi_validation_errors_are_problems(client):
    body = is_problem(client.get("/v1/conversions", params={"limit": "lots"}), 422)
    assert "'limit'" in body["detail"] and body["errors"][0]["location"] == ["query", "limit"]
    is_problem(client.get("/v1/conversions", params={"offset": -1}), 422)
    is_problem(client.get("/v1/conversions", params={"limit": 10**30}), 422)


def test_malformed_requests(client):
    body = is_problem(client.post("/v1/conversions", json={"model": "x"}), 415)
    assert "multipart/form-data" in body["detail"]
    no_boundary = {"content-type": "multipart/form-data"}
    is_problem(client.post("/v1/conversions", content=b"x", headers=no_boundary), 400)
    truncated = b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nabc'
    headers = {"content-type": "multipart/form-data; boundary=b"}
    is_problem(client.post("/v1/conversions", content=truncated, headers=headers), 400)
    body = is_problem(client.post("/v1/conversions", files={"targets": (None, "cpu")}), 422)
    assert "'model'" in body["detail"]
    with MODEL.open("rb") as a, MODEL.open("rb") as b:
        files = [("model", ("a.safetensors", a)), ("model", ("b.safetensors", b))]
        assert "twice" in is_problem(client.post("/v1/conversions", files=files), 400)["detail"]
    body = is_problem(client.post("/v1/conversions", files={"modle": ("m", b"x")}), 400)
    assert "unknown form field 'modle'" in body["detail"]


def test_unknown_target_and_bad_drift_bar(client):
    body = is_problem(upload(client, MODEL, targets="cpu,npu9000"), 422)
    assert "npu9000" in body["detail"] and "imx93" in body["detail"]
    for bad in ("nan", "-1", "1e9", "half", "inf"):
        body = is_problem(upload(client, MODEL, max_drift=bad), 422)
        assert "max_drift" in body["detail"], body


def test_oversize_upload_is_cut_off(client, server):
    big = server.data_dir.parent / "big.safetensors"
    big.write_bytes(b"\0" * (3 * 1024 * 1024))
    body = is_problem(upload(client, big), 413)
    assert "EDGE_UN_MAX_UPLOAD_MB" in body["detail"]


def test_nothing_was_kept_and_the_server_still_serves(client, server):
    assert client.get("/readyz").status_code == 200
    assert client.get("/v1/conversions").json()["total"] == 0
    assert list((server.data_dir / "uploads").iterdir()) == []
    metrics = client.get("/metrics").text
    assert 'edge_un_uploads_total{outcome="rejected"}' in metrics
    assert " 500 " not in server.log() and "Traceback" not in server.log()
