"""What a conversion's steps hand each other on disk: the prepared job, and each target's part.

A conversion is three kinds of step (``quant.pipeline``): *prepare* (load, fold, export once per
opset and batch, write the samples), *build* one target (a child process of its own), and
*assemble* the report. Each step may run in another process, or on another machine that shares
the job's directories (the service's Celery workers), so everything one step leaves for the
next is a file: ``prepared.json`` in the job's work directory (:class:`Prepared`: the model's
record, the fp32 exports, the fp32 reference outputs, the samples' directories, the notes),
and one ``targets/NAME.json`` per target built (:class:`TargetPart`: its entry in the report
and the host that measured it). The artifacts themselves go to the output directory, as ever.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from .measure.bars import Bars
from .report import schema
from .targets.profiles import TargetProfile

PREPARED_FILE = "prepared.json"
PARTS_DIR = "targets"
FP32_OUTPUTS_FILE = "fp32_outputs.npy"


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ExportedModel(_Record):
    """One fp32 folded ONNX file: where it is, its opset and batch, what was rewritten."""

    path: Path
    opset: int
    static_batch: bool
    batch: int | None  # the file's fixed batch size; None: dynamic
    rewrites: list[str]  # what was changed in the exported graph for int8, one line each

    def note(self) -> str:
        batch = "dynamic batch" if self.batch is None else f"static batch {self.batch}"
        return f"fp32 folded model exported at opset {self.opset}, {batch}: {self.path.name}"


def export_key(opset: int, static_batch: bool) -> str:
    """The fp32 export a target needs: one per opset and batch mode."""
    return f"opset{opset}-{'static' if static_batch else 'dynamic'}"


class Prepared(_Record):
    """A folded model ready for its targets' builds, and what its report says besides them."""

    out_dir: Path  # artifacts, report.json and report.md
    work_dir: Path  # this record, the samples, the parts; not published
    # in the order asked, whole: a caller's own profile (a recipe changed) is built as given
    profiles: list[TargetProfile]
    bars: Bars
    latency_runs: int
    model: schema.ModelInfo
    fold: dict[str, Any]
    reference: schema.Reference
    recalibration: schema.Recalibration | None
    notes: list[str]  # the report's notes, in its order
    exports: dict[str, ExportedModel]  # by export_key
    export_errors: dict[str, str]  # export_key -> the one-line reason its export failed
    # an .npy file: the fp32 model's outputs on the evaluation samples, every target's drift
    # reference; None when no fp32 file could be exported (every target then fails)
    fp32_outputs: Path | None
    # the folded torch program at batch 1 (torch.export), for the TFLite targets' direct route;
    # None for an ONNX source, when no target needs it, or when it could not be saved: then
    # ``no_program`` says why, and those targets take the onnx2tf route
    program: Path | None = None
    no_program: str | None = None

    @property
    def calibration_dir(self) -> Path:
        return self.work_dir / "calibration"

    @property
    def evaluation_dir(self) -> Path:
        return self.work_dir / "evaluation"

    @property
    def targets(self) -> list[str]:
        """The targets' names, in the order asked."""
        return [profile.name for profile in self.profiles]

    def profile(self, name: str) -> TargetProfile:
        return next(profile for profile in self.profiles if profile.name == name)

    def export_of(self, profile: TargetProfile) -> ExportedModel | str:
        """The fp32 file ``profile`` is built from, or why there is none."""
        key = export_key(profile.opset, profile.static_batch)
        return self.exports.get(key) or self.export_errors[key]

    def save(self) -> None:
        (self.work_dir / PREPARED_FILE).write_text(self.model_dump_json(indent=1))

    @classmethod
    def load(cls, work_dir: Path) -> Prepared:
        return cls.model_validate_json((Path(work_dir) / PREPARED_FILE).read_text())


class TargetPart(_Record):
    """One target's entry in the report, as its build step left it."""

    report: schema.TargetReport
    host: schema.Host  # the machine that measured it


def part_path(prepared: Prepared, name: str) -> Path:
    return prepared.work_dir / PARTS_DIR / f"{name}.json"


def save_part(prepared: Prepared, part: TargetPart) -> None:
    """Written whole, then renamed: a reader never sees half a part."""
    path = part_path(prepared, part.report.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(part.model_dump_json())
    partial.replace(path)


def load_part(prepared: Prepared, name: str) -> TargetPart | None:
    """The target's part, None if its build left none."""
    path = part_path(prepared, name)
    return TargetPart.model_validate_json(path.read_text()) if path.is_file() else None


def host_notes(hosts: dict[str, schema.Host]) -> list[str]:
    """A note when the targets were measured on more than one kind of machine (the service's
    workers may differ): the report's ``host`` is the first target's."""
    labels: dict[str, list[str]] = {}
    for name, host in hosts.items():
        labels.setdefault(host.label(), []).append(name)
    if len(labels) < 2:
        return []
    where = "; ".join(f"{', '.join(names)} on {label}" for label, names in labels.items())
    return [f"the targets were measured on different hosts ({where}); the report's host is the "
            "first target's: compare latency between targets of one host only"]  # fmt: skip
