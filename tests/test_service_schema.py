"""schemathesis over /openapi.json against a live server, with a valid token: whatever a
client sends (schema-shaped or not), the server never answers 5xx."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_no_5xx_for_anything_schemathesis_sends(server, tmp_path):
    token = server.token("schemathesis")
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run", f"{server.url}/openapi.json",
        "--header", f"Authorization: Bearer {token}",
        "--checks", "not_a_server_error",
        "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", "25",
        "--workers", "1",
        "--request-timeout", "60",
        "--report", "junit", "--report-dir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_TELEMETRY": "false", "NO_COLOR": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "passed" in result.stdout
    log = server.log()
    assert " 500 " not in log and "Traceback" not in log, log[-4000:]
