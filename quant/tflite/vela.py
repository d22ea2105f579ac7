"""Compile a full-integer TFLite file for Arm Ethos-U with Vela and read back what it did.

Vela (``ethos-u-vela`` 5.2, in the main venv) runs as a subprocess of this interpreter
(``python -m ethosu.vela``): a timeout, no global state left behind, and its prints kept in a log.

System config, explicitly (Vela otherwise warns and assumes ``Ethos_U65_Client_Server`` with
``Dedicated_Sram_384KB``). Neither Vela nor NXP ships an i.MX 93 section; we use the bundled
``Arm/vela.ini`` entries closest to the chip:

- ``Ethos_U65_High_End``: the i.MX 93's Ethos-U65 runs at up to 1 GHz, the core clock of the
  two 1 GHz U65 configs; its DRAM (3.75 GB/s) is the conservative one of the two (Client_Server
  assumes 12 GB/s; the i.MX 93's 16-bit LPDDR4X peaks near 7.5 GB/s, shared with the A55s).
- ``Dedicated_Sram_384KB``: on i.MX 93 Linux the model and the tensor arena live in DDR and the
  NPU uses on-chip SRAM (OCRAM) as its own fast cache, which is Vela's Dedicated_Sram mode
  (arena on the DRAM port, cache in SRAM), not Shared_Sram (whole arena in SRAM, the Cortex-M
  microcontroller layout). 384 KiB of cache is what NXP's own Vela pass for the i.MX 93
  (ethos-u65-256, Ethos_U65_High_End, arena_cache_size 384 KiB) uses, and Vela's U65 default.

Pass another ``system_config``/``memory_mode`` (and ``config_file`` for your own .ini) for a
board whose memory you know.
"""

from __future__ import annotations

import csv
import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ToolError
from .flatbuffer import OpRef, inspect_tflite

DEFAULT_ACCELERATOR = "ethos-u65-256"
DEFAULT_SYSTEM_CONFIG = "Ethos_U65_High_End"
DEFAULT_MEMORY_MODE = "Dedicated_Sram_384KB"
VELA_LOG = "vela.log"
TIMEOUT_S = 600

# "CPU operators = 3 (1.2%)"; "   CPU: Gather = name (outputs [1, 48, 64])"
_COUNT = re.compile(r"^(CPU|NPU) operators = (\d+)")
_PLACED = re.compile(r"^\s+(CPU|NPU): (\S+) = (.*?)(?: \(outputs \[[^\]]*\]\))?$")
# "Warning (supported operators) operator: GELU, ofm: '...'" then "Reason: Unsupported IFM type"
_REASON = re.compile(r"operator: (\w+), ofm: .*\nReason: (.*)")


def bundled_config() -> Path:
    """Vela's own ``Arm/vela.ini`` (found without importing Vela into this process)."""
    spec = importlib.util.find_spec("ethosu.vela")
    if spec is None or spec.origin is None:
        raise VelaError("Vela is not installed (ethos-u-vela)")
    return Path(spec.origin).parent.parent / "config_files" / "Arm" / "vela.ini"


class VelaError(ToolError):
    """Vela refused or failed to compile a file (one line; the full log is kept)."""


@dataclass(frozen=True)
class VelaResult:
    """Vela's verdict on one file: where each op runs, memory, and its performance estimate.

    ``npu_ops`` counts Vela's operators after its own lowering (a SOFTMAX becomes ~30 NPU
    elementwise ops), as its summary does, and ``npu_op_types`` breaks them down by Vela's
    (lowered) type. ``cpu_operators`` are the ops left to the CPU, read from the compiled file
    (``cpu_ops`` names each as "OpType tensor_name", as the report does); ``cpu_op_types`` counts
    them by TFLite builtin name, and ``cpu_reasons`` says why, in Vela's words.
    ``cycles`` and ``est_ms`` are Vela's estimate for one batch-1 inference at the config's
    clock, memory traffic included; ``cycles_by_op`` splits them by the TFLite op each of
    Vela's operators was lowered from (its per-layer CSV), most first.
    """

    path: Path
    accelerator: str
    system_config: str
    memory_mode: str
    config_file: Path
    npu_ops: int
    cpu_operators: tuple[OpRef, ...]
    npu_op_types: dict[str, int]
    cpu_op_types: dict[str, int]
    sram_kib: float
    dram_kib: float
    cycles: int
    npu_cycles: int
    est_ms: float
    macs: int
    summary_csv: Path
    log: Path
    per_layer_csv: Path | None = None
    cycles_by_op: dict[str, int] = field(default_factory=dict)
    cpu_reasons: tuple[str, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())

    @property
    def cpu_ops(self) -> tuple[str, ...]:
        return tuple(cpu_op_name(op) for op in self.cpu_operators)

    @property
    def all_on_npu(self) -> bool:
        return not self.cpu_operators and self.npu_ops > 0


def cpu_op_name(op: OpRef) -> str:
    """An op left to the CPU as the report names it: "OpType tensor_name"."""
    return f"{op.op} {op.output}"


def compile_vela(
    tflite_path: str | Path,
    out_dir: str | Path,
    *,
    accelerator: str = DEFAULT_ACCELERATOR,
    system_config: str = DEFAULT_SYSTEM_CONFIG,
    memory_mode: str = DEFAULT_MEMORY_MODE,
    config_file: str | Path | None = None,
    timeout_s: float = TIMEOUT_S,
) -> VelaResult:
    """Compile ``tflite_path`` into ``out_dir`` (``<stem>_vela.tflite`` plus Vela's CSVs)."""
    tflite_path, out_dir = Path(tflite_path).resolve(), Path(out_dir).resolve()
    if not tflite_path.is_file():
        raise VelaError(f"{tflite_path}: no such file")
    config = Path(config_file).resolve() if config_file else bundled_config()
    if not config.is_file():
        raise VelaError(f"{config}: no such Vela config file")
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = tflite_path.stem
    compiled = out_dir / f"{stem}_vela.tflite"
    summary = out_dir / f"{stem}_summary_{system_config}.csv"
    for stale in (compiled, summary):
        stale.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "ethosu.vela",
        str(tflite_path),
        "--accelerator-config",
        accelerator,
        # the bundled file by Vela's own relative name (else it warns about the absolute path)
        "--config",
        "Arm/vela.ini" if config_file is None else str(config),
        "--system-config",
        system_config,
        "--memory-mode",
        memory_mode,
        "--output-dir",
        str(out_dir),
        "--verbose-performance",  # writes <stem>_per-layer.csv
        "--show-cpu-operations",  # prints every op with where it runs
    ]
    log = out_dir / VELA_LOG
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise VelaError(f"Vela timed out after {timeout_s:.0f} s on {tflite_path.name}") from None
    log.write_text(
        f"$ {' '.join(cmd)}\n# exit code {proc.returncode}\n\n## stdout\n"
        f"{proc.stdout}\n## stderr\n{proc.stderr}\n"
    )
    if proc.returncode != 0 or not compiled.is_file() or not summary.is_file():
        raise VelaError(
            f"Vela failed on {tflite_path.name}: "
            f"{_last_line(proc.stderr, proc.stdout)} (full log: {log})"
        )
    row = _summary_row(summary)
    counts, placed = _placement(proc.stdout)
    left = [op for op in inspect_tflite(compiled).operators if not op.op.startswith("CUSTOM:")]
    per_layer = out_dir / f"{stem}_per-layer.csv"
    notes = tuple(line.strip() for line in proc.stdout.splitlines() if line.startswith("Warning:"))
    return VelaResult(
        path=compiled,
        accelerator=accelerator,
        system_config=row.get("system_config", system_config),
        memory_mode=row.get("memory_mode", memory_mode),
        config_file=config,
        npu_ops=counts.get("NPU", 0),
        cpu_operators=tuple(left),
        npu_op_types=_histogram(op for target, op, _ in placed if target == "NPU"),
        cpu_op_types=_histogram(op.op for op in left),
        cpu_reasons=_reasons(proc.stdout + "\n" + proc.stderr),
        sram_kib=round(float(row["sram_memory_used"]), 2),
        dram_kib=round(float(row["dram_memory_used"]), 2),
        cycles=int(float(row["cycles_total"])),
        npu_cycles=int(float(row["cycles_npu"])),
        est_ms=round(float(row["inference_time"]) * 1e3, 4),
        macs=int(float(row["nn_macs"])),
        summary_csv=summary,
        log=log,
        per_layer_csv=per_layer if per_layer.is_file() else None,
        cycles_by_op=_cycles_by_op(per_layer) if per_layer.is_file() else {},
        notes=notes,
    )


def _summary_row(summary: Path) -> dict[str, str]:
    """The one data row of Vela's summary CSV (memory in KiB, inference_time in seconds)."""
    with summary.open(newline="") as f:
        rows = list(csv.DictReader(f))
    needed = {
        "sram_memory_used",
        "dram_memory_used",
        "cycles_total",
        "cycles_npu",
        "inference_time",
        "nn_macs",
    }
    if len(rows) != 1 or not needed <= rows[0].keys():
        raise VelaError(f"{summary.name}: not the summary CSV this code reads (Vela changed?)")
    return rows[0]


def _cycles_by_op(per_layer: Path) -> dict[str, int]:
    """{TFLite op as Vela names it (BatchMatMul, Softmax...): its operators' cycles}; they add
    up to the summary's total."""
    with per_layer.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and not {"Original Operator", "Op Cycles"} <= rows[0].keys():
        raise VelaError(f"{per_layer.name}: not the per-layer CSV this code reads (Vela changed?)")
    cycles: dict[str, float] = {}
    for row in rows:
        op = row["Original Operator"]
        cycles[op] = cycles.get(op, 0.0) + float(row["Op Cycles"])
    return {op: round(c) for op, c in sorted(cycles.items(), key=lambda kv: (-kv[1], kv[0]))}


def _placement(stdout: str) -> tuple[dict[str, int], list[tuple[str, str, str]]]:
    """Vela's operator counts and its per-op placement list, read from its stdout."""
    counts: dict[str, int] = {}
    placed: list[tuple[str, str, str]] = []
    for line in stdout.splitlines():
        if m := _COUNT.match(line):
            counts[m.group(1)] = int(m.group(2))
        elif m := _PLACED.match(line):
            placed.append((m.group(1), m.group(2), m.group(3)))
    if "CPU" not in counts or "NPU" not in counts:
        raise VelaError("Vela printed no operator counts (its output format changed?)")
    return counts, placed


def _reasons(output: str) -> tuple[str, ...]:
    """Why Vela left ops on the CPU, one "OP: reason" line per distinct pair."""
    reasons: list[str] = []
    for m in _REASON.finditer(output):
        line = f"{m.group(1)}: {m.group(2).strip()}"
        if line not in reasons:
            reasons.append(line)
    return tuple(reasons)


def _histogram(ops: object) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in ops:  # type: ignore[attr-defined]
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _last_line(*texts: str) -> str:
    """The line that says why: Vela's last error line, else its last line."""
    for text in texts:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        for line in reversed(lines):
            if re.search(r"error|exception|invalid", line, re.IGNORECASE):
                return line[:300]
    for text in texts:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if lines:
            return lines[-1][:300]
    return "no output"
