"""Fine-tuning for deployment: distil a LayerNorm model into UN, make a UN model int8-ready,
and recompute precise inference statistics. One distillation engine serves every use, for
edge_un's own models (one input tensor) and Hugging Face models (named inputs) alike; it takes
its steps in the one training loop, :mod:`edge_un.training.loop`."""

from ..training.evaluation import agreement, predict
from ..training.inputs import ModelInputs
from ..training.loop import ExtraLoss
from .engine import EpochRecord, FinetuneRecipe, FinetuneResult, distill
from .int8_ready import (
    BRANCH_OUTPUTS,
    METHODS,
    BranchDecay,
    NoBranchOutputsError,
    RangePenalty,
    branch_outputs,
    make_int8_ready,
    residual_ranges,
)
from .migrate import NothingToMigrateError, migrate, migration_student
from .recalibrate import LayerTID, RecalibrationReport, inference_statistics, recalibrate
from .record import finetune_metadata, save_finetuned

__all__ = [
    "BRANCH_OUTPUTS",
    "METHODS",
    "BranchDecay",
    "EpochRecord",
    "ExtraLoss",
    "FinetuneRecipe",
    "FinetuneResult",
    "LayerTID",
    "ModelInputs",
    "NoBranchOutputsError",
    "NothingToMigrateError",
    "RangePenalty",
    "RecalibrationReport",
    "agreement",
    "branch_outputs",
    "distill",
    "finetune_metadata",
    "inference_statistics",
    "make_int8_ready",
    "migrate",
    "migration_student",
    "predict",
    "recalibrate",
    "residual_ranges",
    "save_finetuned",
]
