"""Each target's build in a process of its own: a native crash fails that target, not the run.

LiteRT, TensorFlow's converter and Vela are native code that can abort the process they run in
(LiteRT asserting on a tensor type it does not expect killed the whole CLI with SIGABRT, and no
report was written). So the pipeline runs each target's builder in a fresh Python process of the
same interpreter (``python -m quant.isolation``): the child reads the job from a directory
(its settings as JSON, the samples as .npy files it memory-maps), sends its progress and then
its typed result (``report.TargetResult``) or its error as JSON lines through a pipe, and writes
everything the libraries print to a log. A child killed by a signal becomes a one-line reason
naming the signal and the stage it was in; its log is kept beside the target's artifacts.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from converters.progress import ProgressEvent

from . import report as schema
from .data import Samples
from .errors import one_line
from .target_job import Bars, TargetJob
from .targets import TargetProfile

# The builder of each kind of target, as "module:function" (imported in the child).
ONNX_BUILDER = "quant.onnx_target:build_onnx_target"
TFLITE_BUILDER = "quant.tflite_target:build_tflite_target"
LOG_NAME = "build.log"
PR_SET_PDEATHSIG = 1


class TargetFailed(RuntimeError):
    """The builder raised: its one-line reason (the pipeline reports the target failed)."""


def builder_for(profile: TargetProfile) -> str:
    return ONNX_BUILDER if "onnx_qdq" in profile.artifacts else TFLITE_BUILDER


class IsolatedBuilds:
    """Runs target builders in child processes; the samples every target shares are written
    once into ``scratch`` (a directory the caller removes)."""

    def __init__(self, scratch: Path, calibration: Samples, evaluation: Samples) -> None:
        self.scratch = scratch
        self.samples = {"calibration": calibration, "evaluation": evaluation}
        for part, samples in self.samples.items():
            _save_samples(samples, scratch / part)
        self.references: dict[Path, Path] = {}

    def build(self, builder: str, job: TargetJob) -> schema.TargetResult:
        """``builder(job)`` in a child process; TargetFailed for an error it reported or a
        crash (the log of a crash is kept as ``target_dir/build.log``)."""
        job_dir = self.scratch / job.profile.name
        job_dir.mkdir(exist_ok=True)
        (job_dir / "job.json").write_text(json.dumps(self._job_document(builder, job)))
        log = job_dir / LOG_NAME
        read_end, write_end = os.pipe()
        with log.open("wb") as log_stream:
            process = subprocess.Popen(
                [sys.executable, "-m", "quant.isolation", str(job_dir), str(write_end)],
                stdin=subprocess.DEVNULL, stdout=log_stream, stderr=subprocess.STDOUT,
                pass_fds=(write_end,),
            )  # fmt: skip
        os.close(write_end)
        last_stage, outcome = "start", None
        with os.fdopen(read_end, "r") as messages:
            for line in messages:
                message = json.loads(line)
                if "stage" in message:
                    event = ProgressEvent(
                        message["stage"], message["fraction"], None, message["detail"]
                    )
                    last_stage = event.label
                    job.stage(event.stage, event.fraction, event.detail)
                else:
                    outcome = message
        code = process.wait()
        if outcome is not None and "result" in outcome:
            return schema.TargetResult.model_validate(outcome["result"])
        if outcome is not None and "error" in outcome:
            raise TargetFailed(outcome["error"])
        kept = job.target_dir / LOG_NAME
        kept.write_bytes(log.read_bytes())
        how = f"killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
        raise TargetFailed(
            f"the {job.profile.name} build crashed in native code ({how}) during "
            f"'{last_stage}'; its output is in {kept.relative_to(job.out_dir).as_posix()}"
        )

    def _job_document(self, builder: str, job: TargetJob) -> dict[str, Any]:
        reference = self.references.get(job.fp32_path)
        if reference is None:  # one per fp32 export, shared by the targets built from it
            reference = self.scratch / f"reference-{len(self.references)}.npy"
            np.save(reference, job.reference)
            self.references[job.fp32_path] = reference
        return {
            "builder": builder,
            "profile": _profile_document(job.profile),
            "fp32_path": str(job.fp32_path),
            "target_dir": str(job.target_dir),
            "out_dir": str(job.out_dir),
            "calibration": str(self.scratch / "calibration"),
            "evaluation": str(self.scratch / "evaluation"),
            "reference": str(reference),
            "bars": dataclasses.asdict(job.bars),
            "latency_runs": job.latency_runs,
            "shared_dir": str(self.scratch / "shared"),
        }


def _save_samples(samples: Samples, directory: Path) -> None:
    """One .npy file per input (in the model's order), labels apart; the source in a JSON."""
    directory.mkdir(parents=True, exist_ok=True)
    for index, array in enumerate(samples.feeds.values()):
        np.save(directory / f"input{index}.npy", array)
    if samples.labels is not None:
        np.save(directory / "labels.npy", samples.labels)
    (directory / "samples.json").write_text(
        json.dumps({"inputs": list(samples.feeds), "source": samples.source})
    )


def _load_samples(directory: Path) -> Samples:
    about = json.loads((directory / "samples.json").read_text())
    feeds = {
        name: np.load(directory / f"input{index}.npy", mmap_mode="r")
        for index, name in enumerate(about["inputs"])
    }
    labels_file = directory / "labels.npy"
    labels = np.load(labels_file) if labels_file.exists() else None
    return Samples(feeds, labels, about["source"])


def _profile_document(profile: TargetProfile) -> dict[str, Any]:
    return {
        field.name: sorted(value) if isinstance(value, frozenset) else value
        for field in dataclasses.fields(profile)
        for value in [getattr(profile, field.name)]
    }


def _profile(document: dict[str, Any]) -> TargetProfile:
    """The profile back from JSON: lists become the tuples and frozensets its fields are."""
    values = dict(document)
    for field in dataclasses.fields(TargetProfile):
        if isinstance(values[field.name], list):
            kind = frozenset if "frozenset" in str(field.type) else tuple
            values[field.name] = kind(values[field.name])
    return TargetProfile(**values)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# -- the child process --------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: be killed when the process that started us dies (a job's timeout kills it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _import(dotted: str) -> Callable[[TargetJob], schema.TargetResult]:
    module, _, function = dotted.partition(":")
    return getattr(importlib.import_module(module), function)


@contextlib.contextmanager
def _channel(fd: int) -> Iterator[Callable[[dict[str, Any]], None]]:
    with os.fdopen(fd, "w") as stream:

        def send(message: dict[str, Any]) -> None:
            stream.write(json.dumps(message) + "\n")
            stream.flush()

        yield send


def main(job_dir: str, fd: str) -> int:
    _die_with_parent()
    document = json.loads((Path(job_dir) / "job.json").read_text())
    with _channel(int(fd)) as send:
        try:
            job = TargetJob(
                profile=_profile(document["profile"]),
                fp32_path=Path(document["fp32_path"]),
                target_dir=Path(document["target_dir"]),
                out_dir=Path(document["out_dir"]),
                calibration=_load_samples(Path(document["calibration"])),
                evaluation=_load_samples(Path(document["evaluation"])),
                reference=np.load(document["reference"]),
                bars=Bars(**document["bars"]),
                stage=lambda name, fraction, detail=None: send(
                    {"stage": name, "fraction": fraction, "detail": detail}
                ),
                latency_runs=document["latency_runs"],
                shared_dir=Path(document["shared_dir"]),
            )
            result = _import(document["builder"])(job)
        except Exception as error:  # the pipeline reports it as this target's one-line reason
            traceback.print_exc()
            send({"error": builder_reason(error)})
            return 1
        send({"result": result.model_dump(mode="json")})
    return 0


def builder_reason(error: BaseException) -> str:
    """A builder's error as the target's one-line reason: its own message for the errors
    builders raise on purpose, else the type too, marked as a bug."""
    if isinstance(error, ValueError | RuntimeError | OSError):  # the builders' own reasons
        return one_line(error)
    said = f": {one_line(error)}" if str(error).strip() else ""
    return f"internal error: {type(error).__name__}{said}"


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
