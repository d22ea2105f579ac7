"""The sha256 of a file, as every artifact record, manifest and download check states it."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path``, read 1 MiB at a time (artifacts reach GBs)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
