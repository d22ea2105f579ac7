"""The isolated TFLite-converter environment: onnx2tf and TensorFlow in a venv of their own.

Why a separate environment: onnx2tf 1.29 pins its whole stack exactly (numpy 1.26, onnx 1.19,
onnxruntime 1.23, TensorFlow 2.19, protobuf 4.25), which clashes with the main venv (numpy 2,
onnx 1.23, onnxruntime 1.31). So it lives in its own venv and runs only as a subprocess
(`quant.tflite`); the main venv never imports TensorFlow.

Where: ``$EDGE_UN_TFLITE_ENV``, default ``<sys.prefix>/tflite-env`` (a venv inside the main
venv, so it moves with the install, Docker image included). ``python -m quant.toolenv`` creates
it (the install script calls that); a conversion asked for without it raises
``ToolEnvMissingError`` with the command to run.

Every pin is here, read off an environment in which onnx2tf converted, quantized and Vela-compiled
the bundled examples: ``PINS`` are the packages we rely on by name, ``LOCK`` is the rest of what
pip resolved for them, installed as constraints so that a later release of a transitive
dependency (keras, h5py, ml-dtypes, ...) cannot change the converter under us. A marker file in
the environment records the hash of both; a changed pin recreates the environment from scratch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

ENV_VAR = "EDGE_UN_TFLITE_ENV"
MARKER = "edge-un-toolenv.json"

# The converter and what we call or rely on directly. tensorflow on Linux x86-64 is the CPU
# build (GPU support is the separate `tensorflow[and-cuda]` extra): no nvidia-* package comes in,
# which `ensure` checks. onnxsim: onnx2tf requires it and runs the `onnxsim` command from PATH
# three times before converting (it only warns if missing); on the folded edge-un exports it
# changes nothing (byte-identical TFLite) and costs ~2 s, but it helps foreign ONNX files.
PINS: tuple[str, ...] = (
    "onnx2tf==1.29.24",
    "tensorflow==2.19.0",
    "tf_keras==2.19.0",
    "numpy==1.26.4",
    "onnx==1.19.1",
    "onnxruntime==1.23.0",
    "protobuf==4.25.5",
    "onnxsim==0.4.36",
    "sne4onnx==2.0.1",
    "sng4onnx==2.0.1",
    "psutil==5.9.5",
)

# Everything else pip resolved for PINS (2026-11, Python 3.11, Linux x86-64), as constraints.
LOCK: tuple[str, ...] = (
    "absl-py==2.5.1",
    "ai-edge-litert==2.1.0",
    "astunparse==1.6.3",
    "backports.strenum==1.2.8",
    "certifi==2026.10.18",
    "charset-normalizer==3.5.2",
    "coloredlogs==15.0.1",
    "flatbuffers==25.12.19",
    "gast==0.7.0",
    "google-pasta==0.2.0",
    "grpcio==1.85.1",
    "h5py==3.11.0",
    "humanfriendly==10.0",
    "idna==3.20",
    "json2onnx==2.0.3",
    "keras==3.15.1",
    "libclang==18.1.1",
    "Markdown==3.11.3",
    "markdown-it-py==4.3.0",
    "MarkupSafe==3.0.4",
    "mdurl==0.1.2",
    "ml_dtypes==0.5.1",
    "mpmath==1.3.0",
    "namex==0.1.0",
    "onnx2json==2.0.4",
    "onnx_graphsurgeon==0.5.8",
    "onnxoptimizer==0.4.2",
    "opencv-python==4.11.0.86",
    "opt_einsum==3.4.0",
    "optree==0.20.0",
    "packaging==26.3",
    "Pygments==2.21.0",
    "requests==2.32.5",
    "rich==15.0.0",
    "sam4onnx==2.0.0",
    "sbi4onnx==1.0.7",
    "scc4onnx==1.0.7",
    "scs4onnx==1.0.18",
    "sde4onnx==1.0.0",
    "sed4onnx==1.0.5",
    "simple_onnx_processing_tools==1.1.32",
    "sio4onnx==1.0.3",
    "sit4onnx==1.0.10",
    "six==1.17.0",
    "sna4onnx==1.0.6",
    "snc4onnx==1.0.14",
    "snd4onnx==1.1.7",
    "soa4onnx==1.0.5",
    "soc4onnx==1.0.2",
    "sod4onnx==1.0.0",
    "sog4onnx==1.0.17",
    "sor4onnx==1.0.7",
    "spo4onnx==1.0.5",
    "ssc4onnx==1.0.8",
    "ssi4onnx==1.0.4",
    "svs4onnx==1.0.0",
    "sympy==1.14.0",
    "tensorboard==2.19.0",
    "tensorboard-data-server==0.7.2",
    "tensorflow-io-gcs-filesystem==0.37.1",
    "termcolor==3.3.0",
    "tqdm==4.70.1",
    "typing_extensions==4.16.0",
    "urllib3==2.8.0",
    "Werkzeug==3.1.9",
    "wheel==0.48.0",
    "wrapt==2.5.2",
)

Progress = Callable[[str], None]
INSTALL_TIMEOUT_S = 3600


class ToolEnvMissingError(RuntimeError):
    """The converter environment is absent or was built from other pins."""


class ToolEnvError(RuntimeError):
    """Creating the converter environment failed (one line; pip's log is kept)."""


def env_dir() -> Path:
    """Where the environment lives: $EDGE_UN_TFLITE_ENV or <sys.prefix>/tflite-env."""
    configured = os.environ.get(ENV_VAR)
    return Path(configured).expanduser() if configured else Path(sys.prefix) / "tflite-env"


def bin_dir(env: Path | None = None) -> Path:
    return (env or env_dir()) / "bin"


def python_path(env: Path | None = None) -> Path:
    return bin_dir(env) / "python"


def installed_versions(names: Sequence[str], env: Path | None = None) -> dict[str, str]:
    """Versions of ``names`` installed in the environment, read from their package metadata
    (nothing is imported or run); a name that is not installed is left out."""
    site_packages = [str(p) for p in (env or env_dir()).glob("lib/python*/site-packages")]
    found = {}
    for dist in importlib.metadata.distributions(path=site_packages):
        name = dist.metadata["Name"]
        if name and name.lower() in {n.lower() for n in names}:
            found[name.lower()] = dist.version
    return found


def pins_hash() -> str:
    """Hash of every pin; stored in the marker so a changed pin means a rebuild."""
    text = "\n".join((*PINS, "--", *LOCK, "--", f"py{sys.version_info[0]}.{sys.version_info[1]}"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_ready(env: Path | None = None) -> bool:
    """True when the environment exists and was built from exactly these pins."""
    env = env or env_dir()
    marker = env / MARKER
    if not (python_path(env).exists() and marker.is_file()):
        return False
    try:
        recorded = json.loads(marker.read_text()).get("pins_hash")
    except (OSError, ValueError):
        return False
    return recorded == pins_hash()


def require() -> Path:
    """The ready environment, or ToolEnvMissingError naming the command that creates it."""
    env = env_dir()
    if not is_ready(env):
        state = "built from other pins" if (env / MARKER).exists() else "missing"
        raise ToolEnvMissingError(
            f"the TFLite converter environment is {state} at {env}: "
            "run `python -m quant.toolenv` (or bash .ci/install)"
        )
    return env


def ensure(progress: Progress | None = None) -> Path:
    """Create the environment if it is missing or its recorded pins differ; return its path.

    A stale environment is deleted and rebuilt from scratch (pip upgrading in place can leave
    packages of the old set behind). A directory that is not one of ours is never deleted.
    """
    say = progress or (lambda line: None)
    env = env_dir()
    if is_ready(env):
        say(f"TFLite converter environment ready at {env}")
        return env
    if env.exists():
        if not (env / "pyvenv.cfg").is_file():
            raise ToolEnvError(
                f"{env} exists and is not a virtual environment: remove it or set "
                f"{ENV_VAR} elsewhere"
            )
        say(f"removing the outdated environment at {env}")
        shutil.rmtree(env)
    say(f"creating the TFLite converter environment at {env}")
    env.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(env)], env, "venv")
    with tempfile.TemporaryDirectory() as tmp:
        requirements, constraints = Path(tmp) / "requirements.txt", Path(tmp) / "constraints.txt"
        requirements.write_text("\n".join(PINS) + "\n")
        constraints.write_text("\n".join(LOCK) + "\n")
        say(
            f"installing onnx2tf and TensorFlow ({len(PINS)} pins, {len(LOCK)} locked "
            "dependencies; about 2.6 GB, a few minutes)"
        )
        _run(
            [
                str(python_path(env)),
                "-m",
                "pip",
                "install",
                "--no-input",
                "--disable-pip-version-check",
                "-r",
                str(requirements),
                "-c",
                str(constraints),
            ],
            env,
            "pip install",
        )
    say("checking that no CUDA build came in")
    _check_no_cuda(env)
    (env / MARKER).write_text(
        json.dumps({"pins_hash": pins_hash(), "pins": list(PINS), "lock": list(LOCK)}, indent=2)
        + "\n"
    )
    say(f"TFLite converter environment ready at {env}")
    return env


def _run(cmd: Sequence[str], env: Path, what: str) -> None:
    """Run one setup step; on failure keep its output in a log beside the environment."""
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
    )
    if proc.returncode != 0:
        log = env.parent / f"{env.name}-install.log"
        log.write_text(proc.stdout + "\n" + proc.stderr)
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit code {proc.returncode}"
        raise ToolEnvError(
            f"{what} failed for the TFLite converter environment: {last} (full log: {log})"
        )


def _check_no_cuda(env: Path) -> None:
    """TensorFlow's CUDA build would pull GBs of nvidia-* wheels: refuse such an environment."""
    proc = subprocess.run(
        [str(python_path(env)), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    )
    cuda = [ln.split("==")[0] for ln in proc.stdout.splitlines() if ln.lower().startswith("nvidia")]
    if cuda:
        raise ToolEnvError(
            f"the TFLite converter environment at {env} pulled CUDA packages "
            f"({', '.join(cuda)}): expected the CPU build of TensorFlow"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m quant.toolenv`: create the environment, printing progress lines."""
    del argv
    try:
        ensure(progress=lambda line: print(f"toolenv: {line}", flush=True))
    except (ToolEnvError, subprocess.SubprocessError, OSError) as exc:
        print(f"toolenv: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
