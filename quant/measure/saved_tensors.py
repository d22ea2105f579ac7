"""Every tensor of an ONNX model on one batch of inputs, for a caller that reduces each batch's
tensors and drops them (the drift's per-tensor SQNR, a calibration pass): one session, not ORT's
``collect_activations``, which keeps every batch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization.qdq_loss_debug import (
    _TENSOR_SAVE_POSTFIX,  # the suffix of the outputs it adds: its own naming rule, not copied
    modify_model_output_intermediate_tensors,
)

from ..samples import Feeds, feed_for
from .graph_walk import static_batch
from .ort_options import computing_options

# Samples per run when every tensor of a model is saved (a model without a static batch): all
# of them are in memory at once, ~200 MB a sample for ViT-Tiny, so a few, not the whole set.
STREAM_BATCH = 4


class SavedTensors:
    """A batch of inputs (by input name) -> the float tensors of the model on it, by name.

    ORT's ``collect_activations`` keeps every batch and builds a session per call; this builds
    one session (graph optimizations off, as there: an int8 model runs its Q/DQ nodes as
    written) on the model saved with all its tensors as outputs at ``augmented``, and returns
    one batch's tensors for the caller to reduce and drop: all of them, or only the ``wanted``
    ones (``names`` lists what there is), so that ORT hands Python no more than is used."""

    def __init__(self, model_path: Path, augmented: Path) -> None:
        modify_model_output_intermediate_tensors(str(model_path), str(augmented))
        options = computing_options(optimize=False)
        options.enable_cpu_mem_arena = False  # the arena would hold a batch's tensors after it
        self.session = ort.InferenceSession(
            str(augmented), options, providers=["CPUExecutionProvider"]
        )
        self.input_names = [value.name for value in self.session.get_inputs()]
        self.outputs = {
            o.name[: -len(_TENSOR_SAVE_POSTFIX)]: o.name
            for o in self.session.get_outputs()
            if o.name.endswith(_TENSOR_SAVE_POSTFIX)
        }

    @property
    def names(self) -> list[str]:
        return list(self.outputs)

    def __call__(self, feeds: Feeds, wanted: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        names = self.names if wanted is None else list(wanted)
        outputs = self.session.run(
            [self.outputs[n] for n in names], feed_for(self.input_names, feeds)
        )
        return dict(zip(names, outputs, strict=True))


def stream_batch(model: onnx.ModelProto) -> int:
    """How many samples to run at once when every tensor is kept: the static batch, if any."""
    return static_batch(model) or STREAM_BATCH
