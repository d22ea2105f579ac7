"""Run an ONNX model on an emulated x86 CPU, to see what a host one does not have computes.

ONNX Runtime picks its int8 kernels from the CPU it runs on (quant.host), so a file's figures on
a machine with VNNI say nothing about one without. QEMU's user mode (``qemu-x86_64 -cpu
Haswell``, Debian package ``qemu-user``) runs the same Python and ONNX Runtime on a CPU model
without AVX-512 or VNNI; ONNX Runtime then selects its AVX2 kernels whatever the real host is.
Only inference runs emulated (about 100x slower): quantize natively, then run here.
QEMU's TCG has no AVX-512, so the other direction (VNNI on a machine without it) cannot be
emulated this way.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..errors import ToolError

QEMU = "qemu-x86_64"
NON_VNNI_CPU = "Haswell"  # AVX2, FMA; no AVX-512, no VNNI
TIMEOUT_S = 1800

# Runs inside the emulated process: no edge-un import (faster start, nothing else emulated).
_RUNNER = """
import sys
import numpy as np
import onnxruntime as ort

model, inputs, outputs = sys.argv[1:4]
options = ort.SessionOptions()
options.intra_op_num_threads = 1
options.log_severity_level = 3
session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
first = session.get_inputs()[0]
batch = first.shape[0] if isinstance(first.shape[0], int) else 64
data = np.load(inputs)
chunks = [data[i : i + batch] for i in range(0, len(data), batch)]
np.save(outputs, np.concatenate([session.run(None, {first.name: c})[0] for c in chunks]))
"""


class EmulationUnavailable(ToolError):
    """QEMU's user-mode x86 emulator is not installed."""


def qemu_available() -> bool:
    return shutil.which(QEMU) is not None


def run_onnx_emulated(model: Path, inputs: np.ndarray, cpu: str = NON_VNNI_CPU) -> np.ndarray:
    """The model's first output on ``inputs``, computed by ONNX Runtime on the emulated ``cpu``
    (this interpreter and its ONNX Runtime, run by ``qemu-x86_64 -cpu CPU``)."""
    qemu = shutil.which(QEMU)
    if qemu is None:
        raise EmulationUnavailable(f"{QEMU} not found: install the Debian package qemu-user")
    with tempfile.TemporaryDirectory() as scratch:
        feed, result = Path(scratch) / "inputs.npy", Path(scratch) / "outputs.npy"
        np.save(feed, inputs)
        command = [qemu, "-cpu", cpu, sys.executable, "-c", _RUNNER, str(model), str(feed),
                   str(result)]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            raise RuntimeError(f"ONNX Runtime under {QEMU} -cpu {cpu} failed: {last}")
        return np.load(result)
