"""Each target's build in a process of its own: a native crash fails that target, not the run.

LiteRT, TensorFlow's converter and Vela are native code that can abort the process they run in
(LiteRT asserting on a tensor type it does not expect killed the whole CLI with SIGABRT, and no
report was written). So the pipeline runs each target's builder in a fresh Python process of the
same interpreter (``python -m quant.isolation``): the child reads its job from a directory (a
``BuildOrder`` as JSON, the samples as .npy files it memory-maps), sends typed messages through
a pipe, one JSON line each (``Message``: each stage it reaches as a ``ProgressEvent``, then its
``report.TargetResult`` or its one-line error), and writes everything the libraries print to a
log. Both sides read and write the protocol through its pydantic models only. A child killed by
a signal becomes a one-line reason naming the signal and the stage it was in; its log is kept
beside the target's artifacts.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from converters.progress import ProgressEvent

from . import errors
from .deadline import Deadline
from .errors import ToolError
from .report import schema
from .samples import Samples
from .targets.builder import StageCallback, TargetJob, TargetSettings
from .targets.profiles import TargetProfile

ORDER_NAME = "order.json"
LOG_NAME = "build.log"
PR_SET_PDEATHSIG = 1


class TargetFailed(ToolError):
    """The builder raised: its one-line reason (the pipeline reports the target failed)."""


# -- the protocol: what goes to the child, and each message that comes back ---------------------


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BuildOrder(_Message):
    """A :class:`TargetJob` as the child reads it: its settings as they are, the samples and
    the fp32 reference as the files it memory-maps, the deadline as a moment; the stage
    callback is the pipe."""

    builder: str  # "module:function": the profile's Builder (a test may name another)
    settings: TargetSettings
    calibration: Path  # a directory written by save_samples
    evaluation: Path
    reference: Path  # an .npy file
    deadline: float | None = None  # time.time() by which the build must be done (quant.deadline)


class SampleFiles(_Message):
    """What a samples directory holds besides its arrays (``input{i}.npy``, ``labels.npy``)."""

    inputs: list[str]  # the model's input names, in the order of the files
    source: str


class StageReached(_Message):
    kind: Literal["stage"] = "stage"
    event: ProgressEvent  # the stage within the target (fraction of its own build)


class Built(_Message):
    kind: Literal["result"] = "result"
    result: schema.TargetResult


class BuildFailed(_Message):
    kind: Literal["error"] = "error"
    reason: str  # the target's one-line reason (quant.errors.reason)


Message = Annotated[StageReached | Built | BuildFailed, Field(discriminator="kind")]
MESSAGES: TypeAdapter[Message] = TypeAdapter(Message)


def builder_for(profile: TargetProfile) -> str:
    return profile.builder.value


# -- the pipeline's side ------------------------------------------------------------------------


def build_in_child(order: BuildOrder, job_dir: Path, stage: StageCallback) -> schema.TargetResult:
    """``order`` built in a child process whose order, log and pipe are in ``job_dir``; each
    stage it reaches is passed to ``stage``. TargetFailed for an error it reported or a crash
    (the log of a crash is kept as ``target_dir/build.log``)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / ORDER_NAME).write_text(order.model_dump_json())
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
    with os.fdopen(read_end, "r") as lines:
        for line in lines:
            message = MESSAGES.validate_json(line)
            if isinstance(message, StageReached):
                event = message.event
                last_stage = event.label
                stage(event.stage, event.fraction, event.detail)
            else:
                outcome = message
    code = process.wait()
    if isinstance(outcome, Built):
        return outcome.result
    if isinstance(outcome, BuildFailed):
        raise TargetFailed(outcome.reason)
    kept = order.settings.target_dir / LOG_NAME
    kept.write_bytes(log.read_bytes())
    how = f"killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
    raise TargetFailed(
        f"the {order.settings.profile.name} build crashed in native code ({how}) during "
        f"'{last_stage}'; its output is in {kept.relative_to(order.settings.out_dir).as_posix()}"
    )


def save_samples(samples: Samples, directory: Path) -> None:
    """One .npy file per input (in the model's order), labels apart; the rest in a JSON."""
    directory.mkdir(parents=True, exist_ok=True)
    for index, array in enumerate(samples.feeds.values()):
        np.save(directory / f"input{index}.npy", array)
    if samples.labels is not None:
        np.save(directory / "labels.npy", samples.labels)
    about = SampleFiles(inputs=list(samples.feeds), source=samples.source)
    (directory / "samples.json").write_text(about.model_dump_json())


def load_samples(directory: Path) -> Samples:
    about = SampleFiles.model_validate_json((directory / "samples.json").read_text())
    feeds = {
        name: np.load(directory / f"input{index}.npy", mmap_mode="r")
        for index, name in enumerate(about.inputs)
    }
    labels_file = directory / "labels.npy"
    labels = np.load(labels_file) if labels_file.exists() else None
    return Samples(feeds, labels, about.source)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# -- the child's side ----------------------------------------------------------------------------


def die_with_parent() -> None:
    """Linux: be killed (SIGKILL) when the process (strictly: the thread) that started this
    one ends; elsewhere nothing (the caller's own clean-up has to do)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _import(dotted: str) -> Callable[[TargetJob], schema.TargetResult]:
    module, _, function = dotted.partition(":")
    return getattr(importlib.import_module(module), function)


@contextlib.contextmanager
def _channel(fd: int) -> Iterator[Callable[[_Message], None]]:
    with os.fdopen(fd, "w") as stream:

        def send(message: _Message) -> None:
            stream.write(message.model_dump_json() + "\n")
            stream.flush()

        yield send


def main(job_dir: str, fd: str) -> int:
    die_with_parent()
    order = BuildOrder.model_validate_json((Path(job_dir) / ORDER_NAME).read_text())
    with _channel(int(fd)) as send:
        try:
            job = TargetJob.given(
                order.settings,
                calibration=load_samples(order.calibration),
                evaluation=load_samples(order.evaluation),
                reference=np.load(order.reference),
                stage=lambda name, fraction, detail=None: send(
                    StageReached(event=ProgressEvent(name, fraction, detail=detail))
                ),
                deadline=Deadline(order.deadline),
            )
            result = _import(order.builder)(job)
        except Exception as error:  # the pipeline reports it as this target's one-line reason
            traceback.print_exc()
            send(BuildFailed(reason=errors.reason(error)))
            return 1
        send(Built(result=result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
