"""Fold offline norms into the weights (Algorithm 1) and export a clean ONNX graph.

* :func:`fold_norms`: an nn.Module (or a torch.export program) -> folded GraphModule + FoldReport;
* :func:`load_program`: a ``torch.export.save`` file (.pt2), read without unpickling;
* :func:`fold_onnx`: an fp32 ONNX model from any framework -> folded ONNX + FoldReport;
* :func:`export_onnx`: one self-contained, checked ONNX file + ExportInfo (ORT vs torch);
* :class:`ModelSource`: a model and its format; :class:`ProgressEvent`: a pipeline's progress.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .errors import (
    ConversionError,
    NotAnOnnxModelError,
    NotAProgramError,
    OnlineNormError,
    OpsetError,
)
from .fold_report import FoldReport, NormFold
from .progress import Progress, ProgressEvent
from .source import ModelFormat, ModelSource

if TYPE_CHECKING:
    from .export import ExportInfo, TensorSpec, export_onnx
    from .fold import fold_norms
    from .onnx_fold import fold_onnx, load_onnx
    from .program import load_program, program_example_inputs

# The names whose modules import torch, each imported on first use: importing this package
# (which any ``converters.x`` import does) stays torch-free, so that quant's target builders can
# read ``converters.onnx_metadata`` without loading torch (~2 s, and its memory, per process).
_LAZY = {
    "ExportInfo": "export",
    "TensorSpec": "export",
    "export_onnx": "export",
    "fold_norms": "fold",
    "fold_onnx": "onnx_fold",
    "load_onnx": "onnx_fold",
    "load_program": "program",
    "program_example_inputs": "program",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'converters' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "ConversionError",
    "ExportInfo",
    "FoldReport",
    "ModelFormat",
    "ModelSource",
    "NormFold",
    "NotAProgramError",
    "NotAnOnnxModelError",
    "OnlineNormError",
    "OpsetError",
    "Progress",
    "ProgressEvent",
    "TensorSpec",
    "export_onnx",
    "fold_norms",
    "fold_onnx",
    "load_onnx",
    "load_program",
    "program_example_inputs",
]
