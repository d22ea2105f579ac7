"""``transformers`` itself, imported only when a function needs it, so that ``import edge_un``
never does; and the quiet, one-line way edge_un talks through it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType

from ..checkpoint import CheckpointError

INSTALL_HINT = "pip install edge-un[hf]"


class TransformersUnavailableError(CheckpointError, ModuleNotFoundError):
    """``transformers`` is not installed; the message names the pip command."""


def require_transformers() -> ModuleType:
    """The ``transformers`` module, or a one-line error saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise TransformersUnavailableError(
            f"Hugging Face models need transformers; run: {INSTALL_HINT}"
        ) from None
    return transformers


def is_pretrained_model(model: object) -> bool:
    """A ``transformers`` model (saved as a directory), told apart without importing
    transformers: if nothing imported it, no object can be one of its models."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers else None
    return isinstance(base, type) and isinstance(model, base)


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """No "Loading weights" / "Writing model shards" progress bars from transformers: reading or
    writing a file is not a task the user follows (and a command's error must stay its one line
    on stderr)."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
