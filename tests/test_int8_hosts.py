"""int8 figures that hold on every host: the cpu file computes the same with and without VNNI,
drift is measured in the target's exact arithmetic, and every report names its host.

ONNX Runtime's x86 u8s8 kernels without VNNI add pairs of products in int16 and saturate with
8-bit weights (98.3 % instead of 99.8 % agreement on the migrated ViT). The tests that must hold
on a VNNI machine too run the file on an emulated Haswell (QEMU user mode), where ONNX Runtime
takes its AVX2 kernels whatever the real CPU is; a control file with 8-bit weights shows that
the emulation really saturates.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from converters.fold_and_export import export_folded, load_and_fold
from edge_un import examples
from quant.host import describe_host, int8_kernels
from quant.measure.bars import DEFAULT_MIN_AGREEMENT
from quant.measure.drift import Drift, measure_drift, onnx_runner
from quant.measure.emulation import qemu_available, run_onnx_emulated
from quant.ort.quantize import quantize_onnx
from quant.ort.target import kernel_warnings
from quant.report import Host
from quant.samples import checkpoint_samples
from quant.targets import PROFILES

from .servers import missing

CPU = PROFILES["cpu"]
EMULATED_SAMPLES = 200  # ~15 s a file under QEMU; enough for the 8-bit file to saturate


@pytest.fixture(scope="module")
def cpu_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per bundled ViT: its fp32 file, the cpu target's file, an 8-bit-weight twin, the cpu
    ladder's U8U8 file (u8 weights in 8 bits, biases corrected) and the cpu file with its
    attention's K and V s8 however small the products (these ViTs' are below the profile's
    bound)."""
    directory = tmp_path_factory.mktemp("hosts")
    files = {}
    for name in ("vit-mnist-ln-to-un", "vit-mnist-un"):
        folded = load_and_fold(examples.path(name))
        fp32 = directory / f"{name}.onnx"
        export_folded(folded, fp32, opset=CPU.opset, dynamic_batch=True)
        calibration = checkpoint_samples(folded.info, "train", 256)
        portable, eight_bit = directory / f"{name}_cpu.onnx", directory / f"{name}_8bit.onnx"
        u8u8, signed = directory / f"{name}_u8u8.onnx", directory / f"{name}_signed.onnx"
        quantize_onnx(fp32, portable, CPU, calibration)
        quantize_onnx(fp32, signed, dataclasses.replace(CPU, signed_min_macs=0), calibration)
        quantize_onnx(fp32, eight_bit, dataclasses.replace(CPU, weight_bits=8), calibration)
        quantize_onnx(fp32, u8u8, CPU.int8_recipes[-1], calibration)
        files[name] = {
            "fp32": fp32,
            "cpu": portable,
            "8bit": eight_bit,
            "u8u8": u8u8,
            "signed": signed,
            "test": checkpoint_samples(folded.info, "test"),
        }
    return files


def exact_outputs(path: Path, inputs: np.ndarray) -> np.ndarray:
    """The QDQ graph as written, by a plain session with every graph optimization off."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate(
        [session.run(None, {name: inputs[i : i + 100]})[0] for i in range(0, len(inputs), 100)]
    )


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).min())


@pytest.mark.parametrize("name", ["vit-mnist-ln-to-un", "vit-mnist-un"])
def test_the_cpu_file_meets_the_bar_exactly_and_on_this_hosts_kernels(
    cpu_files: dict, name: str
) -> None:
    files = cpu_files[name]
    test = files["test"]
    reference = onnx_runner(files["fp32"])(test.inputs)
    exact = measure_drift(reference, exact_outputs(files["cpu"], test.inputs), test.labels)
    here = measure_drift(reference, onnx_runner(files["cpu"])(test.inputs), test.labels)
    assert exact.agreement >= DEFAULT_MIN_AGREEMENT, exact
    assert here.agreement >= DEFAULT_MIN_AGREEMENT, (describe_host().label(), here)
    assert abs(here.agreement - exact.agreement) <= 0.002, (here, exact)


def test_on_a_cpu_without_vnni_the_cpu_file_computes_its_exact_arithmetic(cpu_files: dict) -> None:
    if not qemu_available():
        missing("qemu-x86_64 (Debian qemu-user) is not installed")
    files = cpu_files["vit-mnist-ln-to-un"]
    inputs = files["test"].inputs[:EMULATED_SAMPLES]
    portable = run_onnx_emulated(files["cpu"], inputs)
    control = run_onnx_emulated(files["8bit"], inputs)
    # the control: 8-bit weights saturate the emulated AVX2 kernels (per-sample cosine 0.80 here)
    assert min_cosine(control, exact_outputs(files["8bit"], inputs)) < 0.95
    # 7-bit weights cannot: the same logits as the exact arithmetic, up to requantize rounding
    exact = exact_outputs(files["cpu"], inputs)
    assert min_cosine(portable, exact) > 0.995
    assert (portable.argmax(-1) == exact.argmax(-1)).mean() >= 0.99


@pytest.mark.parametrize(
    "variant",
    [
        # the cpu ladder's last pure int8 recipe keeps 8-bit weights: host-safe only because
        # ORT's U8U8 kernels never add products in int16
        "u8u8",
        # K and V in 7-bit s8 (clipped) reach ORT's u8 x s8 kernels, which add pairs of
        # products in int16 on an AVX2 core: like 7-bit weights they cannot saturate there
        "signed",
    ],
)
def test_the_files_that_rely_on_their_kernels_compute_their_exact_arithmetic_without_vnni(
    cpu_files: dict, variant: str
) -> None:
    """Checked where it matters, on an AVX2 core (QEMU's Haswell model)."""
    if not qemu_available():
        missing("qemu-x86_64 (Debian qemu-user) is not installed")
    files = cpu_files["vit-mnist-ln-to-un"]
    inputs = files["test"].inputs[:EMULATED_SAMPLES]
    emulated = run_onnx_emulated(files[variant], inputs)
    exact = exact_outputs(files[variant], inputs)
    assert min_cosine(emulated, exact) > 0.995
    assert (emulated.argmax(-1) == exact.argmax(-1)).mean() >= 0.99


def test_the_cpu_profile_uses_7_bit_weights_and_says_why() -> None:
    assert CPU.weight_bits == 7 and CPU.host_kernel_drift
    assert any("VPMADDUBSW" in rule for rule in CPU.rules)
    tda4vm = PROFILES["tda4vm"]  # never runs on the conversion host: exact figure only
    assert not tda4vm.host_kernel_drift and tda4vm.weight_bits == 8


def test_a_gap_between_exact_and_host_kernels_is_reported_only_past_0_2_points() -> None:
    def drift(agreement: float, drop: float) -> Drift:
        return Drift(0.97, 0.97 - drop / 100, drop, agreement, 0.999, 0.1, 1000)

    assert kernel_warnings(drift(0.998, 0.2), drift(0.997, 0.3)) == []
    (warning,) = kernel_warnings(drift(0.998, 0.2), drift(0.983, 0.4))
    assert "1.5 pt (agreement 98.3 vs 99.8 %, top-1 drop 0.4 vs 0.2 pt)" in warning
    (warning,) = kernel_warnings(drift(0.995, 0.0), drift(0.995, 0.5))  # top-1 alone
    assert "0.5 pt" in warning


def test_the_host_is_described_with_the_features_that_change_int8_kernels() -> None:
    host = describe_host()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    for feature in ("avx2", "avx512_vnni", "avx_vnni", "amx_int8"):
        assert (feature in host.int8_features) == (f" {feature}" in flags), feature
    assert host.cores >= 1 and host.cpu
    for package in ("onnxruntime", "ai-edge-litert", "ethos-u-vela", "torch", "onnx2tf"):
        assert host.versions[package] not in ("", "not installed"), package
    assert host.label().startswith(host.cpu)


@pytest.mark.parametrize(
    ("machine", "features", "label", "kernels"),
    [
        ("x86_64", ["avx2"], "AVX2, no VNNI", "saturate"),
        ("x86_64", ["avx2", "avx512f", "avx512_vnni"], "AVX2, AVX512F, AVX512-VNNI", "int32"),
        ("x86_64", ["avx2", "avx_vnni"], "AVX2, AVX-VNNI", "int32"),
        ("aarch64", ["asimddp"], "asimddp", "dot product"),
    ],
)
def test_host_labels_name_vnni_or_its_absence(
    machine: str, features: list[str], label: str, kernels: str
) -> None:
    host = Host(
        cpu="Some CPU", microarchitecture="uarch", machine=machine, cores=4,
        int8_features=features, int8_kernels=int8_kernels(machine, frozenset(features)),
        os="Linux", versions={},
    )  # fmt: skip
    assert host.label() == f"Some CPU (uarch, 4 cores, {label})"
    assert kernels in host.int8_kernels
