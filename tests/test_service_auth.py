"""Authentication modes: tokens by default (401 without one); no authentication only when
EDGE_UN_AUTH=none is set, and then the server says so loudly at start."""

from __future__ import annotations

from .service_live import is_problem


def test_tokens_are_the_default_and_none_must_be_configured(tmp_path, service_mode):
    default = service_mode.server(tmp_path / "tokens").start()
    try:
        is_problem(default.client().get("/v1/targets"), 401)
        assert "AUTHENTICATION IS OFF" not in default.log()
    finally:
        default.stop()

    open_server = service_mode.server(tmp_path / "open", EDGE_UN_AUTH="none").start()
    try:
        with open_server.client() as client:
            targets = client.get("/v1/targets")
            assert targets.status_code == 200
            assert {t["name"] for t in targets.json()} == {"cpu", "imx93", "imx8mp", "tda4vm"}
            assert client.get("/v1/conversions").json() == {
                "items": [], "total": 0, "limit": 20, "offset": 0, "next": None,
            }  # fmt: skip
        assert "AUTHENTICATION IS OFF (EDGE_UN_AUTH=none)" in open_server.log()
    finally:
        open_server.stop()
