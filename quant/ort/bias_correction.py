"""Empirical bias correction of an int8 QDQ ONNX model, from calibration data only.

Why: rounding a Linear's weights (to 7 or 8 bits, and for TIDL to a power-of-two scale per
channel) shifts the mean of each output channel whenever the input's mean is not zero (GELU
outputs, the residual stream): ``sum_k (Wq - W)[c, k] * E[x_k]`` is the same on every sample,
so it does not average out downstream as rounding noise does. The int32 bias of the integer
kernel can absorb it for free: each bias is lowered by its output channel's mean error, the
int8 model's mean minus the fp32 model's on the calibration data (the empirical variant of
Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias Correction", ICCV
2019). What it does to the bundled HF models: ``benchmarks/results/bias_correction.md``.

Sequential, in graph order: each bias is measured with every bias before it already corrected,
because an upstream correction changes what reaches it. Correcting all of them from one
measurement counts the upstream error twice (tried on a migrated HF ViT: the logits' error
grew instead of shrinking). One walk through the int8 graph does it (``quant.measure.graph_walk``):
each bias is measured where the walk reaches its output and corrected before the walk goes
on: the same biases as one whole pass per bias gave, bit for bit, at the cost of under two
passes. BERT-base's 72 biases on 64 samples: the walk 29 s and the fp32 pass 18 s, where one
pass of its int8 file takes 20 s and one pass per bias ~24 min (measured once, 2 cores).
Only the bias values change; every scale, and so every rule of the target, stays as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnxruntime.quantization.quant_utils import QUANT_INPUT_SUFFIX

from ..deadline import check as check_deadline
from ..measure.graph_walk import GraphWalk, static_batch
from ..measure.ort_options import computing_options
from ..samples import Samples, feed_for

BATCH = 32  # samples per run for a model without a fixed batch


@dataclass(frozen=True)
class BiasSite:
    """An integer kernel's int32 bias and the output it is added into."""

    bias: str  # the int32 initializer
    scale: str  # its scale: input scale x weight scale, left as it is
    output: str  # the Conv/Gemm output in the int8 model, before its QuantizeLinear
    reference: str  # the same tensor in the fp32 model
    channel_axis: int  # where its channels are: 1 for Conv (NCHW), -1 for Gemm


def bias_sites(model: onnx.ModelProto, fp32_tensors: set[str]) -> list[BiasSite]:
    """Every Conv/Gemm of the QDQ ``model`` whose bias is a constant int32 DequantizeLinear and
    whose output the fp32 model also has, in graph order. ORT's quantizer renames an output it
    quantizes that is also a graph output: its float twin ends in ``_QuantizeLinear_Input``."""
    initializers = {init.name: init for init in model.graph.initializer}
    dequantized = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    sites = []
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 3:
            continue
        feed = dequantized.get(node.input[2])
        if feed is None or feed.input[0] not in initializers:
            continue
        if initializers[feed.input[0]].data_type != onnx.TensorProto.INT32:
            continue
        output = node.output[0]
        reference = output.removesuffix(QUANT_INPUT_SUFFIX)
        if reference not in fp32_tensors:
            continue
        axis = 1 if node.op_type == "Conv" else -1
        sites.append(BiasSite(feed.input[0], feed.input[1], output, reference, axis))
    return sites


def correct_biases(
    model: onnx.ModelProto,
    fp32: onnx.ModelProto,
    samples: Samples,
    fp32_means: Mapping[str, np.ndarray] | None = None,
) -> int:
    """Correct, in place, every int32 bias of the QDQ ``model`` (``bias_sites``) by its output
    channel's mean error against ``fp32`` (the graph it was quantized from) on ``samples``;
    returns how many biases were corrected. One pass of the fp32 model, then one walk through
    the int8 model (``quant.measure.graph_walk``): each bias is measured where the walk reaches its
    output, with every bias before it corrected, in the exact arithmetic (graph optimizations
    off, as the drift is measured). ``fp32_means``: the fp32 means (``mean_sites``) a pass
    of the caller's over the same ``samples`` already took; the pass here measures the rest.
    Raises quant.deadline.SearchStopped between two biases once a watched deadline passed."""
    sites = bias_sites(model, fp32_tensors(fp32))
    if not sites:
        return 0
    known = dict(fp32_means or {})
    missing = {s.reference: s.channel_axis for s in sites if s.reference not in known}
    fp32_means = known | (channel_means(fp32, missing, samples) if missing else {})
    initializers = {init.name: init for init in model.graph.initializer}
    fixed = static_batch(model)
    walk = GraphWalk(model, samples, fixed or BATCH, pad=fixed is not None)
    for site in sites:
        check_deadline()  # a search may stop here, between two biases
        outputs = walk.advance_to(site.output)
        rows = [
            channel_rows(output, fed, real, site.channel_axis)
            for output, (fed, real) in zip(outputs, walk.batches, strict=True)
        ]
        int8_mean = sum(r.sum(axis=0, dtype=np.float64) for r in rows) / sum(map(len, rows))
        error = int8_mean - fp32_means[site.reference]
        bias = initializers[site.bias]
        values = numpy_helper.to_array(bias).astype(np.float64)
        scale = numpy_helper.to_array(initializers[site.scale]).astype(np.float64)
        info = np.iinfo(np.int32)
        corrected = np.clip(np.round(values - error / scale), info.min, info.max)
        bias.CopyFrom(numpy_helper.from_array(corrected.astype(np.int32), site.bias))
    return len(sites)


def fp32_tensors(model: onnx.ModelProto) -> set[str]:
    """The tensors the nodes of ``model`` compute, which a bias site's reference must be."""
    return {out for node in model.graph.node for out in node.output}


def mean_sites(model: onnx.ModelProto, fp32: set[str]) -> dict[str, tuple[int, int]]:
    """The fp32 tensors whose channel means ``correct_biases`` of the QDQ ``model`` needs (its
    ``bias_sites`` in ``fp32``, the tensors of the graph it was quantized from), each with its
    channel axis and channel count (its bias's length): what a caller's own pass over the same
    samples measures (``ChannelSums``) to hand them over, even from flattened tensors."""
    initializers = {init.name: init for init in model.graph.initializer}
    return {
        site.reference: (site.channel_axis, int(initializers[site.bias].dims[0]))
        for site in bias_sites(model, fp32)
    }


class ChannelSums:
    """A pass's per-channel sums of tensors (float64), batch by batch, for their means."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, rows: np.ndarray) -> None:
        """``rows``: one batch of the tensor as (positions, channels) (``channel_rows``)."""
        self.sums[name] = self.sums.get(name, 0.0) + rows.sum(axis=0, dtype=np.float64)
        self.counts[name] = self.counts.get(name, 0) + len(rows)

    def means(self) -> dict[str, np.ndarray]:
        return {name: total / self.counts[name] for name, total in self.sums.items()}


def channel_means(
    model: onnx.ModelProto, tensors: Mapping[str, int], samples: Samples
) -> dict[str, np.ndarray]:
    """Tensor name -> its mean per channel (the axis given: 1 or -1) over every sample and
    position, the model run as written; streamed, so only the sums stay in memory. Rows a
    fixed-batch model pads its last batch with are left out."""
    augmented = onnx.ModelProto()
    augmented.CopyFrom(model)
    graph_outputs = {value.name for value in augmented.graph.output}
    augmented.graph.output.extend(
        onnx.ValueInfoProto(name=name) for name in tensors if name not in graph_outputs
    )
    options = computing_options(optimize=False)
    session = ort.InferenceSession(
        augmented.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    input_names = [value.name for value in session.get_inputs()]
    names = list(tensors)
    fixed = static_batch(model)
    size = fixed or BATCH
    sums = ChannelSums()
    for start, chunk in zip(
        range(0, len(samples), size), samples.batches(size, pad=fixed is not None), strict=True
    ):
        check_deadline()  # a search may stop here, between two batches
        real = min(size, len(samples) - start)  # the rest of a padded batch repeats its last row
        outputs = session.run(names, feed_for(input_names, chunk))
        for name, value in zip(names, outputs, strict=True):
            fed = len(next(iter(chunk.values())))
            sums.add(name, channel_rows(value, fed, real, tensors[name]))
    return sums.means()


def channel_rows(
    value: np.ndarray, batch: int, real: int, axis: int, channels: int | None = None
) -> np.ndarray:
    """One run's ``value`` as (positions, channels), from the first ``real`` of its ``batch``
    samples. Both layouts are batch-major: a Conv's (N, C, ...) and a Gemm's (N x tokens, C).
    ``channels``: how many, for a ``value`` flattened (else its shape says)."""
    per_sample = value.reshape(batch, -1)[:real]
    if axis == 1:  # (N, C, ...) -> (N x ..., C)
        channels = channels or value.shape[1]
        return np.moveaxis(per_sample.reshape(real, channels, -1), 1, -1).reshape(-1, channels)
    return per_sample.reshape(-1, channels or value.shape[-1])
