"""int8 post-training quantization per edge target, and its measurements.

* :func:`convert` (:mod:`quant.pipeline`): the one pipeline the CLI and the service run;
  :class:`ConversionRequest` (:mod:`quant.request`): what it is asked, as one typed value, which
  :func:`run_conversion` takes (the service builds one from a job);
* :mod:`quant.targets`: the edge target profiles and their rules;
* :class:`Report` (:mod:`quant.report`): the versioned ``report.json`` schema.
"""

from typing import TYPE_CHECKING, Any

from .errors import DataFileError, QuantError, RuleViolation, UnknownTargetError
from .targets.profiles import PROFILES, TARGET_NAMES, TargetProfile

if TYPE_CHECKING:
    from .pipeline import convert, run_conversion
    from .report.schema import SCHEMA_VERSION, Report
    from .request import ConversionRequest, conversion_request


def __getattr__(name: str) -> Any:
    # The pipeline pulls in ONNX Runtime, LiteRT and torch, the report pydantic: each imported
    # on first use, so that ``python -m quant.tflite.toolenv`` (the install step), ``edge-un
    # targets`` and the command line's start (its options' defaults are quant.targets') stay light.
    if name in ("convert", "run_conversion"):
        from . import pipeline

        return getattr(pipeline, name)
    if name in ("ConversionRequest", "conversion_request"):
        from . import request

        return getattr(request, name)
    if name in ("Report", "SCHEMA_VERSION"):
        from .report import schema

        return getattr(schema, name)
    raise AttributeError(f"module 'quant' has no attribute {name!r}")


__all__ = [
    "PROFILES",
    "SCHEMA_VERSION",
    "TARGET_NAMES",
    "ConversionRequest",
    "DataFileError",
    "QuantError",
    "Report",
    "RuleViolation",
    "TargetProfile",
    "UnknownTargetError",
    "conversion_request",
    "convert",
    "run_conversion",
]
