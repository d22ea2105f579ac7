"""``report.json``: one versioned schema, shared by the CLI and the HTTP service.

Defined once here as pydantic models; ``quant/report/report.schema.json`` is generated from them
(``python -c "import quant.report as r; r.write_schema()"``) and a test keeps the committed file
equal to the models. Bump
``SCHEMA_VERSION`` on any change that is not a pure addition.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from converters.source import ModelFormat

SCHEMA_VERSION = "1.0"
# What a conversion writes into its output directory beside the artifacts.
REPORT_FILE = "report.json"
SUMMARY_FILE = "report.md"
SCHEMA_FILE = Path(__file__).with_name("report.schema.json")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelInput(_Model):
    name: str = Field(description="as the model names it: the .npz array that feeds it")
    shape: list[int] = Field(description="one sample, no batch axis; -1 where the file leaves it")
    dtype: str
    scale: float | None = Field(
        default=None, description="an int8 input's quantization: real = scale * (q - zero_point)"
    )
    zero_point: int | None = None


class ModelInfo(_Model):
    name: str
    source_format: ModelFormat = Field(description="hf: a Hugging Face save_pretrained directory")
    parameters: int | None = Field(description="trainable parameters; None for an ONNX source")
    input_shape: list[int] = Field(description="the first input's: one sample, no batch axis")
    input_dtype: str = Field(description="the first input's")
    inputs: list[ModelInput] = Field(default=[], description="every input, in the model's order")


class Reference(_Model):
    """The fp32 (folded) model on the evaluation data."""

    top1_fp32: float | None
    samples: int
    eval_source: str
    calibration_source: str
    calibration_samples: int


class Artifact(_Model):
    name: str = Field(description="path relative to the output directory")
    format: Literal["onnx", "tflite", "vela_tflite", "text"]
    bytes: int
    sha256: str
    description: str


MODULE_HELP = (
    "where it is in the user's model: the torch module path from the exporter's module records, "
    "with the op when the module called it itself (blocks.3.attn.softmax; a Linear's MatMul is "
    "blocks.3.attn.qkv); a tensor without a record takes its neighbours' module; None when the "
    "model file records no modules"
)


class LayerError(_Model):
    name: str = Field(description="the tensor's name in the artifact's graph")
    op: str
    sqnr_db: float | None = Field(
        description="int8 vs fp32 value of this tensor (accumulated error); null where it is "
        "not a finite number: the fp32 tensor holds infinities (a mask filled with -inf)"
    )
    own_sqnr_db: float | None = Field(description="its own quantization step alone")
    module: str | None = Field(default=None, description=MODULE_HELP)


class OpSource(_Model):
    """One op behind ``fallback_ops``: its graph name and the module of the user's model."""

    op: str = Field(description="its type, as fallback_ops names it")
    name: str = Field(description="its (first) output tensor in the artifact's graph")
    module: str | None = Field(default=None, description=MODULE_HELP)


Arithmetic = Literal["exact", "onnxruntime", "litert"]


class Drift(_Model):
    artifact: str = Field(description="name of the artifact measured")
    arithmetic: Arithmetic | None = Field(
        default=None,
        description="what computed the int8 outputs: 'exact' = the QDQ graph as written "
        "(DequantizeLinear -> float op -> QuantizeLinear, no fused int8 kernel: what every "
        "non-saturating integer kernel computes, independent of the host); 'onnxruntime' / "
        "'litert' = that runtime's int8 kernels on the host named in the report",
    )
    top1_fp32: float | None
    top1_int8: float | None
    top1_drop_pts: float | None
    agreement: float
    cosine: float
    max_abs_err: float
    samples: int
    worst_layers: list[LayerError]
    within_bar: bool


# Cores other work may keep busy while a file is timed before the report calls its figures
# contended: a batch-1 Transformer streams its weights from memory on every run, so even work on
# the other cores slows it (benchmarks/results/latency_contention.md).
CONTENDED_CORES = 0.5


class Latency(_Model):
    runtime: Literal["onnxruntime", "litert"]
    artifact: str
    threads: int
    batch: int
    runs: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    xnnpack_ops: dict[str, tuple[int, int]] | None = Field(
        default=None,
        description="LiteRT: {op type: (ops in the file, ops XNNPACK's delegate took)}, read from "
        "the interpreter that timed it (an op it did not take runs on TFLite's own kernels)",
    )
    others_busy_cores: float | None = Field(
        default=None,
        description="how many of the timing process's cores other work (other targets building "
        "at once, other jobs) kept busy on average while the runs were timed, from the kernel's "
        f"per-CPU counters (None: not known); from {CONTENDED_CORES} on, the figures are slower "
        "than on a quiet host: the report's assembly times them again (retimed), and the "
        "summaries name those still timed on a busy host",
    )
    retimed: bool = Field(
        default=False,
        description="timed again once the conversion's builds were done, because the first "
        "timing was contended; these figures are the second timing's (quant.quiet_latency)",
    )

    def contended(self) -> bool:
        """Timed while other work took cores from it: the figures are slower than the file's."""
        return self.others_busy_cores is not None and self.others_busy_cores >= CONTENDED_CORES


class Exclusion(_Model):
    """One step of the drift fallback: what was widened and what the drift became."""

    step: int
    action: str
    tensors: list[str]
    top1_drop_pts: float | None
    agreement: float
    est_cost: str | None = None


class RecipeTrial(_Model):
    """One int8 recipe of a target's ladder, and the drift of its pure int8 file."""

    recipe: str
    top1_drop_pts: float | None
    agreement: float
    within_bar: bool


class PowerOfTwoScale(_Model):
    """One tensor's power-of-two scale in a QDQ ONNX file whose target takes only those (TIDL):
    which way its MinMax scale was rounded (``quant.ort.pow2.record``)."""

    tensor: str = Field(
        description="the quantized tensor (an activation by its fp32 name, a weight by its int8 "
        "initializer's); tensors sharing its scale (a Reshape, a Transpose) share its record"
    )
    kind: Literal["activation", "weight"]
    channels_up: int = Field(
        description="scales rounded up (no clipping, coarser steps): 1 or 0 for an activation, "
        "per output channel for a weight"
    )
    channels_down: int = Field(description="scales rounded down (finer steps, the tail clipped)")
    channels_down_further: int = Field(
        default=0,
        description="of channels_down, those two or more powers of two below the ceiling of "
        "their MinMax scale (more of the tail clipped, for a smaller error still)",
    )
    log2_scale: int | None = Field(
        description="an activation's scale, as a power of two; None for a weight (per channel)"
    )
    chosen_by: Literal["own error", "softmax-visible error", "range"] = Field(
        description="own error: whichever candidate power of two quantizes the tensor's own "
        "values (an activation's on the calibration data) with the least squared error; "
        "softmax-visible error: the same for a Softmax's input that an attention mask is added "
        "into, with masked values (-15 or less and 16 or more below their row's maximum) counted "
        "as equal, as the Softmax cannot tell them apart; range: rounded up (no calibration "
        "values reach it)"
    )


def power_of_two_counts(scales: Sequence[PowerOfTwoScale]) -> dict[str, tuple[int, int, int]]:
    """Scale choices summed by kind ("activation", "weight"): (rounded up, rounded down, of those
    down two powers of two or more), channels for a weight."""
    fields = ("channels_up", "channels_down", "channels_down_further")
    return {
        kind: tuple(sum(getattr(s, f) for s in scales if s.kind == kind) for f in fields)
        for kind in ("activation", "weight")
    }


class StreamFactor(_Model):
    """A residual stream scaled before quantizing, so that power-of-two scales fit its ranges
    (``quant.ort.pow2.grid``): exact in fp32, the factor chosen by the int8 logits' error."""

    stream: str = Field(description="the residual Add output the stream is named by")
    tensors: int = Field(description="how many tensors of the fp32 graph it scales")
    factor: float = Field(description="in [1, 2): the grid repeats after one octave")
    logits_mse_at_one: float = Field(
        description="the search's figure unscaled: mean squared int8 vs fp32 logits difference "
        "on calibration samples, with the target's first recipe"
    )
    logits_mse: float = Field(description="the same figure at the chosen factor")


class SymmetricOperand(_Model):
    """A group of int8 tensors that feed BATCH_MATMUL right operands, requantized by the op that
    computes them to zero point 0: LiteRT's XNNPACK delegate runs an int8 BATCH_MATMUL only
    when its right operand is symmetric (``quant.tflite.symmetric``)."""

    tensor: str = Field(description="the producer's output tensor in the artifact's graph")
    producer: str = Field(description="the op type that computes it, now into zero point 0")
    tensors: int = Field(
        description="tensors sharing its quantization: its output and the RESHAPE, TRANSPOSE, "
        "SPLIT... after it, whose int8 kernels need their input's quantization"
    )
    matmuls: int = Field(description="BATCH_MATMULs that take one of them as right operand")
    scale: float = Field(description="the converter's (asymmetric) scale")
    zero_point: int = Field(description="the converter's zero point")
    new_scale: float | None = Field(
        description="the symmetric scale of the same float range (zero point 0): "
        "max(|min|, |max|) / 127; None when the group was left as it was"
    )
    reason: str | None = Field(default=None, description="why the group was left as it was")


class Vela(_Model):
    accelerator: str
    system_config: str
    memory_mode: str
    npu_ops: int
    cpu_ops: list[str]
    sram_kib: float
    dram_kib: float
    cycles: int
    est_ms: float


class TargetHeader(_Model):
    """Which target, under which rules, and how its conversion ended."""

    name: str
    board: str
    runtime: str
    opset: int
    rules: list[str]
    status: Literal["ok", "over_bar", "failed"]
    error: str | None = None


class TfliteRoute(_Model):
    """Which converter made a TFLite target's files, and why that one."""

    name: Literal["litert-torch", "onnx2tf"] = Field(
        description="litert-torch: the folded torch program straight to LiteRT, quantized by "
        "ai-edge-quantizer; onnx2tf: the fp32 ONNX file through TensorFlow's converter"
    )
    reason: str = Field(description="why this route: the default for the source, or why not")
    convert_s: float | None = Field(
        default=None,
        description="seconds the route took to the float .tflite (litert-torch's converter; "
        "onnx2tf and TensorFlow's), once per job: targets of one job share it",
    )
    quantize_s: float | None = Field(
        default=None,
        description="seconds from the float file to the pure int8 file: "
        "calibration and quantization",
    )


class TargetResult(_Model):
    """What a target's builder made and measured (``quant.ort.target``,
    ``quant.tflite.target``); it crosses from the builder's process to the pipeline's as is."""

    artifacts: list[Artifact] = []
    inputs: list[ModelInput] = Field(
        default=[],
        description="what the shipped file takes, input by input (a TFLite image input is "
        "channels-last int8; token ids and masks stay int64)",
    )
    drift: Drift | None = None
    pure_int8_drift: Drift | None = Field(
        default=None, description="before any fallback, when the fallback changed something"
    )
    int8_recipe: str | None = Field(
        default=None,
        description="the int8 recipe of the shipped QDQ ONNX file (its weights, activations, "
        "scales and biases), before any 16-bit tensor",
    )
    recipes_tried: list[RecipeTrial] = Field(
        default=[],
        description="a QDQ ONNX target's int8 recipes in the order tried, each while the one "
        "before it missed the drift bars, with its pure int8 drift; the shipped file's is the "
        "first within the bars, else the one with the highest agreement",
    )
    power_of_two_scales: list[PowerOfTwoScale] = Field(
        default=[],
        description="a power-of-two target's rounding of each tensor's scale, up or down",
    )
    stream_factors: list[StreamFactor] = Field(
        default=[],
        description="a power-of-two target's residual streams, each scaled by the factor that "
        "puts its ranges best on the power-of-two grid; empty where none was searched",
    )
    host_drift: Drift | None = Field(
        default=None,
        description="the shipped file on the host's own int8 kernels, for a target the host's "
        "runtime also runs (cpu); ``drift`` is the target's figure",
    )
    warnings: list[str] = Field(
        default=[], description="what a user should know about this target's figures"
    )
    latency: list[Latency] = []
    fallback_ops: list[str] = Field(
        default=[], description="ops its accelerator would not run (they run on the host CPU)"
    )
    fallback_op_sources: list[OpSource] = Field(
        default=[], description="each op behind fallback_ops, with its module in the user's model"
    )
    int16_tensors: list[str] = []
    matmul_operands: list[SymmetricOperand] = Field(
        default=[],
        description="a shipped int8 TFLite file: the BATCH_MATMUL right operands it quantizes "
        "symmetrically so that LiteRT's XNNPACK delegate runs them, each group with the "
        "converter's quantization and the new one (or why it was left)",
    )
    excluded: list[Exclusion] = []
    tflite_route: TfliteRoute | None = None
    vela: Vela | None = None
    vela_pure_int8: Vela | None = Field(
        default=None, description="the pure int8 file's Vela figures, when 16x8 was shipped"
    )


class TargetReport(TargetResult, TargetHeader):
    """One target in report.json: its header, then what was made and measured."""


class Host(_Model):
    """The machine that measured drift and latency (``quant.host.describe_host``)."""

    cpu: str = Field(description="the CPU's brand string")
    microarchitecture: str = Field(description="archspec's name for it, e.g. zen3, icelake")
    machine: str = Field(description="x86_64, aarch64, ...")
    cores: int = Field(description="cores the conversion could use")
    int8_features: list[str] = Field(
        description="of the ISA features that select int8 kernels (avx2, avx512f, avx512_vnni, "
        "avx_vnni, amx_int8; Arm: asimddp, i8mm, sve), those this CPU has"
    )
    int8_kernels: str = Field(description="what they mean for int8 matrix products")
    os: str
    versions: dict[str, str] = Field(description="python, torch, onnxruntime, LiteRT, Vela...")

    def label(self) -> str:
        """``AMD EPYC (zen3, 2 cores, AVX2, no VNNI)``: the host in one phrase."""
        features = set(self.int8_features)
        if self.machine in ("x86_64", "amd64"):
            isa = [name.upper() for name in ("avx2", "avx512f") if name in features]
            vnni = [n for n in ("avx512_vnni", "avx_vnni") if n in features]
            isa.append(" + ".join(n.upper().replace("_", "-") for n in vnni) if vnni else "no VNNI")
            isa += ["AMX"] if "amx_int8" in features else []
        else:
            isa = list(self.int8_features) or ["no dot product"]
        return f"{self.cpu} ({self.microarchitecture}, {self.cores} cores, {', '.join(isa)})"


class LayerTID(_Model):
    tid_before: float
    tid_after: float


class Recalibration(_Model):
    """The offline norms' inference statistics recomputed from data before folding
    (``edge-un convert --recalibrate N``; ``edge_un.recalibrate``)."""

    batches: int
    batch_size: int
    samples: int
    source: str = Field(description="where the recalibration inputs came from")
    mean_tid_before: float = Field(
        description="training-inference discrepancy, mean over layers, statistics as trained"
    )
    mean_tid_after: float
    top1_fp32_before: float | None = Field(
        description="the unfolded torch model on the evaluation data, statistics as trained"
    )
    top1_fp32_after: float | None = Field(description="the same, statistics recalibrated")
    layers: dict[str, LayerTID] = Field(description="per-layer TID, in execution order")


Outcome = Literal["succeeded", "partial", "failed"]


class Report(_Model):
    schema_version: Literal["1.0"] = SCHEMA_VERSION
    edge_un_version: str
    model: ModelInfo
    fold: dict[str, Any] = Field(description="converters.FoldReport: what happened to each norm")
    reference: Reference
    max_drift_pts: float
    min_agreement: float
    targets: dict[str, TargetReport]
    notes: list[str] = []
    recalibration: Recalibration | None = Field(
        default=None, description="set when the norm statistics were recalibrated before folding"
    )
    host: Host | None = Field(
        default=None, description="the machine that measured drift and latency"
    )

    def failed_targets(self) -> list[TargetReport]:
        return [target for target in self.targets.values() if target.status == "failed"]

    def outcome(self) -> Outcome:
        """How the conversion ended, one rule for the CLI (its exit code) and the service (its
        job's state): ``failed`` when every target failed (nothing to ship), ``partial`` when
        some did, else ``succeeded``. A target over the drift bar did not fail: its file is
        made, measured and reported."""
        failed = len(self.failed_targets())
        if failed == 0:
            return "succeeded"
        return "failed" if failed == len(self.targets) else "partial"

    def failures(self) -> str | None:
        """The failed targets and their reasons in one line (None if none failed)."""
        failed = self.failed_targets()
        if not failed:
            return None
        head = (
            "every target failed"
            if len(failed) == len(self.targets)
            else (f"{len(failed)} of {len(self.targets)} targets failed")
        )
        return f"{head}: " + "; ".join(f"{t.name}: {t.error}" for t in failed)

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> Report:
        return cls.model_validate_json(Path(path).read_text())


def json_schema_text() -> str:
    return json.dumps(Report.model_json_schema(), indent=2) + "\n"


def write_schema() -> None:
    SCHEMA_FILE.write_text(json_schema_text())
