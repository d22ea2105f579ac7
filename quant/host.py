"""The machine that measured a report: its CPU, the ISA features that change int8 kernels, and
the versions of every tool that made or ran the artifacts.

Why a report needs it: int8 figures computed by a host's kernels depend on that host. ONNX
Runtime's x86 u8s8 kernels without VNNI add pairs of u8 x s8 products into int16 (VPMADDUBSW),
which 8-bit weights can saturate; AVX512-VNNI and AVX-VNNI accumulate in int32; Arm's dot-product
(``asimddp``) and ``i8mm`` instructions take other paths again, and each is faster or slower.
Latency from two hosts is comparable only when their int8 kernels are.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

from .report import schema
from .tflite import toolenv

# The features that select ONNX Runtime's / LiteRT's int8 kernels, as Linux names them.
X86_INT8_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
ARM_INT8_FEATURES = ("asimddp", "i8mm", "sve")
VNNI = frozenset({"avx512_vnni", "avx_vnni"})
# What made or ran the artifacts: main environment, then the TFLite converter's own
MAIN_PACKAGES = ("torch", "onnx", "onnxruntime", "ai-edge-litert", "ethos-u-vela")
TOOL_PACKAGES = ("onnx2tf", "tensorflow")
LITERT_PACKAGES = ("litert-torch", "ai-edge-quantizer")


def describe_host() -> schema.Host:
    """This machine, as a report records it."""
    machine = platform.machine().lower()
    features = _cpu_flags()
    wanted = ARM_INT8_FEATURES if machine in ("aarch64", "arm64") else X86_INT8_FEATURES
    present = [name for name in wanted if name in features]
    return schema.Host(
        cpu=_brand(),
        microarchitecture=_microarchitecture(),
        machine=machine,
        cores=_usable_cores(),
        int8_features=present,
        int8_kernels=int8_kernels(machine, frozenset(present)),
        os=f"{platform.system()} {platform.release()}",
        versions=_versions(),
    )


def _usable_cores() -> int:
    """Cores this process may run on (a container or taskset may allow fewer than exist)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def int8_kernels(machine: str, features: frozenset[str]) -> str:
    """What the host's features mean for ONNX Runtime's int8 matrix products, in one sentence."""
    if machine in ("x86_64", "amd64"):
        if features & VNNI:
            return "VNNI: u8 x s8 products accumulate in int32 (no saturation)"
        if "avx2" in features:
            return (
                "AVX2 without VNNI: pairs of u8 x s8 products add in int16 (VPMADDUBSW), which "
                "8-bit weights can saturate and 7-bit weights cannot"
            )
        return "x86 without AVX2: products widen to int16 before they add (no saturation)"
    if machine in ("aarch64", "arm64"):
        if "i8mm" in features:
            return "Arm i8mm: int8 matrix multiply-accumulate into int32"
        if "asimddp" in features:
            return "Arm dot product (asimddp): int8 products accumulate in int32"
        return "Arm NEON without dot product: products widen to int16, sums in int32"
    return f"{machine}: int8 kernels not characterised"


def _cpu_flags() -> frozenset[str]:
    """The kernel's view of the CPU's features (Linux: /proc/cpuinfo), else archspec's."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):  # x86, Arm
                return frozenset(value.split())
    try:
        import archspec.cpu

        return frozenset(archspec.cpu.host().features)
    except Exception:  # an unknown platform: report no features rather than fail a conversion
        return frozenset()


def _brand() -> str:
    try:
        import archspec.cpu

        brand = archspec.cpu.brand_string()
    except Exception:
        brand = None
    return (brand or platform.processor() or platform.machine() or "unknown CPU").strip()


def _microarchitecture() -> str:
    try:
        import archspec.cpu

        return archspec.cpu.host().name
    except Exception:
        return "unknown"


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in MAIN_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    for env, names in ((toolenv.ONNX2TF, TOOL_PACKAGES), (toolenv.LITERT_TORCH, LITERT_PACKAGES)):
        tools = env.installed_versions(names) if env.is_ready() else {}
        for name in names:
            versions[name] = tools.get(name, "not installed")
    return versions
