"""Which way each power-of-two scale of a QDQ file was rounded, carried by the file itself.

``quant.ort.pow2.scales.round_scales_to_power_of_two`` rounds every MinMax scale to the power of two
just above it (no clipping, coarser steps) or to one below (finer steps, the tail clipped),
whichever quantizes the tensor's own values with the least squared error (a masked Softmax input:
as the Softmax sees it). ``scale_choices``
lists that choice tensor by tensor; ``write_choices`` stores the list in the file's
``metadata_props`` (``METADATA_KEY``, JSON; runtimes ignore it), so that it reaches the report
through every later step (bias correction, the recipe ladder's copies) from the file that
ships (``recorded_choices``).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ...report import schema
from .scales import power_of_two_ceil

METADATA_KEY = "edge_un.power_of_two_scales"
OWN_ERROR = "own error"
SOFTMAX_VISIBLE_ERROR = "softmax-visible error"
RANGE = "range"


def scales_by_name(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Scale name -> value, for every Quantize/DequantizeLinear of ``model``."""
    initializers = {init.name: init for init in model.graph.initializer}
    names = {
        n.input[1] for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
    }
    return {name: numpy_helper.to_array(initializers[name]) for name in names}


def scale_choices(
    model: onnx.ModelProto,
    minmax: Mapping[str, np.ndarray],
    chosen: Mapping[str, np.ndarray],
    by_error: set[str],
    softmax_inputs: Collection[str] = (),
) -> list[schema.PowerOfTwoScale]:
    """One record per activation and weight tensor of the QDQ ``model``: its power of two
    against its MinMax scale (``minmax``), channel by channel. Weights and the activations in
    ``by_error`` (scale names) were chosen by their own values' error (a tensor in
    ``softmax_inputs``: as its Softmax sees them); the others were rounded up by range. A
    bias follows its input's and weight's scales and has no record."""
    initializers = {init.name: init for init in model.graph.initializer}
    records, seen = [], set()
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or node.input[1] in seen:
            continue
        tensor, scale = node.input[0], node.input[1]
        weight = node.op_type == "DequantizeLinear" and tensor in initializers
        if not weight and node.op_type != "QuantizeLinear":
            continue
        seen.add(scale)
        if weight and initializers[tensor].data_type == onnx.TensorProto.INT32:
            continue  # a bias
        power = np.asarray(chosen[scale], np.float64).reshape(-1)
        old = np.asarray(minmax[scale], np.float64).reshape(-1)
        up = int(np.count_nonzero(power >= old))
        further = int(np.count_nonzero(power < power_of_two_ceil(old) / 2))
        records.append(
            schema.PowerOfTwoScale(
                tensor=tensor,
                kind="weight" if weight else "activation",
                channels_up=up,
                channels_down=power.size - up,
                channels_down_further=further,
                log2_scale=None if weight else int(np.round(np.log2(power[0]))),
                chosen_by=_chosen_by(weight, scale in by_error, tensor in softmax_inputs),
            )
        )
    return records


def _chosen_by(weight: bool, by_error: bool, softmax_input: bool) -> str:
    if weight or (by_error and not softmax_input):
        return OWN_ERROR
    return SOFTMAX_VISIBLE_ERROR if by_error else RANGE


def write_choices(model: onnx.ModelProto, records: list[schema.PowerOfTwoScale]) -> None:
    kept = [prop for prop in model.metadata_props if prop.key != METADATA_KEY]
    value = json.dumps([record.model_dump() for record in records])
    del model.metadata_props[:]
    model.metadata_props.extend([*kept, onnx.StringStringEntryProto(key=METADATA_KEY, value=value)])


def recorded_choices(path: Path) -> list[schema.PowerOfTwoScale]:
    """The choices a QDQ ONNX file records (none when its scales are not powers of two)."""
    model = onnx.load(str(path), load_external_data=False)
    props = {prop.key: prop.value for prop in model.metadata_props}
    return [schema.PowerOfTwoScale(**item) for item in json.loads(props.get(METADATA_KEY, "[]"))]
