"""The direct TFLite route: the folded torch program -> LiteRT, with Google's own converter.

litert-torch converts the program prepare saved (``fp32/model.pt2``) to a float .tflite;
ai-edge-quantizer quantizes that file from the calibration samples: static per-tensor
activation ranges (min/max over every sample), per-channel int8 weights, int8 graph I/O, no
float op. Both run in their own environment (``quant.tflite.toolenv.LITERT_TORCH``), one sandboxed
subprocess per step (``quant.tflite.tool_scripts.litert_torch_convert``), each step's output
kept as a log.

Measured against the onnx2tf route (ONNX -> TensorFlow -> TFLite) on the bundled ViT: 9 s
instead of 34 s for the imx93 target's conversion, the same agreement (99.8 %) and cosine
(0.9995), no TensorFlow, and tensor names that are the torch modules' paths. The per-tensor
precision mix (``quantize_plan``) is the quantizer's per-op recipe: any set of ops with int16
activations, the quantizer inserting the int8 <-> int16 QUANTIZE ops between.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..samples import Samples
from . import toolenv
from .depthwise import depthwise_as_conv
from .embedding import quantize_embedding_tables
from .symmetric import SymmetricOperand, make_matmul_operands_symmetric
from .tool_sandbox import network_isolation, run_tool

SCRIPT = Path(__file__).parent / "tool_scripts" / "litert_torch_convert.py"
FLOAT32_NAME = "model_float32.tflite"
INT8_NAME = "model_int8.tflite"
RANGES_NAME = "calibration_ranges.npz"
MODULE_PATHS_NAME = "module_paths.json"  # beside the program: quant.sources.program_module_paths
LOGS_DIR = "logs"


@dataclass(frozen=True)
class DirectArtifacts:
    """What the direct route made, all inside ``work_dir``: the float file (LiteRT's reference
    for the per-tensor SQNR, and what every plan quantizes), the pure int8 file, the
    calibration ranges every plan reuses, each step's log in ``logs/``."""

    work_dir: Path
    float32: Path
    int8: Path
    ranges: Path
    convert_s: float
    quantize_s: float
    network_isolated: bool
    matmul_operands: tuple[SymmetricOperand, ...] = field(default=())
    # {litert-torch's scope chain: the module's path}, for the tensors' names (quant.sources)
    module_paths: dict[str, str] = field(default_factory=dict)

    @property
    def logs(self) -> Path:
        return self.work_dir / LOGS_DIR

    def to_json(self) -> str:
        """The record with its files named relative to ``work_dir``."""
        fields = dataclasses.asdict(self)
        for key in ("work_dir", "float32", "int8", "ranges"):
            fields[key] = Path(fields[key]).name
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str, directory: Path) -> DirectArtifacts:
        fields = json.loads(text)
        fields["work_dir"] = directory
        for key in ("float32", "int8", "ranges"):
            fields[key] = directory / fields[key]
        fields["matmul_operands"] = tuple(
            SymmetricOperand(**record) for record in fields["matmul_operands"]
        )
        return cls(**fields)


def module_paths_file(program: Path) -> Path:
    """Where prepare keeps ``program``'s module paths."""
    return program.with_name(MODULE_PATHS_NAME)


def _module_paths(program: Path) -> dict[str, str]:
    file = module_paths_file(program)
    return json.loads(file.read_text()) if file.is_file() else {}


def convert_direct(
    program: Path, calibration: Samples, work_dir: Path, *, timeout_s: float = 900
) -> DirectArtifacts:
    """The float and pure int8 files of ``program`` (a folded torch program, batch 1), with
    the calibration ranges. Raises TfliteConversionError (one line naming the step's log) or
    toolenv.ToolEnvMissingError."""
    env = toolenv.LITERT_TORCH.require()
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / LOGS_DIR).mkdir(exist_ok=True)
    deadline = time.monotonic() + timeout_s
    isolate = network_isolation(None)
    feeds = calibration.feeds
    sample, calib = work_dir / "sample.npz", work_dir / "calibration.npz"
    # in the program's input order (the npz keeps it): the tool passes them positionally
    np.savez(sample, **{name: np.asarray(array[:1]) for name, array in feeds.items()})
    np.savez(calib, **{name: np.asarray(array) for name, array in feeds.items()})
    float32, ranges = work_dir / FLOAT32_NAME, work_dir / RANGES_NAME
    started = time.monotonic()
    _step(env, work_dir, deadline, isolate, "convert", program, sample, float32)
    depthwise_as_conv(float32)  # as every quantized file (quantize_plan), so their ops pair up
    convert_s = time.monotonic() - started
    started = time.monotonic()
    _step(env, work_dir, deadline, isolate, "calibrate", float32, calib, ranges)
    int8 = quantize_plan(env, work_dir, float32, ranges, {}, work_dir / INT8_NAME, deadline)
    operands = make_matmul_operands_symmetric(int8, int8)
    return DirectArtifacts(
        work_dir=work_dir,
        float32=float32,
        int8=int8,
        ranges=ranges,
        convert_s=round(convert_s, 2),
        quantize_s=round(time.monotonic() - started, 2),
        network_isolated=isolate,
        matmul_operands=operands,
        module_paths=_module_paths(program),
    )


def convert_float(program: Path, sample: Path, out: Path, *, timeout_s: float = 900) -> Path:
    """litert-torch's float file of ``program`` as the converter writes it (no rewrite), its
    log in ``out``'s directory's logs/; ``sample`` (.npz) is one example input."""
    env = toolenv.LITERT_TORCH.require()
    (out.parent / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    _step(env, out.parent, deadline, network_isolation(None), "convert", program, sample, out)
    return out


def requantize(
    converted: DirectArtifacts,
    out: Path,
    *,
    int16: tuple[str, ...] = (),
    all_int16: bool = False,
    timeout_s: float = 900,
) -> Path:
    """Another file from the same float file and ranges: the ops that output ``int16`` with
    int16 activations (the rest int8), or every op (``all_int16``: 16x8)."""
    env = toolenv.LITERT_TORCH.require()
    plan = {"int16": list(int16), "all_int16": all_int16}
    deadline = time.monotonic() + timeout_s
    return quantize_plan(
        env, converted.work_dir, converted.float32, converted.ranges, plan, out, deadline
    )


def quantize_plan(
    env: Path, work_dir: Path, float32: Path, ranges: Path, plan: dict, out: Path, deadline: float
) -> Path:
    plan_file = work_dir / f"{out.stem}.plan.json"
    plan_file.write_text(json.dumps(plan))
    _step(env, work_dir, deadline, network_isolation(None), "quantize", float32, ranges,
          plan_file, out)  # fmt: skip
    depthwise_as_conv(out)  # Vela runs a strided patch embedding only as CONV_2D
    quantize_embedding_tables(out)  # the quantizer leaves EMBEDDING_LOOKUP's table in float
    return out


def _step(
    env: Path, work_dir: Path, deadline: float, isolate: bool, step: str, *paths: Path
) -> None:
    log = work_dir / LOGS_DIR / f"litert_torch_{step}_{paths[-1].stem}.log"
    # -P: not the script's own directory on sys.path (quant/, whose modules would shadow)
    command = [str(toolenv.LITERT_TORCH.python(env)), "-P", str(SCRIPT), step]
    run_tool(
        [*command, *(str(p.resolve()) for p in paths)],
        work_dir, env, deadline, log, f"litert-torch {step}", isolate,
    )  # fmt: skip
