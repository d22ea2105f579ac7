"""The fine-tunes' model inputs are the training loop's: :mod:`edge_un.training.inputs`.

This module only keeps the import path ``edge_un.finetune.inputs.logits_of`` working for the
converters, which take it from here; new code imports :mod:`edge_un.training.inputs`.
"""

from ..training.inputs import logits_of

__all__ = ["logits_of"]
