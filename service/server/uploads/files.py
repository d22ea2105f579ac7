"""Uploads: streamed to disk under a size limit; the client's file name is only a label.

Nothing here trusts the client: the bytes go to a server-chosen path (``dest``) chunk by chunk,
never held whole in memory, and the upload stops at the first chunk past the limit. The client's
file name is kept only to show it back (in job listings and reports), after refusing anything
that could be mistaken for a path.
"""

from __future__ import annotations

import contextlib
import unicodedata
from collections.abc import AsyncIterator, Collection
from pathlib import Path

from ...errors import Refusal, UploadRejected

MAX_LABEL_CHARS = 255  # a file name on every common file system
MIB = 1024 * 1024
LIMIT_SETTING = "EDGE_UN_MAX_UPLOAD_MB"
# The repeatable form field of an ONNX model's external data files, and how many it may have
# (torch.onnx.export and onnx.save_model write one: all_tensors_to_one_file).
DATA_FIELD = "model_data"
MAX_DATA_FILES = 8
# Bidirectional overrides and isolates: a name displayed as "model.onnx" that is not.
_BIDI_CONTROLS = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def safe_label(filename: str | None, field: str) -> str:
    """The client's file name for ``field`` as a display label; 400 for a name that is a path.

    A missing name becomes the field's name. Names are never used to build paths, but one with a
    separator, "..", NUL or control characters is an attempt (or a broken client) and is refused
    rather than silently cleaned, so the client learns what happened.
    """
    if filename is None or filename == "":
        return field
    problem = name_problem(filename)
    if problem:
        raise UploadRejected(
            Refusal.MALFORMED,
            "Bad file name",
            f"the file name of the {field!r} upload {_show(filename)} {problem}; send a plain "
            "file name such as model.safetensors (it is only a label: the server names files)",
        )
    return unicodedata.normalize("NFC", filename)


def data_file_name(filename: str | None, field: str, reserved: Collection[str]) -> str:
    """The name an external data file of an ONNX model is stored under: exactly the client's
    file name, since the model refers to the file by it (a label elsewhere, a path here), so it
    must be a plain file name, not one of the ``reserved`` names of the other uploads; 400 if
    not. Never normalized: the stored name must be byte for byte the one the model names."""
    example = "e.g. model.onnx.data"
    if filename is None or filename == "":
        raise UploadRejected(
            Refusal.MALFORMED,
            "Bad file name",
            f"a {field!r} part has no file name; send each external data file under the name "
            f"the ONNX model references ({example}: curl -F {field}=@model.onnx.data)",
        )
    problem = name_problem(filename)
    if problem is None and len(filename.encode("utf-8", "replace")) > MAX_LABEL_CHARS:
        problem = f"is longer than {MAX_LABEL_CHARS} bytes"  # what a file system takes (NAME_MAX)
    if problem:
        raise UploadRejected(
            Refusal.MALFORMED,
            "Bad file name",
            f"the file name of a {field!r} upload {_show(filename)} {problem}; send each external "
            f"data file under the plain file name the ONNX model references ({example})",
        )
    if filename in reserved:
        raise UploadRejected(
            Refusal.MALFORMED,
            "Bad file name",
            f"the {field!r} file name {_show(filename)} is one the server stores the other "
            f"uploads under ({', '.join(sorted(reserved))}); save the model's external data "
            "under another name (onnx.save_model(..., location='weights.data'))",
        )
    return filename


def name_problem(name: str) -> str | None:
    """What makes ``name`` more than a plain file name (a path, control characters), or None."""
    if "/" in name or "\\" in name:
        return "contains a path separator"
    if ".." in name:
        return "contains '..'"
    if "\x00" in name:
        return "contains a NUL character"
    if any(unicodedata.category(c) == "Cc" or c in _BIDI_CONTROLS for c in name):
        return "contains control characters"
    if name.strip() in ("", "."):
        return "is blank"
    if len(name) > MAX_LABEL_CHARS:
        return f"is longer than {MAX_LABEL_CHARS} characters"
    return None


def _show(name: str) -> str:
    """The name quoted, with control characters escaped and long names cut, for messages."""
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in name)
    return f"'{shown}'" if len(shown) <= 80 else f"'{shown[:77]}...'"


async def save_upload(chunks: AsyncIterator[bytes], dest: Path, max_bytes: int, field: str) -> int:
    """Stream ``chunks`` into ``dest`` (its parent exists) and return the byte count.

    Over ``max_bytes``: 413 and the partial file is removed. Nothing received: 400. Any other
    failure (a client that disconnects mid-upload) also removes the partial file, then re-raises.
    Writes are plain blocking writes of one chunk each: small, to a local file, which costs the
    event loop less than a thread hand-off per chunk.
    """
    total = 0
    stream = dest.open("xb")  # "x": never overwrite (or, below, remove) a file already there
    try:
        with stream:
            async for chunk in chunks:
                total += len(chunk)
                if total > max_bytes:
                    raise UploadRejected(
                        Refusal.TOO_LARGE,
                        "Upload too large",
                        f"the {field!r} upload is larger than the limit of "
                        f"{_megabytes(max_bytes)} MB; send a smaller file, or raise the limit "
                        f"with the server setting {LIMIT_SETTING}",
                    )
                stream.write(chunk)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            dest.unlink()
        raise
    if total == 0:
        dest.unlink()
        raise UploadRejected(
            Refusal.MALFORMED,
            "Empty upload",
            f"the {field!r} upload is empty (0 bytes); send the file itself",
        )
    return total


def _megabytes(max_bytes: int) -> str:
    return f"{max_bytes / MIB:.6g}"
