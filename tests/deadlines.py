"""A deadline for the tests of a search step stopped part way (``quant.deadline``)."""

from __future__ import annotations

import time

from quant.deadline import Deadline


class StartsButCannotRun(Deadline):
    """Time left, so every search step starts; but what a step watches (the deadline less what
    must run after it) has passed, so the step stops at its first check."""

    def less(self, seconds: float) -> Deadline:
        return Deadline(time.time() - 1)
