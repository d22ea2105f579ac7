"""The Docker image, built and used as the docs' Docker page (docs/service/docker.md) says:
sizes, and every check.

    .venv/bin/python -m benchmarks.service.docker_image  # ~25 min on 2 cores (cached: ~12)
    .venv/bin/python -m benchmarks.service.docker_image --report-only # Markdown from the JSON

Run by hand, as root, not by the test suite: no Docker engine is needed. The three variants are
built with ``shared/tools/docker-check`` (rootful podman; its python:3.11-slim is a local
STAND-IN, 412 MB, 192 MB of which is a /wheels directory the official image does not have),
niced: ``edge-un:latest`` (every target, both TFLite converters), ``edge-un:litert``
(``--build-arg TFLITE=litert``: litert-torch alone, every target for a torch source) and
``edge-un:onnx`` (``--build-arg TFLITE=0``: cpu and tda4vm). Measured:
each image's size, its layers (``podman image history``) and what its big directories hold
(``du`` inside it). Then the page's commands are run as a new user runs them, with ``docker``
being podman (same arguments) and from fresh directories under /tmp:

* ``convert`` of the bundled example from a directory owned by root (mode 755), and of a copy
  of it as ``/data/model.safetensors`` from one owned by uid 1001: exit 0, every target built,
  the output owned by the directory's owner;
* the environment the entrypoint gives a dropped uid (1001) and a ``--user 1234`` start: HOME,
  TMPDIR, matplotlib's and Hugging Face's cache directories writable, a user name, every file
  under /opt/edge-un readable;
* ``--user 1234`` on the root-owned directory: exit 1 and ONE line naming the uid, the directory
  and the fix;
* ``edge-un:litert``: ``targets``, ``convert`` of the bundled example (every target), and an
  ONNX file (``export`` then ``convert --target cpu,imx93``: cpu built, imx93 failed with a
  reason naming onnx2tf, exit 3);
* ``edge-un targets`` in the full and onnx variants; ``edge-un:onnx convert`` with the
  default targets (cpu and tda4vm, the others named in a note) and with ``--target imx93`` (one
  line, before any work);
* the HTTP service: ``token create`` and ``serve`` on a data volume (a fresh one named
  edge-un-check-PID instead of edge-un-data, a free port instead of 8000), an upload of the
  bundled example as the HTTP service page (docs/service/http.md) does it, polling to
  ``succeeded``, the artifact list and bundle.zip, the image's HEALTHCHECK, and who owns the
  volume's files.

Each command is checked to appear on the Docker page as run (after the volume and
port substitutions above). ``EDGE_UN_DOCKER_BASELINE=REF`` (a git revision, e.g. the commit
before this image's rework, 37d1859) also builds that revision's Dockerfile, with today's build
context, as ``edge-un:head`` and records its size and layers (the "before"). Writes
benchmarks/results/docker_image.json and docker_image.md.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.common.results import ROOT, benchmark_main
from quant.report import REPORT_FILE
from service.job_states import FINISHED
from testbed.servers import free_port

NAME = "docker_image"
DOCKER_CHECK = Path(os.environ.get("DOCKER_CHECK", ROOT.parent / "shared/tools/docker-check"))
STATE = Path(os.environ.get("DOCKER_CHECK_STATE", "/var/tmp/docker-check"))
PODMAN_ENV = {
    **os.environ,
    "CONTAINERS_CONF": str(STATE / "containers.conf"),
    "BUILDAH_FORMAT": "docker",
}
VARIANTS = {
    "full": {"tag": "edge-un:latest", "args": [], "targets": ["cpu", "imx93", "imx8mp", "tda4vm"]},
    # litert-torch alone: every target for a torch source, cpu and tda4vm for an ONNX file
    "litert": {
        "tag": "edge-un:litert",
        "args": ["--build-arg", "TFLITE=litert"],
        "targets": ["cpu", "imx93", "imx8mp", "tda4vm"],
    },
    "onnx": {
        "tag": "edge-un:onnx",
        "args": ["--build-arg", "TFLITE=0"],
        "targets": ["cpu", "tda4vm"],
    },
}
BASE_IMAGE = "python:3.11-slim"
PODMAN_LOG = re.compile(r'time="[^"]*" level=\w+ msg=')
NICE = ["nice", "-n", "10"]
EXAMPLE = ROOT / "edge_un/examples/vit-mnist-ln-to-un.safetensors"  # convert's default model
HTTP_EXAMPLE = ROOT / "edge_un/examples/vit-mnist-un.safetensors"  # README's HTTP upload
HTTP_TARGETS = "cpu,imx93"
GOALS_GB = {"full": 3.0, "onnx": 1.2}  # litert: none set
CONVERT_TIMEOUT_S = 1800

# The Docker page's commands, as written there (docs/service/docker.md must contain each).
README_COMMANDS = {
    "convert": 'docker run --rm -v "$PWD:/data" edge-un convert -o /data/out',
    "convert_file": 'docker run --rm -v "$PWD:/data" edge-un convert /data/model.safetensors '
    "-o /data/out",
    "convert_onnx": 'docker run --rm -v "$PWD:/data" edge-un:onnx convert -o /data/out',
    "convert_onnx_imx93": 'docker run --rm -v "$PWD:/data" edge-un:onnx convert --target imx93 '
    "-o /data/out",
    "convert_litert": 'docker run --rm -v "$PWD:/data" edge-un:litert convert -o /data/out',
    "export_litert": 'docker run --rm -v "$PWD:/data" edge-un:litert export --out /data/onnx',
    "convert_litert_onnx": 'docker run --rm -v "$PWD:/data" edge-un:litert convert '
    "/data/onnx/model.onnx --calib /data/calib.npz --eval /data/eval.npz --target cpu,imx93 "
    "-o /data/out",
    "targets": "docker run --rm edge-un targets",
    "targets_onnx": "docker run --rm edge-un:onnx targets",
    "targets_litert": "docker run --rm edge-un:litert targets",
    "shell": 'docker run --rm -it -v "$PWD:/data" edge-un sh',
    "user": 'docker run --rm --user "$(id -u):$(id -g)" -v "$PWD:/data" edge-un convert '
    "-o /data/out",
    "token": "docker run --rm -v edge-un-data:/var/lib/edge-un edge-un token create me",
    "serve": "docker run -p 8000:8000 -v edge-un-data:/var/lib/edge-un edge-un serve",
}

# Run as the container's user through the entrypoint (`edge-un python -c`): what it may write.
ENV_CHECK = r"""
import getpass, json, os, tempfile
def writable(path):
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path):
        return True
import matplotlib
from huggingface_hub import constants
import torch.hub
unreadable = [os.path.join(d, n) for d, dirs, files in os.walk("/opt/edge-un")
              for n in files + dirs if not os.access(os.path.join(d, n), os.R_OK)]
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "user": getpass.getuser(),
    "home": os.environ["HOME"], "home_writable": writable(os.environ["HOME"]),
    "tmp": tempfile.gettempdir(), "tmp_writable": writable(tempfile.gettempdir()),
    "matplotlib_config": matplotlib.get_configdir(), "matplotlib_cache": matplotlib.get_cachedir(),
    # matplotlib falls back to a temporary directory (and logs a warning) if the one in HOME is not
    # writable: under HOME means it is
    "matplotlib_writable": all(writable(d) and d.startswith(os.environ["HOME"])
                               for d in (matplotlib.get_configdir(), matplotlib.get_cachedir())),
    "hf_home": constants.HF_HOME, "hf_writable": writable(constants.HF_HUB_CACHE),
    "torch_hub": torch.hub.get_dir(), "torch_hub_writable": writable(torch.hub.get_dir()),
    "cwd_writable": os.access(".", os.W_OK), "unreadable_files": unreadable[:5],
    "unreadable_count": len(unreadable),
}))
"""


# -- helpers ---------------------------------------------------------------------------------


def run(
    cmd: list[str] | str, *, cwd: Path | None = None, timeout: float = 3600, shell: bool = False
) -> tuple[int, str, str, float]:
    """Run a command; (exit code, stdout, stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env=PODMAN_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        shell=shell,
        executable="/bin/bash" if shell else None,
        check=False,
    )
    return proc.returncode, proc.stdout, proc.stderr, round(time.monotonic() - start, 1)


def docker(
    command: str, cwd: Path, timeout: float = CONVERT_TIMEOUT_S
) -> tuple[int, str, str, float]:
    """A README command line, ``docker`` being podman with the same arguments (niced). Podman's
    own log lines (``time="..." level=error msg="unable to get systemd connection to add
    healthchecks"``: its HEALTHCHECK timers need systemd) are not the container's: dropped."""
    script = f'docker() {{ {" ".join(NICE)} podman "$@"; }}\n{command}'
    code, out, err, seconds = run(script, cwd=cwd, timeout=timeout, shell=True)
    err = "".join(ln for ln in err.splitlines(True) if not PODMAN_LOG.match(ln))
    return code, out, err, seconds


def podman(*args: str, timeout: float = 600) -> str:
    code, out, err, _ = run(["podman", *args], timeout=timeout)
    if code:
        raise RuntimeError(f"podman {' '.join(args)}: exit {code}: {err.strip()[-500:]}")
    return out


DOCKER_PAGE = ROOT / "docs/service/docker.md"  # where the Docker commands are documented


def readme_docker_section() -> str:
    """The documented Docker commands: the docs site's Docker page."""
    return DOCKER_PAGE.read_text()


def fresh_dir(name: str, uid: int) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"edge-un-docker-{name}-", dir="/tmp"))
    path.chmod(0o755)
    os.chown(path, uid, uid)
    return path


def owners(path: Path) -> list[int]:
    return sorted({p.stat().st_uid for p in [path, *path.rglob("*")]})


def last_lines(text: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])


# -- build and measure -----------------------------------------------------------------------


def build(tag: str, args: list[str], dockerfile: str = "docker/Dockerfile") -> dict[str, Any]:
    cmd = [*NICE, str(DOCKER_CHECK), "-f", dockerfile, "-t", tag, *args, "."]
    code, out, err, seconds = run(cmd, cwd=ROOT, timeout=7200)
    log = out + err
    if code:
        raise RuntimeError(f"building {tag} failed:\n{log[-3000:]}")
    steps = len(re.findall(r"STEP \d+/\d+", log))
    return {
        "command": " ".join(cmd[3:]),
        "seconds": seconds,
        "steps": steps,
        "cached_steps": log.count("--> Using cache"),
    }


def measure(tag: str) -> dict[str, Any]:
    size = int(podman("image", "inspect", "--format", "{{.Size}}", tag).strip())
    history = json.loads(podman("image", "history", "--format", "json", tag))
    layers = [
        {"bytes": int(h.get("size", 0)), "created_by": " ".join(h.get("CreatedBy", "").split())}
        for h in history
        if int(h.get("size", 0)) > 0
    ]
    script = (
        "du -sm --exclude=tflite-env --exclude=litert-env /opt/edge-un; "
        "du -sm /opt/edge-un/tflite-env /opt/edge-un/litert-env 2>/dev/null; "
        "du -sm /usr/local /wheels /usr/lib /usr/share 2>/dev/null; "
        "cd /opt/edge-un/lib/python3*/site-packages && du -sm * | sort -rn | head -15 "
        "| sed 's|^\\([0-9]*\\)\\t|\\1\\tmain:|'; "
        "cd /opt/edge-un/tflite-env/lib/python3*/site-packages 2>/dev/null && du -sm * "
        "| sort -rn | head -10 | sed 's|^\\([0-9]*\\)\\t|\\1\\ttflite:|'; true"
    )
    out = podman("run", "--rm", "--entrypoint", "sh", tag, "-c", script)
    names = {
        "/opt/edge-un": "main venv",
        "/opt/edge-un/tflite-env": "tflite-env",
        "/opt/edge-un/litert-env": "litert-env",
    }
    du = {}
    for line in out.splitlines():
        mib, _, path = line.partition("\t")
        if mib.isdigit():
            du[names.get(path, path)] = int(mib)
    return {"tag": tag, "bytes": size, "gb": round(size / 1e9, 2), "layers": layers, "du_mib": du}


def build_baseline(ref: str) -> dict[str, Any]:
    """The "before": git revision ``ref``'s docker/Dockerfile built as ``edge-un:head`` (from a
    temporary file outside the tree, so that no stray Dockerfile is left in it)."""
    text = subprocess.check_output(["git", "show", f"{ref}:docker/Dockerfile"], cwd=ROOT, text=True)
    with tempfile.NamedTemporaryFile("w", suffix=".Dockerfile") as head:
        head.write(text)
        head.flush()
        built = build("edge-un:head", [], head.name)
    commit = subprocess.check_output(["git", "rev-parse", "--short", ref], cwd=ROOT, text=True)
    return {
        **measure("edge-un:head"),
        "build": built,
        "what": f"docker/Dockerfile at {commit.strip()}",
    }


# -- checks ----------------------------------------------------------------------------------


class Checks:
    def __init__(self, readme: str) -> None:
        self.readme = readme
        self.results: list[dict[str, Any]] = []

    def add(
        self,
        name: str,
        variant: str,
        readme: str,
        check: Callable[[], dict[str, Any]],
        command: str | None = None,
    ) -> None:
        """Run one check of README's command ``readme`` (run as ``command`` when that differs:
        another uid, a probe instead of the shell); ``check`` returns its details with "ok"
        (an exception is a failed check)."""
        in_readme = readme in self.readme
        start = time.monotonic()
        try:
            detail = check()
        except Exception as error:  # a check that crashes is a failed check, with its reason
            detail = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        seconds = round(time.monotonic() - start, 1)
        ok = bool(detail.pop("ok")) and in_readme is not False
        self.results.append(
            {
                "name": name,
                "variant": variant,
                "readme": readme,
                "command": command or readme,
                "ok": ok,
                "in_readme": in_readme,
                "seconds": seconds,
                "detail": detail,
            }
        )
        print(
            f"{'ok  ' if ok else 'FAIL'} {name} ({seconds} s): {json.dumps(detail)[:300]}",
            flush=True,
        )


def check_convert(command: str, cwd: Path, owner: int, targets: list[str]) -> dict[str, Any]:
    code, _, err, seconds = docker(command, cwd)
    report_path = cwd / "out" / REPORT_FILE
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    statuses = {name: t["status"] for name, t in report.get("targets", {}).items()}
    drift = {
        name: (t.get("drift") or {}).get("top1_drop_pts")
        for name, t in report.get("targets", {}).items()
    }
    notes = [line for line in err.splitlines() if line.startswith("targets: ")]
    found = owners(cwd / "out") if (cwd / "out").exists() else []
    return {
        "ok": code == 0
        and sorted(statuses) == sorted(targets)
        and all(s in ("ok", "over_bar") for s in statuses.values())
        and found == [owner],
        "exit": code,
        "container_s": seconds,
        "targets": statuses,
        "drift_pts": drift,
        "owners_of_out": found,
        "dir_owner": owner,
        "notes": notes,
        **({} if code == 0 else {"stderr": last_lines(err, 5)}),
    }


def check_env(command: str, cwd: Path, uid: int, gid: int) -> dict[str, Any]:
    code, out, err, _ = docker(command, cwd, timeout=600)
    if code:
        return {"ok": False, "exit": code, "stderr": last_lines(err, 5)}
    env = json.loads(out.strip().splitlines()[-1])
    writable = [k for k in env if k.endswith("_writable") and k != "cwd_writable"]
    ok = (env["uid"], env["gid"]) == (uid, gid) and all(env[k] for k in writable)
    ok = ok and env["unreadable_count"] == 0 and env["groups"] in ([], [gid])
    return {"ok": ok, **env, "stderr": last_lines(err) if err.strip() else ""}


def check_one_line(command: str, cwd: Path, pattern: str) -> dict[str, Any]:
    code, _, err, seconds = docker(command, cwd, timeout=600)
    lines = err.strip().splitlines()
    ok = code == 1 and len(lines) == 1 and re.fullmatch(pattern, lines[0]) is not None
    return {
        "ok": ok and not (cwd / "out").exists(),
        "exit": code,
        "stderr_lines": len(lines),
        "line": lines[0] if lines else "",
        "container_s": seconds,
    }


def write_example_data(directory: Path, samples: int = 200) -> None:
    """calib.npz (its training split) and eval.npz (its test split) of the bundled example,
    as a user of an ONNX file writes them, owned by the directory's owner."""
    import numpy as np

    from edge_un import load_checkpoint
    from edge_un.data import checkpoint_split

    _, info = load_checkpoint(EXAMPLE)
    owner = directory.stat().st_uid
    for name, part in (("calib", "train"), ("eval", "test")):
        inputs, labels = checkpoint_split(info, part)
        path = directory / f"{name}.npz"
        np.savez(path, images=inputs[:samples].numpy(), labels=labels[:samples].numpy())
        os.chown(path, owner, owner)


def check_onnx_without_onnx2tf(export: str, convert: str, cwd: Path) -> dict[str, Any]:
    """An image without onnx2tf given an ONNX file: cpu built, imx93 failed with a reason that
    names the missing converter (exit 3, partial), not a crash."""
    write_example_data(cwd)  # an ONNX file records no data set: the user gives it
    export_code, _, export_err, _ = docker(export, cwd, timeout=900)
    code, _, err, seconds = docker(convert, cwd)
    report_path = cwd / "out" / REPORT_FILE
    targets = json.loads(report_path.read_text())["targets"] if report_path.is_file() else {}
    statuses = {name: target["status"] for name, target in targets.items()}
    reason = (targets.get("imx93") or {}).get("error") or ""
    ok = export_code == 0 and code == 3 and statuses == {"cpu": "ok", "imx93": "failed"}
    return {
        "ok": ok and "onnx2tf" in reason,
        "export_exit": export_code,
        "exit": code,
        "statuses": statuses,
        "imx93_error": reason,
        "stderr": last_lines(export_err + err),
        "container_s": seconds,
    }


def check_targets(command: str, targets: list[str]) -> dict[str, Any]:
    code, out, _, _ = docker(command, Path("/tmp"), timeout=300)
    line = next((ln for ln in out.splitlines() if ln.startswith("this installation can build")), "")
    cannot = [ln for ln in out.splitlines() if ln.startswith("cannot build")]
    ok = code == 0 and line == f"this installation can build: {', '.join(targets)}"
    return {"ok": ok, "exit": code, "can_build": line, "cannot": cannot}


def check_service(readme_token: str, readme_serve: str) -> dict[str, Any]:
    """token create + serve on a fresh volume, README's upload, poll, artifacts, bundle."""
    import httpx

    volume, name, port = (
        f"edge-un-check-{os.getpid()}",
        f"edge-un-check-serve-{os.getpid()}",
        free_port(),
    )
    token_cmd = readme_token.replace("edge-un-data", volume)
    serve_cmd = readme_serve.replace("edge-un-data", volume).replace(
        "-p 8000:8000", f"-d --name {name} -p 127.0.0.1:{port}:8000"
    )
    detail: dict[str, Any] = {"ok": False, "token_command": token_cmd, "serve_command": serve_cmd}
    cwd = Path("/tmp")
    try:
        code, out, err, seconds = docker(token_cmd, cwd, timeout=300)
        detail.update(token_exit=code, token_s=seconds)
        if code:
            detail["stderr"] = last_lines(err)
            return detail
        token = out.strip().splitlines()[-1]
        code, _, err, _ = docker(serve_cmd, cwd, timeout=120)
        if code:
            detail["stderr"] = last_lines(err)
            return detail
        base = f"http://127.0.0.1:{port}"
        start = time.monotonic()
        with httpx.Client(
            base_url=base, timeout=30, headers={"Authorization": f"Bearer {token}"}
        ) as client:
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() - start > 180:
                    detail["logs"] = last_lines(podman("logs", name), 10)
                    return detail
                time.sleep(1)
            detail["ready_s"] = round(time.monotonic() - start, 1)
            # README "HTTP service": curl -F model=@edge_un/examples/vit-mnist-un.safetensors
            # -F targets=cpu,imx93 .../v1/conversions
            with HTTP_EXAMPLE.open("rb") as stream:
                response = client.post(
                    "/v1/conversions",
                    files={"model": (HTTP_EXAMPLE.name, stream)},
                    data={"targets": HTTP_TARGETS},
                )
            detail["upload_status"] = response.status_code
            job = response.json()
            start = time.monotonic()
            while job.get("state") not in FINISHED:
                if time.monotonic() - start > CONVERT_TIMEOUT_S:
                    break
                time.sleep(2)
                job = client.get(f"/v1/conversions/{job['id']}").json()
            detail.update(
                state=job.get("state"),
                error=job.get("error"),
                job_s=round(time.monotonic() - start, 1),
            )
            artifacts = client.get(f"/v1/conversions/{job['id']}/artifacts")
            bundle = client.get(f"/v1/conversions/{job['id']}/bundle.zip")
            detail.update(
                artifacts=len(artifacts.json()) if artifacts.status_code == 200 else 0,
                bundle_status=bundle.status_code,
                bundle_bytes=len(bundle.content),
            )
        code, _, _, _ = run(["podman", "healthcheck", "run", name], timeout=60)
        detail["healthcheck"] = "healthy" if code == 0 else f"exit {code}"
        detail["volume_owners"] = podman(
            "run",
            "--rm",
            "--entrypoint",
            "sh",
            "-v",
            f"{volume}:/v",
            "edge-un:latest",
            "-c",
            "find /v -mindepth 1 -printf '%u\\n' | sort | uniq -c | tr -s ' ' | tr '\\n' ';'",
        ).strip()
        detail["process_user"] = podman("exec", name, "sh", "-c", "stat -c %U /proc/1").strip()
        detail["ok"] = (
            detail["upload_status"] == 202
            and detail["state"] == "succeeded"
            and detail["bundle_status"] == 200
            and detail["artifacts"] > 0
            and detail["healthcheck"] == "healthy"
        )
        return detail
    finally:
        run(["podman", "rm", "-f", "-t", "5", name], timeout=120)
        run(["podman", "volume", "rm", "-f", volume], timeout=120)


# -- the run ---------------------------------------------------------------------------------


def run_all() -> dict[str, Any]:
    if os.geteuid() != 0:
        sys.exit("docker_image.py: run as root (rootful podman, chown of the test directories)")
    started = time.monotonic()
    results: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "docker_check": str(DOCKER_CHECK),
        "goals_gb": GOALS_GB,
        "variants": {},
    }
    for variant, spec in VARIANTS.items():
        print(f"building {spec['tag']} ...", flush=True)
        built = build(spec["tag"], spec["args"])
        results["variants"][variant] = {**measure(spec["tag"]), "build": built}
    base = measure(BASE_IMAGE)
    results["base"] = {
        "image": BASE_IMAGE,
        "bytes": base["bytes"],
        "du_mib": base["du_mib"],
        "standin": "io.docker-check.standin"
        in podman("image", "inspect", "--format", "{{json .Labels}}", BASE_IMAGE),
    }
    if ref := os.environ.get("EDGE_UN_DOCKER_BASELINE"):
        results["baseline"] = build_baseline(ref)

    checks = Checks(readme_docker_section())
    root_dir, user_dir, onnx_dir, litert_dir, litert_onnx_dir = (
        fresh_dir("root", 0),
        fresh_dir("uid1001", 1001),
        fresh_dir("onnx", 1001),
        fresh_dir("litert", 1001),
        fresh_dir("litert-onnx", 1001),
    )
    shutil.copy(EXAMPLE, user_dir / "model.safetensors")
    os.chown(user_dir / "model.safetensors", 1001, 1001)
    full, onnx = VARIANTS["full"]["targets"], VARIANTS["onnx"]["targets"]
    try:
        checks.add(
            "targets",
            "full",
            README_COMMANDS["targets"],
            lambda: check_targets(README_COMMANDS["targets"], full),
        )
        checks.add(
            "targets",
            "onnx",
            README_COMMANDS["targets_onnx"],
            lambda: check_targets(README_COMMANDS["targets_onnx"], onnx),
        )
        checks.add(
            "convert, directory owned by root",
            "full",
            README_COMMANDS["convert"],
            lambda: check_convert(README_COMMANDS["convert"], root_dir, 0, full),
        )
        checks.add(
            "convert, directory owned by uid 1001",
            "full",
            README_COMMANDS["convert_file"],
            lambda: check_convert(README_COMMANDS["convert_file"], user_dir, 1001, full),
        )
        env_1001 = (
            README_COMMANDS["shell"]
            .replace(" -it", "")
            .replace(" sh", " python -c '" + ENV_CHECK + "'")
        )
        checks.add(
            "environment as the owner of /data (uid 1001)",
            "full",
            README_COMMANDS["shell"],
            lambda: check_env(env_1001, user_dir, 1001, 1001),
            env_1001.replace(ENV_CHECK, "<probe>"),
        )
        env_1234 = env_1001.replace("--rm", "--rm --user 1234:1234")
        checks.add(
            "environment with --user 1234:1234",
            "full",
            README_COMMANDS["shell"],
            lambda: check_env(env_1234, root_dir, 1234, 1234),
            env_1234.replace(ENV_CHECK, "<probe>"),
        )
        unwritable = README_COMMANDS["user"].replace('"$(id -u):$(id -g)"', "1234")
        pattern = (
            r"edge-un convert: error: uid 1234 \(gid 0\) cannot write the output directory "
            r"/data/out: no write permission on /data \(owned by uid 0, gid 0\); run the "
            r'container as the owner of /data \(docker run --user "\$\(id -u\):\$\(id -g\)"'
            r" \.\.\., from a directory you own\), or make /data writable for uid 1234, or "
            r"choose another output directory"
        )
        clean = fresh_dir("unwritable", 0)
        checks.add(
            "--user 1234 on a directory owned by root: one line",
            "full",
            README_COMMANDS["user"],
            lambda: check_one_line(unwritable, clean, pattern),
            unwritable,
        )
        checks.add(
            "convert, default targets",
            "onnx",
            README_COMMANDS["convert_onnx"],
            lambda: check_convert(README_COMMANDS["convert_onnx"], onnx_dir, 1001, onnx),
        )
        refused = fresh_dir("onnx-imx93", 0)
        checks.add(
            "convert --target imx93: one line",
            "onnx",
            README_COMMANDS["convert_onnx_imx93"],
            lambda: check_one_line(
                README_COMMANDS["convert_onnx_imx93"],
                refused,
                r"edge-un convert: error: this installation cannot build imx93: the "
                r"PyTorch -> LiteRT converter .* environment is missing .*; the ONNX -> "
                r"TFLite converter .* environment is missing .*; the edge-un:onnx Docker "
                r"image has none",
            ),
        )
        litert = VARIANTS["litert"]["targets"]
        checks.add(
            "targets",
            "litert",
            README_COMMANDS["targets_litert"],
            lambda: check_targets(README_COMMANDS["targets_litert"], litert),
        )
        checks.add(
            "convert, default targets",
            "litert",
            README_COMMANDS["convert_litert"],
            lambda: check_convert(README_COMMANDS["convert_litert"], litert_dir, 1001, litert),
        )
        checks.add(
            "an ONNX file: cpu built, imx93 failed naming onnx2tf",
            "litert",
            README_COMMANDS["convert_litert_onnx"],
            lambda: check_onnx_without_onnx2tf(
                README_COMMANDS["export_litert"],
                README_COMMANDS["convert_litert_onnx"],
                litert_onnx_dir,
            ),
            f"{README_COMMANDS['export_litert']}; {README_COMMANDS['convert_litert_onnx']}",
        )
        checks.add(
            "token create + serve + upload + poll to succeeded",
            "full",
            README_COMMANDS["serve"],
            lambda: check_service(README_COMMANDS["token"], README_COMMANDS["serve"]),
            f"{README_COMMANDS['token']}; {README_COMMANDS['serve']} (another volume and port)",
        )
    finally:
        for path in (root_dir, user_dir, onnx_dir, litert_dir, litert_onnx_dir, clean, refused):
            shutil.rmtree(path, ignore_errors=True)
    results["checks"] = checks.results
    results["all_ok"] = all(c["ok"] for c in checks.results)
    results["seconds"] = round(time.monotonic() - started)
    return results


# -- report ----------------------------------------------------------------------------------


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def markdown(results: dict[str, Any]) -> str:
    base = results["base"]
    lines = [
        "# The Docker image: sizes and checks",
        "",
        f"{results['date']}, {results['host']['cpus']} cores; built with docker-check (podman). "
        f"`{base['image']}` here is "
        + ("docker-check's stand-in" if base["standin"] else "the official image")
        + f": {gb(base['bytes'])}"
        + (
            f", of which /wheels (a copy of the host's wheels, absent from the official image) "
            f"{base['du_mib'].get('/wheels', 0)} MiB"
            if base["standin"]
            else ""
        )
        + ". Generated by `python -m benchmarks.service.docker_image`.",
        "",
        "| image | size | goal | above the base | main venv | litert-torch env | onnx2tf env "
        "| build |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = [(v, results["variants"][v]) for v in results["variants"]]
    if "baseline" in results:
        rows.insert(0, ("before", results["baseline"]))
    for variant, info in rows:
        du = info["du_mib"]
        goal = results["goals_gb"].get(variant)
        build = info["build"]
        lines.append(
            f"| `{info['tag']}` ({variant}) | {gb(info['bytes'])} | "
            + (f"<= {goal} GB" if goal else "-")
            + f" | {gb(info['bytes'] - base['bytes'])} | "
            + f"{du.get('main venv', 0)} MiB | "
            + f"{du.get('litert-env', 0)} MiB | "
            + f"{du.get('tflite-env', 0)} MiB | "
            + f"{build['seconds']:.0f} s ({build['cached_steps']} cached steps) |"
        )
    for _, info in rows:
        lines += [
            "",
            f"## Layers of `{info['tag']}` (non-empty, newest first)",
            "",
            "| size | created by |",
            "|---|---|",
        ]
        for layer in info["layers"]:
            size = layer["bytes"]
            shown = f"{size / 1e6:,.1f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"
            lines.append(f"| {shown} | `{layer['created_by'][:110]}` |")
        biggest = [(k, v) for k, v in info["du_mib"].items() if ":" in k]
        if biggest:
            lines += ["", "Biggest packages (MiB): " + ", ".join(f"{k} {v}" for k, v in biggest)]
    lines += [
        "",
        "## Checks",
        "",
        "Each command as the Docker page (docs/service/docker.md) writes it (`docker` run as"
        " podman), and where the check runs it otherwise, how.",
        "",
        "| check | image | README's command | run as | result | time |",
        "|---|---|---|---|---|---|",
    ]
    shown = (
        "exit",
        "targets",
        "drift_pts",
        "owners_of_out",
        "notes",
        "line",
        "state",
        "job_s",
        "artifacts",
        "bundle_status",
        "healthcheck",
        "volume_owners",
        "process_user",
        "uid",
        "gid",
        "groups",
        "user",
        "home",
        "unreadable_count",
        "can_build",
        "error",
        "stderr",
    )
    for check in results["checks"]:
        readme = check.get("readme", check["command"])
        missing = "" if check["in_readme"] else " **(not in README)**"
        run_as = "" if check["command"] == readme else f"`{check['command']}`"
        detail = check["detail"]
        summary = ", ".join(
            f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
            for k, v in detail.items()
            if k in shown and v not in ("", None)
        )
        lines.append(
            f"| {check['name']} | {check['variant']} | `{readme}`{missing} | {run_as} | "
            f"{'ok' if check['ok'] else '**FAILED**'}: {summary.replace('|', '/')} | "
            f"{check['seconds']:.0f} s |"
        )
    lines += [
        "",
        f"All checks passed: {'yes' if results['all_ok'] else '**no**'}; "
        f"total {results['seconds'] / 60:.0f} min.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    benchmark_main(NAME, __doc__, run_all, markdown, lambda results: None)


if __name__ == "__main__":
    main()
