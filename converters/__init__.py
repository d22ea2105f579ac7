"""Fold offline norms into the weights (Algorithm 1) and export a clean ONNX graph.

* :func:`fold_norms`: an nn.Module (or a torch.export program) -> folded GraphModule + FoldReport;
* :func:`load_program`: a ``torch.export.save`` file (.pt2), read without unpickling;
* :func:`fold_onnx`: an fp32 ONNX model from any framework -> folded ONNX + FoldReport;
* :func:`export_onnx`: one self-contained, checked ONNX file + ExportInfo (ORT vs torch).

The names are imported on first use: most of them pull in torch (seconds), which the light
modules (:mod:`converters.progress`, :mod:`converters.source`, :mod:`converters.onnx_names`)
and the processes that only need those (the CLI's remote commands, quant's target builders)
must not pay for.
"""

from importlib import import_module
from typing import Any

# Each public name and the module that defines it.
_HOMES = {
    "ConversionError": "errors",
    "NotAProgramError": "errors",
    "NotAnOnnxModelError": "errors",
    "OnlineNormError": "errors",
    "OpsetError": "errors",
    "ExportInfo": "export",
    "TensorSpec": "export",
    "export_onnx": "export",
    "fold_norms": "fold",
    "fold_onnx": "onnx_fold",
    "load_onnx": "onnx_fold",
    "load_program": "program",
    "program_example_inputs": "program",
    "FoldReport": "fold_report",
    "NormFold": "fold_report",
    "ModelFormat": "source",
    "ModelSource": "source",
    "Progress": "progress",
    "ProgressEvent": "progress",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'converters' has no attribute {name!r}")
    return getattr(import_module(f".{home}", __name__), name)


__all__ = sorted(_HOMES)
