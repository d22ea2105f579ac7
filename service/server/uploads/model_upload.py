"""What a model check finds (:class:`ModelUpload`), and the refusals every format's check
shares: a model over the size limit, online norms, non-finite weights. The checks themselves,
one per format: ``checkpoints``, ``programs``, ``onnx_checks``, ``pretrained``."""

from __future__ import annotations

from dataclasses import dataclass

from converters.source import ModelFormat

from ...errors import Refusal, UploadRejected
from ...settings import DEFAULT_MAX_PARAMETERS

PARAMETERS_SETTING = "EDGE_UN_MAX_PARAMETERS"
MIGRATE_ADVICE = (
    "the service converts only models whose norms fold into int8 weights: migrate it to UN "
    "first (edge-un migrate CHECKPOINT --kind un --out MODEL.safetensors) and upload the result, "
    "or convert it on your machine with edge-un convert MODEL --allow-online"
)


@dataclass(frozen=True)
class ModelUpload:
    format: ModelFormat
    parameters: int | None
    norm: str | None
    # The model's input names in order, as the conversion names them (None: not known here).
    inputs: tuple[str, ...] | None = None


def reject(title: str, detail: str, kind: Refusal = Refusal.UNUSABLE) -> UploadRejected:
    return UploadRejected(kind, title, detail)


def check_size(parameters: int, what: str, limit: int = DEFAULT_MAX_PARAMETERS) -> None:
    if parameters > limit:
        count = f"{parameters:,}" if parameters < 10**15 else "more than 10^15"
        raise reject(
            "Model too large",
            f"{what} {count} parameters, over the service limit of {limit:,} "
            f"({PARAMETERS_SETTING}); send a smaller model, or ask for a higher limit",
        )


def nonfinite(name: str) -> UploadRejected:
    return reject(
        "Non-finite weights",
        f"the model's tensor {name!r} contains NaN or Inf; the "
        "model diverged in training or the file is damaged",
    )
