"""Residual streams moved onto the power-of-two grid: one factor per stream, chosen by the
quantized model's logits error, before a power-of-two target quantizes.

With power-of-two scales a tensor's step is its range rounded to a power of two, up (a coarser
step) or down (the tail clipped): a range just above a power of two loses almost a bit either
way. The ranges of a residual stream's tensors (``quant.ort.pow2.residual_streams``) move together
with the stream's factor c, which the fp32 model does not notice, so each stream's c in [1, 2) is
searched on a grid of ``FACTORS``: the fp32 file scaled, quantized with the target's first
recipe, run in exact arithmetic on calibration samples, its logits compared with the fp32
ones (mean squared difference, the quantity the int8 file should keep small). The lowest
error wins if its gain over c = 1 is significant, sample by sample (``significantly_lower``);
else the stream stays as it was. Measured on the bundled HF UN ViT (held-out split, tda4vm):
the logits' error 0.209 at c = 1 and 0.137 at the chosen c (benchmarks/results/tda4vm_streams.md),
near the 0.127 of the same file with unrounded scales (measured once, not a benchmark).

Streams are searched one after another (each with the factors already chosen for the ones
before). A model over ``MAX_SEARCH_WEIGHTS`` is not searched (each candidate is a whole
quantization; BERT-base's takes ~1.5 min), nor one whose candidates would compute over
``MAX_SEARCH_MULTIPLY_ADDS`` (samples times multiply-adds a sample, summed over candidates:
work, not seconds, so a busy host decides as a quiet one does); the search stops before any
candidate that the job's deadline would not leave time for. The factors found so far are kept,
and the report says why it stopped.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ...deadline import NO_DEADLINE, Deadline
from ...measure.drift import onnx_runner
from ...samples import Samples
from ..multiply_adds import multiply_adds_per_sample
from .residual_streams import ResidualStream, find_streams, scale_stream

FACTORS = tuple(2 ** (step / 8) for step in range(8))  # one octave: the grid repeats after it
SEARCH_SAMPLES = 256  # calibration samples each candidate is judged on (all, by default)
SIGNIFICANCE = 2.0  # standard errors a factor's gain over 1 must exceed to be kept
MAX_SEARCH_WEIGHTS = 20_000_000  # float weights; above, the search would outlast the build
# The whole search's arithmetic (candidates x samples x multiply-adds a sample): a model small
# in weights but large in compute (a ViT at 224 x 224) is not searched rather than spend minutes
# a factor. Measured once (not a benchmark) on a 2-core zen3 host: ~2 s a candidate per 1e9
# (the bundled vit-mnist-un: 7.7 M a sample, 256 samples, 8 candidates: 1.6e10, ~30 s), so
# 1e11 is ~3.3 min there.
MAX_SEARCH_MULTIPLY_ADDS = 100e9

NOT_SEARCHED = "residual streams not (all) moved onto the power-of-two grid"

Quantize = Callable[[Path, Path], object]  # (fp32 file, int8 file to write)


@dataclass(frozen=True)
class StreamFactor:
    """A residual stream's chosen factor, and the search's logits error at 1 and at it."""

    stream: ResidualStream
    factor: float
    error_at_one: float
    error: float


@dataclass(frozen=True)
class GridSearch:
    """The factors chosen (one per scalable stream; none when the search did not run) and
    why it did not run or stopped early, in a sentence, or None."""

    factors: tuple[StreamFactor, ...]
    note: str | None = None

    @property
    def scaled(self) -> bool:
        """Whether any stream's factor is not 1: the fp32 file changed."""
        return any(found.factor != 1.0 for found in self.factors)


def align_streams(
    fp32_path: Path,
    out_path: Path,
    quantize: Quantize,
    samples: Samples,
    deadline: Deadline = NO_DEADLINE,
) -> GridSearch:
    """Write ``fp32_path`` with its residual streams scaled by their best factors to
    ``out_path`` and say what was chosen; nothing is written when every factor stays 1."""
    model = onnx.load(str(fp32_path))
    streams = find_streams(model)
    if not streams:
        return GridSearch(())
    weights = sum(int(np.prod(init.dims)) for init in model.graph.initializer)
    if weights > MAX_SEARCH_WEIGHTS:
        return GridSearch((), f"{NOT_SEARCHED}: {weights / 1e6:.0f} M weights (searched up to "
                              f"{MAX_SEARCH_WEIGHTS / 1e6:.0f} M; each factor is a whole "
                              "quantization)")  # fmt: skip
    search = samples.head(SEARCH_SAMPLES)
    candidates = len(streams) * len(FACTORS)
    work = candidates * len(search) * multiply_adds_per_sample(model)
    if work > MAX_SEARCH_MULTIPLY_ADDS:
        return GridSearch((), f"{NOT_SEARCHED}: {candidates} candidates of {len(search)} samples "
                              f"would compute {work:.1e} multiply-adds (searched up to "
                              f"{MAX_SEARCH_MULTIPLY_ADDS:.0e})")  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        error = _LogitsError(model, quantize, search, onnx_runner(fp32_path)(search.feeds),
                             Path(scratch))  # fmt: skip
        grid = _search(streams, error, deadline)
    if grid.scaled:
        for found in grid.factors:
            scale_stream(model, found.stream, found.factor)
        onnx.save_model(model, str(out_path))
    return grid


def _search(streams: list[ResidualStream], error: _LogitsError, deadline: Deadline) -> GridSearch:
    """Each stream's factor in turn, the ones before it kept at their choice."""
    factors = [1.0] * len(streams)
    chosen: list[StreamFactor] = []
    for index, stream in enumerate(streams):
        errors: dict[float, np.ndarray] = {}  # factor -> each sample's error
        for factor in FACTORS:
            if not deadline.allows(error.step_s):
                return GridSearch(tuple(chosen), f"{NOT_SEARCHED}: the job's time ran out")
            errors[factor] = error(streams, [*factors[:index], factor, *factors[index + 1 :]])
        best = min(errors, key=lambda factor: errors[factor].mean())
        factors[index] = best if significantly_lower(errors[best], errors[1.0]) else 1.0
        chosen.append(StreamFactor(stream, factors[index], float(errors[1.0].mean()),
                                   float(errors[factors[index]].mean())))  # fmt: skip
    return GridSearch(tuple(chosen))


def significantly_lower(errors: np.ndarray, baseline: np.ndarray) -> bool:
    """Whether per-sample ``errors`` are lower than ``baseline``'s on the same samples by more
    than ``SIGNIFICANCE`` standard errors of their paired difference: a smaller gain is within
    what another draw of samples would undo (measured once while building it: without this rule
    text-rt-ln-to-un took a factor 8 % lower in the search and lost 1.1 pt of test agreement)."""
    gain = baseline - errors
    if len(gain) < 2 or not gain.any():
        return False
    return bool(gain.mean() > SIGNIFICANCE * gain.std(ddof=1) / np.sqrt(len(gain)))


class _LogitsError:
    """Stream factors -> each sample's mean squared logits error of the quantized, scaled
    model."""

    def __init__(self, model, quantize: Quantize, samples: Samples, reference, scratch: Path):
        self.model, self.quantize, self.samples = model, quantize, samples
        self.reference, self.scratch = reference, scratch
        self.step_s = 0.0  # how long the last candidate took

    def __call__(self, streams: list[ResidualStream], factors: list[float]) -> np.ndarray:
        started = time.monotonic()
        scaled = onnx.ModelProto()
        scaled.CopyFrom(self.model)
        for stream, factor in zip(streams, factors, strict=True):
            if factor != 1.0:
                scale_stream(scaled, stream, factor)
        fp32, int8 = self.scratch / "scaled.onnx", self.scratch / "scaled_int8.onnx"
        onnx.save_model(scaled, str(fp32))
        self.quantize(fp32, int8)
        outputs = onnx_runner(int8, exact=True)(self.samples.feeds)
        self.step_s = time.monotonic() - started
        squared = np.square(outputs - self.reference, dtype=np.float64)
        return squared.reshape(len(squared), -1).mean(axis=1)  # one figure a sample
