"""The base of every error edge_un raises about what it was given.

A model, checkpoint, data set, setting or argument that cannot be used raises an
:class:`InputError` (or one of its subclasses: ``CheckpointError``, ``NormSwapError``, ...) whose
message says, in one line, what was wrong and what to do. Anything else edge_un raises is a bug
of ours: ``quant.errors.blame`` tells the two apart, so that a user never reads a bug as their
own mistake, nor their mistake as a bug.
"""

from __future__ import annotations


class InputError(ValueError):
    """What the caller gave cannot be used; the message is one readable line."""
