"""Training the reference Transformers on real data: presets, ``fit``, and the one training loop
(:mod:`.loop`) that fitting, migration, fine-tuning and the example builders share."""

from .evaluation import filtered_counts
from .fit import FitResult, fit, train_classifier
from .loop import Schedule, TrainingDivergedError, lr_factor
from .presets import MODELS, PRESETS, Preset, get_preset, preset_names

__all__ = [
    "MODELS",
    "PRESETS",
    "FitResult",
    "Preset",
    "Schedule",
    "TrainingDivergedError",
    "filtered_counts",
    "fit",
    "get_preset",
    "lr_factor",
    "preset_names",
    "train_classifier",
]
