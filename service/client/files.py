"""The client's file handling: where a downloaded artifact goes, a Hugging Face directory as
the one .zip the service takes, where a resumed download starts."""

from __future__ import annotations

import zipfile
from pathlib import Path, PurePosixPath

import httpx

from quant.digest import sha256_file
from service.errors import UsageError

from .errors import ServiceError

__all__ = ["inside", "range_start", "sha256_file", "zip_hf_directory"]


def inside(directory: Path, name: str) -> Path:
    """``directory/name`` for an artifact name, refusing one that leads out of ``directory``
    (the server only lists names it wrote, but a client should not trust that)."""
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or any(p in ("..", "") for p in parts) or "\\" in name:
        raise ServiceError(f"the server listed an artifact with an unsafe name: {name[:80]!r}")
    return directory.joinpath(*parts)


def zip_hf_directory(directory: Path, dest: Path) -> Path:
    """A Hugging Face ``save_pretrained`` directory as the one .zip the service takes (only
    config.json and the .safetensors files: the server reads nothing else)."""
    members = [directory / "config.json", *sorted(directory.glob("*.safetensors"))]
    if not members[0].is_file() or len(members) == 1:
        raise UsageError(
            f"{directory}: not a Hugging Face save_pretrained directory (it needs config.json "
            "and .safetensors weights)"
        )
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as archive:  # weights do not compress
        for member in members:
            archive.write(member, f"{directory.name}/{member.name}")
    return dest


def range_start(response: httpx.Response) -> int | None:
    """Where a 206's ``Content-Range: bytes START-END/SIZE`` starts."""
    value = response.headers.get("content-range", "")
    unit, _, rest = value.partition(" ")
    start = rest.partition("-")[0]
    return int(start) if unit == "bytes" and start.isdigit() else None
