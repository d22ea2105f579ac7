"""Training the reference Transformers on real data: presets and the ``fit`` loop."""

from .fit import FitResult, TrainingDivergedError, filtered_counts, fit, lr_factor
from .presets import MODELS, PRESETS, Preset, get_preset, preset_names

__all__ = [
    "MODELS",
    "PRESETS",
    "FitResult",
    "Preset",
    "TrainingDivergedError",
    "filtered_counts",
    "fit",
    "get_preset",
    "lr_factor",
    "preset_names",
]
