"""Why int8 TFLite runs slower than fp32 in LiteRT on this x86 machine: one kernel at a time.

    .venv/bin/python -m benchmarks.studies.litert_kernels  # ~1 min; needs the TFLite converter venv

Builds one-op TFLite files with ViT-Tiny's shapes (batch 1, 197 tokens, dim 192, 3 heads), full
int8 and fp32, with TensorFlow's converter in the converter venv (``quant.tflite.toolenv``; the
builder is ``benchmarks.studies.litert_kernels_build``), then times each with LiteRT, one thread,
with the default XNNPACK delegate and without it. A kernel XNNPACK does not take runs on TFLite's
own kernels; multiplied by how often ViT-Tiny's int8 file holds that op, that is where its time
goes. Writes benchmarks/results/litert_kernels.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from ai_edge_litert.interpreter import Interpreter, OpResolverType

from benchmarks.common.results import RESULTS, ROOT
from quant.tflite import toolenv

# a module of this package, run by the converter venv's python
BUILDER = "benchmarks.studies.litert_kernels_build"
VIT_TINY_INT8 = ROOT / "build" / "latency-bench" / "vit-tiny-un" / "tflite" / "model_int8.tflite"
CALLS, ROUNDS = 30, 5


def build(out: Path) -> list[str]:
    """The one-op files (``<kernel>_<int8|fp32>.tflite``), made in the converter venv."""
    subprocess.run(
        [str(toolenv.ONNX2TF.python()), "-m", BUILDER, str(out)],
        cwd=ROOT,  # where that python finds the package (it has nothing of this project's)
        check=True,
        capture_output=True,
        text=True,
    )
    return sorted({p.stem.rsplit("_", 1)[0] for p in out.glob("*.tflite")})


def interpreter(path: Path, xnnpack: bool) -> Interpreter:
    builtin = OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    extra = {} if xnnpack else {"experimental_op_resolver_type": builtin}
    interp = Interpreter(model_path=str(path), num_threads=1, **extra)
    interp.allocate_tensors()
    rng = np.random.default_rng(0)
    for detail in interp.get_input_details():
        info = np.iinfo(detail["dtype"]) if detail["dtype"] != np.float32 else None
        value = (
            rng.integers(info.min, info.max, detail["shape"], dtype=detail["dtype"])
            if info
            else rng.standard_normal(detail["shape"]).astype(np.float32)
        )
        interp.set_tensor(detail["index"], value)
    return interp


def delegated(interp: Interpreter) -> bool:
    return any(op["op_name"] == "DELEGATE" for op in interp._get_ops_details())


def time_all(files: dict[str, Path]) -> dict[str, dict]:
    """p50 ms of every (file, XNNPACK on/off), round-robin over ``ROUNDS`` rounds."""
    interps = {
        (key, xnnpack): interpreter(path, xnnpack)
        for key, path in files.items()
        for xnnpack in (True, False)
    }
    calls: dict[tuple[str, bool], list[float]] = {k: [] for k in interps}
    for _ in range(ROUNDS):
        for key, interp in interps.items():
            interp.invoke()
            for _ in range(CALLS):
                start = time.perf_counter()
                interp.invoke()
                calls[key].append(time.perf_counter() - start)
    return {
        f"{key} {'xnnpack' if xnnpack else 'builtin'}": {
            "p50_ms": round(1e3 * float(np.median(calls[(key, xnnpack)])), 4),
            "delegated": delegated(interps[(key, xnnpack)]),
        }
        for key, xnnpack in interps
    }


def model_ops(path: Path) -> dict[str, int]:
    """Op type -> count in ViT-Tiny's int8 file (what multiplies each kernel's time)."""
    if not path.exists():
        return {}
    interp = Interpreter(model_path=str(path), num_threads=1)
    counts = Counter(op["op_name"] for op in interp._get_ops_details())
    return dict(counts)


# one-op file (the builder's names) -> (its op type, how many ViT-Tiny holds: 12 blocks)
KERNELS = {
    "batch_matmul_scores": ("BATCH_MATMUL", 12),
    "batch_matmul_values": ("BATCH_MATMUL", 12),
    "batch_matmul_scores_unrolled": ("BATCH_MATMUL", 0),  # an alternative, not in the file
    "softmax": ("SOFTMAX", 12),
    "gelu": ("GELU", 12),
    "fc1": ("FULLY_CONNECTED", 12),
    "fc2": ("FULLY_CONNECTED", 12),
    "add": ("ADD", 25),
    "transpose": ("TRANSPOSE", 50),
}


def report(result: dict) -> str:
    timings, ops = result["timings"], result["vit_tiny_int8_ops"]
    lines = [
        "# LiteRT kernels, int8 vs fp32, one op at a time (ViT-Tiny's shapes)",
        "",
        f"Made by `.venv/bin/python -m benchmarks.studies.litert_kernels`, {result['started_utc']} "
        "UTC; "
        f"LiteRT {result['litert']}; one thread; p50 of {ROUNDS} x {CALLS} invokes. "
        "'delegated' = XNNPACK took the op; otherwise it ran on TFLite's own kernel.",
        "",
        "| kernel | int8 XNNPACK ms | delegated | int8 builtin ms | fp32 XNNPACK ms | delegated |"
        " int8 / fp32 | in ViT-Tiny int8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    share = 0.0
    for kernel in result["kernels"]:
        i8x, i8b = timings[f"{kernel}_int8 xnnpack"], timings[f"{kernel}_int8 builtin"]
        f32 = timings[f"{kernel}_fp32 xnnpack"]
        op, count = KERNELS[kernel]
        if not i8x["delegated"]:
            share += count * i8x["p50_ms"]
        lines.append(
            f"| {kernel} ({op}) | {i8x['p50_ms']:.3f} | {'yes' if i8x['delegated'] else '**no**'} "
            f"| {i8b['p50_ms']:.3f} | {f32['p50_ms']:.3f} | {'yes' if f32['delegated'] else 'no'} "
            f"| {i8x['p50_ms'] / f32['p50_ms']:.1f}x | {count} (file: {ops.get(op, '?')} {op}) |"
        )
    lines += [
        "",
        f"Undelegated int8 kernels x their count in ViT-Tiny: ~{share:.0f} ms per inference "
        f"(the whole int8 file: {result.get('vit_tiny_int8_ms', float('nan')):.1f} ms; fp32 file "
        f"{result.get('vit_tiny_fp32_ms', float('nan')):.1f} ms, in this run).",
        "",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        kernels = build(Path(scratch))
        files = {
            f"{k}_{kind}": Path(scratch) / f"{k}_{kind}.tflite"
            for k in kernels
            for kind in ("int8", "fp32")
        }
        timings = time_all(files)
    from importlib.metadata import version

    result = {
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "litert": version("ai-edge-litert"),
        "kernels": kernels,
        "timings": timings,
        "vit_tiny_int8_ops": model_ops(VIT_TINY_INT8),
    }
    whole = {"int8": VIT_TINY_INT8, "fp32": VIT_TINY_INT8.with_name("model_float32.tflite")}
    if all(p.exists() for p in whole.values()):
        both = time_all(whole)
        result["vit_tiny_int8_ms"] = both["int8 xnnpack"]["p50_ms"]
        result["vit_tiny_fp32_ms"] = both["fp32 xnnpack"]["p50_ms"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "litert_kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    text = report(result)
    (RESULTS / "litert_kernels.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
