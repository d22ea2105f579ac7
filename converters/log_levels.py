"""Quieter third-party loggers around a call, for log lines that are not the user's concern."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

# The exporter's and onnxscript's own: they log the fallbacks they take as expected (an op
# exported another way, a node constant folding leaves as it is).
EXPORTER_LOGGERS = ("torch.onnx", "onnxscript")


@contextlib.contextmanager
def loggers_at(level: int, names: tuple[str, ...] = EXPORTER_LOGGERS) -> Iterator[None]:
    """Temporarily raise the level of the loggers ``names``."""
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, old in zip(loggers, saved, strict=True):
            logger.setLevel(old)
