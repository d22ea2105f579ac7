"""Progress of a long pipeline, as typed events: what the CLI's bar and the service's job
record both read, with nothing to parse back out of a string.

A pipeline calls ``progress(ProgressEvent(...))`` at each stage (and within long ones); the
fraction is of the whole run. ``target`` says which edge target a stage works for (quant's
pipeline builds several one after another); ``detail`` is what a person may want to read
beside the stage's name ("8 tensors to int16"), never needed to tell stages apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ProgressEvent:
    stage: str  # a stable name: "load", "export", "quantize", "fallback", "done", ...
    fraction: float  # of the whole run, 0..1
    target: str | None = None  # the edge target the stage works for; None: the whole run
    detail: str | None = None

    @property
    def label(self) -> str:
        """One line for a person: ``cpu: fallback (8 tensors to int16)``."""
        text = self.stage if self.detail is None else f"{self.stage} ({self.detail})"
        return text if self.target is None else f"{self.target}: {text}"


Progress = Callable[[ProgressEvent], None]


def ignore_progress(event: ProgressEvent) -> None:
    """The default ``progress``: nobody is watching."""
