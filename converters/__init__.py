"""Fold offline norms into the weights (Algorithm 1) and export a clean ONNX graph.

* :func:`fold_norms`: an nn.Module (or a torch.export program) -> folded GraphModule + FoldReport;
* :func:`load_program`: a ``torch.export.save`` file (.pt2), read without unpickling;
* :func:`fold_onnx`: an fp32 ONNX model from any framework -> folded ONNX + FoldReport;
* :func:`export_onnx`: one self-contained, checked ONNX file + ExportInfo (ORT vs torch).
"""

from .errors import (
    ConversionError,
    NotAnOnnxModelError,
    NotAProgramError,
    OnlineNormError,
    OpsetError,
)
from .export import ExportInfo, TensorSpec, export_onnx
from .fold import fold_norms
from .onnx_fold import fold_onnx, load_onnx
from .program import load_program, program_example_inputs
from .report import FoldReport, NormFold

__all__ = [
    "ConversionError",
    "ExportInfo",
    "FoldReport",
    "NormFold",
    "NotAProgramError",
    "NotAnOnnxModelError",
    "OnlineNormError",
    "OpsetError",
    "TensorSpec",
    "export_onnx",
    "fold_norms",
    "fold_onnx",
    "load_onnx",
    "load_program",
    "program_example_inputs",
]
