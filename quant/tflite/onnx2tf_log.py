"""Reading onnx2tf's per-node log: the ONNX tensor behind each tensor of its TFLite file.

onnx2tf gives its tensors TensorFlow names (``model_92/tf.nn.softmax_7/node_softmax_3``); its log
pairs each ONNX node's outputs with the TensorFlow tensors built for them, which is how a TFLite
tensor gets its ONNX name back (``quant.tflite.litert.onnx_names``) and from that its module
(``quant.sources``).
"""

from __future__ import annotations

import re

from .tool_sandbox import strip_ansi

_ONNX_OUTPUT = re.compile(r"^INFO:\s+output_name\.(\d+): (\S+) shape:")
_TF_OUTPUT = re.compile(r"^INFO:\s+output\.(\d+)\.\S+: name: (\S+?)(:\d+)? shape:")
_ONNX_OP = re.compile(r"^INFO: onnx_op_type: ")
_BUILD_START = re.compile(r"^Model conversion started ")


def parse_tensor_map(log: str) -> dict[str, str]:
    """{TF tensor name (no ':0') -> ONNX tensor name} from onnx2tf's per-node log.

    For each ONNX node onnx2tf logs its ONNX output names, then the TensorFlow tensors it built
    for them, in the same order. Only single-output nodes are mapped (a Split's TF outputs do not
    keep their index in the TFLite names). Insertion order is ONNX graph order. A log of two
    builds (``onnx_to_saved_model.py`` builds again in strict mode a model whose fast build was
    wrong) maps the last one's tensors, those of the file.
    """
    mapping: dict[str, str] = {}
    onnx_outputs: list[str] = []
    tf_outputs: list[str] = []

    def flush() -> None:
        if len(onnx_outputs) == 1 and len(tf_outputs) == 1:
            mapping[tf_outputs[0]] = onnx_outputs[0]

    for raw in strip_ansi(log).splitlines():
        if _BUILD_START.match(raw):
            mapping, onnx_outputs, tf_outputs = {}, [], []
        elif _ONNX_OP.match(raw):
            flush()
            onnx_outputs, tf_outputs = [], []
        elif m := _ONNX_OUTPUT.match(raw):
            onnx_outputs.append(m.group(2))
        elif m := _TF_OUTPUT.match(raw):
            tf_outputs.append(m.group(2))
    flush()
    return mapping
