"""The converters' isolated environments: each a venv of its own, run only as a subprocess.

Two converters make the TFLite targets' files, and neither can share the main venv as pinned:
- ``LITERT_TORCH``: Google's PyTorch -> LiteRT converter (litert-torch) and its quantizer
  (ai-edge-quantizer), the direct route from a torch program (``quant.tflite.direct``). No
  TensorFlow. Its ``xdsl`` pin wants typing-extensions < 4.13, our pydantic >= 4.14.1, so it has
  a venv of its own; torch, numpy and the rest of what the main venv holds are read from the main
  venv (a ``.pth`` file after the tool's own site-packages), so torch is installed once: 0.8 GB
  instead of 2.1 GB with a second torch.
- ``ONNX2TF``: onnx2tf and TensorFlow, the route for ONNX-only uploads and the fallback when the
  direct route fails (``quant.tflite.onnx2tf``). onnx2tf 1.29 pins its whole stack exactly (numpy
  1.26, onnx 1.19, onnxruntime 1.23, TensorFlow 2.19, protobuf 4.25), which clashes with ours; 2.6
  GB, so it is made only when asked for (``python -m quant.tflite.toolenv onnx2tf``, or
  ``bash .ci/install --with-onnx2tf``).

Where: ``$EDGE_UN_LITERT_TORCH_ENV`` / ``$EDGE_UN_TFLITE_ENV``, default ``<sys.prefix>/litert-env``
/ ``<sys.prefix>/tflite-env`` (inside the main venv, so they move with the install, Docker image
included). A conversion asked for without its environment raises ``ToolEnvMissingError`` with
the command that makes it.

Every pin is here, read off an environment in which the converter built the bundled examples:
``pins`` are the packages we rely on by name, ``lock`` the rest of what pip resolved for them,
installed as constraints so that a later release of a transitive dependency cannot change the
converter under us. A marker file in the environment records the hash of both; a changed pin
recreates the environment from scratch. This module needs only the standard library (the Docker
image builds the onnx2tf environment before the code is copied in).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

MARKER = "edge-un-toolenv.json"
SHARED_SITE_PACKAGES = "zz-edge-un-main.pth"  # "zz": read after the tool's own packages

# The converter and what we call or rely on directly. tensorflow on Linux x86-64 is the CPU
# build (GPU support is the separate `tensorflow[and-cuda]` extra): no nvidia-* package comes in,
# which `ensure` checks. onnxsim: onnx2tf requires it and runs the `onnxsim` command from PATH
# three times before converting (it only warns if missing); on the folded edge-un exports it
# changes nothing (byte-identical TFLite) and costs ~2 s, but it helps foreign ONNX files.
ONNX2TF_PINS: tuple[str, ...] = (
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

# Everything else pip resolved for ONNX2TF_PINS (2026-11, Python 3.11, Linux x86-64), as
# constraints.
ONNX2TF_LOCK: tuple[str, ...] = (
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


# litert-torch converts a torch program to a float .tflite; ai-edge-quantizer quantizes it from
# calibration data (static int8 / int16 activations, per-channel int8 weights, per-op recipes).
# Resolved 2026-12 beside the main venv's torch 2.13.0 (CPU), Python 3.11, Linux x86-64.
LITERT_TORCH_PINS: tuple[str, ...] = (
    "litert-torch==0.10.0",
    "ai-edge-quantizer==0.10.0",
    "litert-converter==0.5.0",
    "torchao==0.18.0",
    "jax==0.10.2",
    "jaxlib==0.10.2",
)

# Everything else pip resolved for LITERT_TORCH_PINS that the main venv does not already hold
# at a version they accept (typing-extensions and pydantic: xdsl's and litert-torch's own pins).
LITERT_TORCH_LOCK: tuple[str, ...] = (
    "absl-py==2.5.1",
    "anyio==4.14.2",
    "fire==0.7.1",
    "immutabledict==4.2.1",
    "jaxtyping==0.3.11",
    "kagglehub==1.0.3",
    "kagglesdk==0.1.38",
    "lark==1.3.1",
    "litert-lm-builder==0.18.1",
    "multipledispatch==1.0.0",
    "opt_einsum==3.4.0",
    "ordered-set==4.1.0",
    "pydantic==2.11.10",
    "pydantic_core==2.33.2",
    "sentencepiece==0.2.3",
    "tabulate==0.10.0",
    "termcolor==3.3.0",
    "tomli==2.5.0",
    "typing_extensions==4.12.2",
    "typing-inspection==0.4.2",
    "wadler_lindig==0.1.8",
    "xdsl==0.28.0",
)

Progress = Callable[[str], None]
INSTALL_TIMEOUT_S = 3600


class ToolEnvMissingError(RuntimeError):
    """A converter environment is absent or was built from other pins."""


class ToolEnvError(RuntimeError):
    """Creating a converter environment failed (one line; pip's log is kept)."""


@dataclass(frozen=True)
class ToolEnv:
    """One converter's environment: where it lives, what goes in, whether it reads the main
    venv's packages after its own."""

    name: str  # what `python -m quant.tflite.toolenv NAME` makes
    what: str  # how errors and progress name it
    env_var: str
    default_dir: str  # under sys.prefix
    pins: tuple[str, ...]
    lock: tuple[str, ...]
    size: str  # what the install is about to cost, said before it starts
    shares_main: bool  # torch and the rest from the main venv (a .pth after its own packages)

    def dir(self) -> Path:
        """Where the environment lives: $ENV_VAR or <sys.prefix>/DEFAULT_DIR."""
        configured = os.environ.get(self.env_var)
        return Path(configured).expanduser() if configured else Path(sys.prefix) / self.default_dir

    def bin_dir(self, env: Path | None = None) -> Path:
        return (env or self.dir()) / "bin"

    def python(self, env: Path | None = None) -> Path:
        return self.bin_dir(env) / "python"

    def installed_versions(self, names: Sequence[str], env: Path | None = None) -> dict[str, str]:
        """Versions of ``names`` installed in the environment itself, read from their package
        metadata (nothing is imported or run); a name that is not installed is left out."""
        site_packages = [str(p) for p in (env or self.dir()).glob("lib/python*/site-packages")]
        wanted = {n.lower() for n in names}
        found = {}
        for dist in importlib.metadata.distributions(path=site_packages):
            name = dist.metadata["Name"]
            if name and name.lower() in wanted:
                found[name.lower()] = dist.version
        return found

    def pins_hash(self) -> str:
        """Hash of every pin; stored in the marker so a changed pin means a rebuild."""
        version = f"py{sys.version_info[0]}.{sys.version_info[1]}"
        text = "\n".join((*self.pins, "--", *self.lock, "--", version))
        if self.shares_main:
            text += f"\n--\nshares {_main_site_packages()}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def is_ready(self, env: Path | None = None) -> bool:
        """True when the environment exists and was built from exactly these pins."""
        env = env or self.dir()
        marker = env / MARKER
        if not (self.python(env).exists() and marker.is_file()):
            return False
        try:
            recorded = json.loads(marker.read_text()).get("pins_hash")
        except (OSError, ValueError):
            return False
        return recorded == self.pins_hash()

    def require(self) -> Path:
        """The ready environment, or ToolEnvMissingError naming the command that creates it."""
        env = self.dir()
        if not self.is_ready(env):
            state = "built from other pins" if (env / MARKER).exists() else "missing"
            raise ToolEnvMissingError(
                f"the {self.what} environment is {state} at {env}: "
                f"run `python -m quant.tflite.toolenv {self.name}`"
            )
        return env

    def ensure(self, progress: Progress | None = None) -> Path:
        """Create the environment if it is missing or its recorded pins differ; return its path.

        A stale environment is deleted and rebuilt from scratch (pip upgrading in place can
        leave packages of the old set behind). A directory that is not one of ours is never
        deleted."""
        say = progress or (lambda line: None)
        env = self.dir()
        if self.is_ready(env):
            say(f"{self.what} environment ready at {env}")
            return env
        if env.exists():
            if not (env / "pyvenv.cfg").is_file():
                raise ToolEnvError(
                    f"{env} exists and is not a virtual environment: remove it or set "
                    f"{self.env_var} elsewhere"
                )
            say(f"removing the outdated environment at {env}")
            shutil.rmtree(env)
        say(f"creating the {self.what} environment at {env}")
        env.parent.mkdir(parents=True, exist_ok=True)
        self._run([sys.executable, "-m", "venv", str(env)], env, "venv")
        if self.shares_main:
            # before pip runs, so that it counts torch & co. as installed and leaves them there
            (self._site_packages(env) / SHARED_SITE_PACKAGES).write_text(
                f"{_main_site_packages()}\n"
            )
        with tempfile.TemporaryDirectory() as tmp:
            requirements = Path(tmp) / "requirements.txt"
            constraints = Path(tmp) / "constraints.txt"
            requirements.write_text("\n".join(self.pins) + "\n")
            constraints.write_text("\n".join(self.lock) + "\n")
            say(
                f"installing {self.what} ({len(self.pins)} pins, {len(self.lock)} locked "
                f"dependencies; {self.size})"
            )
            pip = [str(self.python(env)), "-m", "pip", "install", "--no-input"]
            pip += ["--disable-pip-version-check", "-r", str(requirements), "-c", str(constraints)]
            self._run(pip, env, "pip install")
        say("checking that no CUDA build came in")
        self._check_no_cuda(env)
        (env / MARKER).write_text(
            json.dumps(
                {"pins_hash": self.pins_hash(), "pins": list(self.pins), "lock": list(self.lock)},
                indent=2,
            )
            + "\n"
        )
        say(f"{self.what} environment ready at {env}")
        return env

    @staticmethod
    def _site_packages(env: Path) -> Path:
        return next(env.glob("lib/python*/site-packages"))

    def _run(self, cmd: Sequence[str], env: Path, what: str) -> None:
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
                f"{what} failed for the {self.what} environment: {last} (full log: {log})"
            )

    def _check_no_cuda(self, env: Path) -> None:
        """A CUDA build (TensorFlow's, or a second torch) would pull GBs of nvidia-* wheels."""
        proc = subprocess.run(
            [str(self.python(env)), "-m", "pip", "list", "--format=freeze", "--path",
             str(self._site_packages(env))],
            capture_output=True,
            text=True,
            check=True,
        )  # fmt: skip
        cuda = [
            ln.split("==")[0] for ln in proc.stdout.splitlines() if ln.lower().startswith("nvidia")
        ]
        if cuda:
            raise ToolEnvError(
                f"the {self.what} environment at {env} pulled CUDA packages "
                f"({', '.join(cuda)}): expected CPU builds only"
            )


def _main_site_packages() -> str:
    """The main venv's own site-packages (where torch is), for a tool env that shares it."""
    return sysconfig.get_paths()["purelib"]


LITERT_TORCH = ToolEnv(
    name="litert-torch",
    what="PyTorch -> LiteRT converter (litert-torch, ai-edge-quantizer)",
    env_var="EDGE_UN_LITERT_TORCH_ENV",
    default_dir="litert-env",
    pins=LITERT_TORCH_PINS,
    lock=LITERT_TORCH_LOCK,
    size="about 0.8 GB beside the main venv's torch, under a minute",
    shares_main=True,
)
ONNX2TF = ToolEnv(
    name="onnx2tf",
    what="ONNX -> TFLite converter (onnx2tf, TensorFlow)",
    env_var="EDGE_UN_TFLITE_ENV",
    default_dir="tflite-env",
    pins=ONNX2TF_PINS,
    lock=ONNX2TF_LOCK,
    size="about 2.6 GB, a few minutes",
    shares_main=False,
)
ENVS = {env.name: env for env in (LITERT_TORCH, ONNX2TF)}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m quant.tflite.toolenv [NAME ...]`: create the named environments (default: the
    litert-torch one), printing progress lines."""
    names = list(sys.argv[1:] if argv is None else argv) or [LITERT_TORCH.name]
    unknown = [name for name in names if name not in ENVS]
    if unknown:
        print(f"toolenv: error: unknown environment {unknown[0]!r}; choose from {', '.join(ENVS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    for name in names:
        try:
            ENVS[name].ensure(progress=lambda line: print(f"toolenv: {line}", flush=True))
        except (ToolEnvError, subprocess.SubprocessError, OSError) as exc:
            print(f"toolenv: error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
