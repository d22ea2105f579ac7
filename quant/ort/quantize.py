"""int8 ONNX through ONNX Runtime's quantizer: QDQ, per-channel int8 weights, MinMax calibration.

Nothing here calibrates by hand: ``quant_pre_process`` then ``quantize_static`` do the work; a
profile only chooses the options, and ``int16_tensors`` moves named activations to 16 bits
through ORT's ``TensorQuantOverrides`` (the drift fallback). Around it, a profile may ask for
ONNX Runtime's speed rewrites (``quant.ort.graph``: Linears as Gemm before; after,
``quant.ort.rewrites``: float inputs for Softmax/GELU, the attention's operands), for
power-of-two scales (TIDL's simple calibration, ``quant.ort.pow2.scales``), each activation's
chosen by its error on the calibration data, which one fp32 pass here runs
(``calibration_pass``); and for its int32 biases corrected on the calibration data
(``quant.ort.bias_correction``), against fp32 means that same pass takes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quant_pre_process,
    quantize_static,
)
from onnxruntime.quantization.calibrate import load_tensors_data

from ..deadline import check as check_deadline
from ..measure.graph_walk import graph_input_names, static_batch
from ..measure.saved_tensors import SavedTensors, stream_batch
from ..samples import Samples, feed_for
from ..targets.profiles import TargetProfile
from .bias_correction import (
    ChannelSums,
    channel_means,
    channel_rows,
    correct_biases,
    fp32_tensors,
    mean_sites,
)
from .graph import linear_as_gemm
from .pow2.record import scale_choices, scales_by_name, write_choices
from .pow2.scales import (
    candidate_count,
    fp32_constants,
    masked_softmax_inputs,
    power_of_two_candidates,
    quantized_dtype,
    round_scales_to_power_of_two,
    smallest_error,
    softmax_visible_error,
    squared_error,
    zero_point_of,
)
from .rewrites import apply_ort_rewrites, ort_rewrites, shared_quantization

CALIBRATION_BATCH = 32
POWER_OF_TWO_SAMPLES = 32  # calibration samples that choose each power-of-two activation scale
QUANT_TYPES = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}


class SamplesReader(CalibrationDataReader):
    """Feeds calibration samples to ORT's calibrator in batches, every input by its name."""

    def __init__(
        self, input_names: Sequence[str], samples: Samples, batch: int, *, pad: bool = False
    ) -> None:
        feeds = feed_for(input_names, samples.feeds)
        self.batches = list(Samples(feeds, None, samples.source).batches(batch, pad=pad))
        self.position = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        check_deadline()  # a search may stop here, between two batches of ORT's calibration
        if self.position >= len(self.batches):
            return None
        self.position += 1
        return self.batches[self.position - 1]

    def rewind(self) -> None:
        self.position = 0


def quantize_onnx(
    fp32_path: Path,
    out_path: Path,
    profile: TargetProfile,
    calibration: Samples,
    int16_tensors: Sequence[str] = (),
    preparation: Preprocessed | None = None,
) -> Path:
    """Quantize ``fp32_path`` for ``profile``; the activations in ``int16_tensors`` get 16 bits.
    ``preparation``: what an earlier quantization of the same file on the same ``calibration``
    left for this one (``preprocess_once``); without it, this call prepares and calibrates alone."""
    kept = preparation.uncorrected.get((profile, tuple(int16_tensors))) if preparation else None
    if kept is not None:  # an earlier call made this file on its way to correcting its biases
        preparation.check(fp32_path, profile, calibration)
        shutil.copyfile(kept, out_path)
        return out_path
    model = onnx.load(str(fp32_path))
    input_names = graph_input_names(model)
    fixed = static_batch(model)
    with tempfile.TemporaryDirectory() as scratch, _quiet():
        shared = preparation or preprocess_once(fp32_path, profile, calibration, Path(scratch))
        shared.check(fp32_path, profile, calibration)
        prepared = shared.graph
        widened = shared_quantization(onnx.load(str(prepared)), int16_tensors)
        overrides = {name: [{"quant_type": QuantType.QInt16}] for name in widened}
        quantize_static(
            str(prepared),
            str(out_path),
            SamplesReader(
                input_names, calibration, fixed or CALIBRATION_BATCH, pad=fixed is not None
            ),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QUANT_TYPES[profile.activation_type],
            weight_type=QUANT_TYPES[profile.weight_type],
            reduce_range=profile.weight_bits == 7,
            calibrate_method=CalibrationMethod.MinMax,
            extra_options={
                "ActivationSymmetric": profile.symmetric_activations,
                "WeightSymmetric": True,
                "TensorQuantOverrides": overrides,
            },
            calibration_cache_path=str(shared.ranges),  # measured by the first call, then read
        )
        if profile.power_of_two_scales or profile.bias_correction or ort_rewrites(profile):
            quantized = onnx.load(str(out_path))
            reference = None  # the prepared fp32 graph, for the steps that measure against it
            if profile.power_of_two_scales or profile.bias_correction:
                reference = onnx.load(str(prepared))
            means_of = {}  # the fp32 channel means bias correction needs and has not got
            if profile.bias_correction:
                needed = mean_sites(quantized, fp32_tensors(reference))
                means_of = {n: site for n, site in needed.items() if n not in shared.fp32_means}
            if profile.power_of_two_scales:
                # MinMax scales first: they give each activation its power-of-two candidates;
                # the same fp32 pass takes the means bias correction measures against
                count = profile.power_of_two_candidates
                softmax_axes = masked_softmax_inputs(reference)
                scales, fp32_means = calibration_pass(
                    quantized, reference, prepared, calibration, Path(scratch), means_of, count,
                    softmax_axes,
                )  # fmt: skip
                shared.fp32_means.update(fp32_means)
                minmax = scales_by_name(quantized)
                originals = fp32_constants(quantized, reference)
                chosen = round_scales_to_power_of_two(quantized, scales, count, originals)
                records = scale_choices(quantized, minmax, chosen, set(scales), softmax_axes)
                write_choices(quantized, records)
            apply_ort_rewrites(quantized, profile, load_tensors_data(shared.ranges))
            if profile.bias_correction:  # last: on the graph that ships, with its final scales
                if preparation is not None:
                    uncorrected = replace(profile, bias_correction=False)
                    shared.keep_uncorrected(uncorrected, tuple(int16_tensors), quantized)
                left = {n: axis for n, (axis, _) in means_of.items() if n not in shared.fp32_means}
                if left:  # no power-of-two pass took them: a pass of their own, once
                    shared.fp32_means.update(channel_means(reference, left, calibration))
                correct_biases(quantized, reference, calibration, shared.fp32_means)
            onnx.save_model(quantized, str(out_path))
    return out_path


@dataclass(frozen=True)
class Preprocessed:
    """What every quantization of one fp32 file for one target shares, made once: ORT's
    pre-processed fp32 graph (``preprocess_for_quantization``) and every activation's range on the
    calibration data, which the first ``quantize_static`` measures and saves as ORT's own
    calibration cache (its ``calibration_cache_path``, JSON) and each later one reads back.

    A target's int8 ladder and drift fallback quantize the same file again with other options
    (weight type, bias correction, 16-bit tensors); neither the graph nor the ranges depend on
    them, only on the file, the Linears-as-Gemm choice and the calibration samples, which
    ``check`` holds a call to. So do the fp32 channel means bias correction measures against,
    kept here by the first quantization that corrects biases, which also keeps its file as it
    was just before the correction (``uncorrected``: the same recipe without it, tda4vm's second
    rung, is then a copy). BERT-base's cpu ladder, its three recipes one after the other: 54.5 /
    81.1 / 75.1 -> 42.1 / 44.1 / 32.4 s (measured once)."""

    fp32_path: Path
    gemm_linears: bool
    calibration: Samples
    graph: Path
    ranges: Path
    fp32_means: dict[str, np.ndarray] = field(default_factory=dict)
    # (recipe, int16 tensors) -> a file a quantization that corrects its biases wrote just
    # before correcting them: that recipe without the correction, made already (tda4vm's second
    # rung; everything before the correction is the same, the power-of-two scales included)
    uncorrected: dict[tuple[TargetProfile, tuple[str, ...]], Path] = field(default_factory=dict)

    def keep_uncorrected(
        self, recipe: TargetProfile, int16_tensors: tuple[str, ...], model: onnx.ModelProto
    ) -> None:
        path = self.graph.parent / f"uncorrected_{len(self.uncorrected)}.onnx"
        onnx.save_model(model, str(path))
        self.uncorrected[(recipe, int16_tensors)] = path

    def check(self, fp32_path: Path, profile: TargetProfile, calibration: Samples) -> None:
        if (
            self.fp32_path != fp32_path
            or self.gemm_linears != profile.gemm_linears
            or self.calibration is not calibration
        ):
            raise ValueError(
                f"a preparation of {self.fp32_path} (Linears as Gemm: {self.gemm_linears}) "
                f"cannot serve a quantization of {fp32_path} for {profile.name} "
                f"(Linears as Gemm: {profile.gemm_linears}) or on other calibration data"
            )


def preprocess_once(
    fp32_path: Path, profile: TargetProfile, calibration: Samples, directory: Path
) -> Preprocessed:
    """A :class:`Preprocessed` of ``fp32_path`` in ``directory``, which must outlive its use;
    its ranges are measured by the first quantization given it."""
    with _quiet():
        graph = preprocess_for_quantization(fp32_path, profile, directory)
    check_deadline()  # the preparation runs unwatched: a stretch of its own, not the calibration's
    return Preprocessed(
        fp32_path, profile.gemm_linears, calibration, graph, directory / "calibration_ranges.json"
    )


def preprocess_for_quantization(fp32_path: Path, profile: TargetProfile, scratch: Path) -> Path:
    """The fp32 graph ORT's quantizer is given, and the reference bias correction measures
    against (in ``scratch``): its Linears as Gemm where ``profile`` wants them, then ORT's own
    pre-processing (shape inference; its fusions rename tensors)."""
    source = fp32_path
    if profile.gemm_linears:
        model = onnx.load(str(fp32_path))
        linear_as_gemm(model)
        source = scratch / "gemm_linears.onnx"
        onnx.save_model(model, str(source))
    prepared = scratch / "prepared.onnx"
    quant_pre_process(str(source), str(prepared), skip_symbolic_shape=False)
    return prepared


def calibration_pass(
    quantized: onnx.ModelProto,
    fp32: onnx.ModelProto,
    fp32_path: Path,
    calibration: Samples,
    scratch: Path,
    means_of: Mapping[str, tuple[int, int]],
    candidates_per_scale: int,
    softmax_axes: Mapping[str, int],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One pass of the fp32 model ``fp32`` (saved at ``fp32_path``) over ``calibration``:

    - scale name -> its best power of two of ``candidates_per_scale``, for each activation
      QuantizeLinear of ``quantized`` (by error, not only by range), judged on the first
      ``POWER_OF_TWO_SAMPLES`` samples (to the end of the batch holding the last of them), a
      tensor in ``softmax_axes`` (a masked Softmax input -> its Softmax's axis,
      ``quant.ort.pow2.scales.masked_softmax_inputs``) as its Softmax sees it;
    - tensor -> its channel means over every sample, for each of ``means_of`` (the tensors bias
      correction measures against, ``quant.ort.bias_correction.mean_sites``).

    One pass for both: at batch 1 each sample runs once, not once for each (BERT-base's tda4vm
    quantization, measured once side by side: docs/guides/large-models.md). Streamed: a
    batch adds each candidate's squared error and each channel's sum to their totals, and its
    tensors are dropped; the choice compares the totals, as if all samples had been kept."""
    initializers = {init.name: init for init in quantized.graph.initializer}
    sites: dict[str, onnx.NodeProto] = {}  # scale -> the first QuantizeLinear using it decides
    for node in quantized.graph.node:
        if node.op_type == "QuantizeLinear":
            sites.setdefault(node.input[1], node)
    producers = {out: node.op_type for node in quantized.graph.node for out in node.output}
    candidates = {
        scale: power_of_two_candidates(
            numpy_helper.to_array(initializers[scale]),
            candidate_count(producers.get(node.input[0]), candidates_per_scale),
        )
        for scale, node in sites.items()
    }
    errors: dict[str, list[np.ndarray]] = {}  # scale -> each candidate's total
    run = SavedTensors(fp32_path, scratch / "augmented.onnx")
    # a scale whose tensor is not a float tensor of the fp32 model is rounded up later
    sites = {scale: node for scale, node in sites.items() if node.input[0] in run.outputs}
    choosing = sorted({node.input[0] for node in sites.values()})
    means_of = {name: site for name, site in means_of.items() if name in run.outputs}
    sums = ChannelSums()
    batch, pad = stream_batch(fp32), static_batch(fp32) is not None
    for start, chunk in zip(
        range(0, len(calibration), batch), calibration.batches(batch, pad=pad), strict=True
    ):
        check_deadline()  # a search may stop here, between two batches
        chooses = start < POWER_OF_TWO_SAMPLES
        if not chooses and not means_of:
            break
        values = run(chunk, sorted({*(choosing if chooses else ()), *means_of}))
        for scale, node in sites.items() if chooses else ():
            real = values[node.input[0]]
            zero_point = zero_point_of(node, initializers)
            dtype = quantized_dtype(node, initializers)
            if node.input[0] in softmax_axes:
                axis = softmax_axes[node.input[0]]
                batch_errors = [softmax_visible_error(real, c, zero_point, dtype, axis)
                                for c in candidates[scale]]  # fmt: skip
            else:
                batch_errors = [squared_error(real, c, zero_point, dtype)
                                for c in candidates[scale]]  # fmt: skip
            totals = errors.get(scale, [0.0] * len(batch_errors))
            errors[scale] = [t + e for t, e in zip(totals, batch_errors, strict=True)]
        fed, real_rows = len(next(iter(chunk.values()))), min(batch, len(calibration) - start)
        for name, (axis, channels) in means_of.items():  # padding rows left out
            sums.add(name, channel_rows(values[name], fed, real_rows, axis, channels))
        del values  # before the next batch's tensors arrive
    scales = {scale: smallest_error(candidates[scale], errors[scale]) for scale in errors}
    return scales, sums.means()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """ORT's quantizer logs and prints calibration chatter; the caller's output stays clean."""
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
