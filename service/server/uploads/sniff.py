"""What an uploaded file is, read from its bytes, without running or extracting anything.

Three readers the content checks in :mod:`.checks` build on: the safetensors header
(validated against the file size, so a truncated file is named as such before any loader maps
it), zip archives (limits on the declared sizes refuse a zip bomb before a byte is inflated:
:mod:`zipfile` never inflates past a member's declared size) and pickles (their opcodes walked
with :mod:`pickletools`, which parses and never calls anything, to name the globals a load would
call).
"""

from __future__ import annotations

import io
import json
import math
import pickletools
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ...errors import Refusal, UploadRejected
from .files import MIB

Kind = Literal["empty", "safetensors", "zip", "pickle", "npy", "other"]

MAX_SAFETENSORS_HEADER = 16 * MIB  # the header of a 50 M parameter model is a few kB
MAX_UNCOMPRESSED = 1024 * MIB  # what any zip upload may expand to, all members together
MAX_RATIO = 50  # expansion allowed above RATIO_FLOOR (compressed zeros legitimately reach 1000x)
RATIO_FLOOR = 32 * MIB
MAX_MEMBERS = 10_000
MAX_PICKLE_OPS = 2_000_000
SAFETENSORS_DTYPES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
# A global from these modules (or these builtins) in a pickle is a code-execution payload.
CODE_MODULES = {
    "os",
    "posix",
    "nt",
    "subprocess",
    "sys",
    "shutil",
    "socket",
    "importlib",
    "runpy",
    "pty",
    "ctypes",
    "multiprocessing",
    "code",
    "commands",
    "webbrowser",
    "pickle",
    "_pickle",
    "marshal",
    "types",
    "asyncio",
    "signal",
    "tempfile",
    "pathlib",
    "io",
    "_io",
    "codecs",
    "platform",
}
CODE_BUILTINS = {
    "eval",
    "exec",
    "compile",
    "__import__",
    "open",
    "getattr",
    "setattr",
    "delattr",
    "globals",
    "locals",
    "vars",
    "breakpoint",
    "input",
    "print",
    "exit",
    "quit",
    "apply",
    "execfile",
}


def sniff(path: Path) -> Kind:
    """The kind of file by its first bytes (never by its name)."""
    with path.open("rb") as stream:
        head = stream.read(16)
    if not head:
        return "empty"
    if len(head) >= 9 and head[8:9] == b"{":
        (length,) = struct.unpack("<Q", head[:8])
        if length >= 2:  # the safetensors layout: u64 header length, then a JSON object
            return "safetensors"
    if zipfile.is_zipfile(path):
        return "zip"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "pickle"  # PROTO n: how every pickle since protocol 2 opens (torch's legacy too)
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    return "other"


# -- safetensors ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SafetensorsHeader:
    shapes: dict[str, tuple[int, ...]]
    metadata: dict[str, str]

    @property
    def elements(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes.values())


def _bad(title: str, detail: str) -> UploadRejected:
    return UploadRejected(Refusal.UNUSABLE, title, detail)


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """The header, checked against the file: every tensor's bytes lie inside the file, exactly
    once. A file cut short (an interrupted upload or copy) is called truncated."""
    size = path.stat().st_size
    redo = "upload the complete file (compare its size or sha256 with the original)"
    with path.open("rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        if length > MAX_SAFETENSORS_HEADER:
            raise _bad(
                "Bad safetensors file",
                f"the safetensors header claims {length:,} bytes, "
                f"more than the {MAX_SAFETENSORS_HEADER // MIB} MB any model needs; "
                "the file is damaged or forged",
            )
        if 8 + length > size:
            raise _bad(
                "Truncated safetensors file",
                f"the safetensors file is truncated: its "
                f"header needs {8 + length:,} bytes, the file has {size:,}; {redo}",
            )
        raw = stream.read(length)
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=no_json_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise _bad(
            "Bad safetensors file",
            f"the safetensors header is not valid JSON "
            f"({type(error).__name__}); the file is damaged",
        ) from None
    if not isinstance(header, dict):
        raise _bad("Bad safetensors file", "the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad("Bad safetensors file", "the safetensors __metadata__ is not a string map")
    shapes: dict[str, tuple[int, ...]] = {}
    end_of_data = 0
    for name, entry in header.items():
        shapes[name], end = _tensor_extent(name, entry)
        end_of_data = max(end_of_data, end)
    stored = size - 8 - length
    if end_of_data > stored:
        raise _bad(
            "Truncated safetensors file",
            f"the safetensors file is truncated: its header "
            f"describes {end_of_data:,} bytes of tensor data, the file holds {stored:,}; "
            f"{redo}",
        )
    if end_of_data < stored:
        raise _bad(
            "Bad safetensors file",
            f"the safetensors file has {stored - end_of_data:,} "
            "bytes after its last tensor; the file is damaged",
        )
    return SafetensorsHeader(shapes, metadata)


def no_json_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _tensor_extent(name: str, entry: object) -> tuple[tuple[int, ...], int]:
    problem = f"the safetensors entry for tensor {name[:100]!r} is damaged"
    if not isinstance(entry, dict):
        raise _bad("Bad safetensors file", problem)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if (
        dtype not in SAFETENSORS_DTYPES
        or not isinstance(shape, list)
        or not all(type(d) is int and d >= 0 for d in shape)
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_DTYPES[dtype]
    ):
        raise _bad("Bad safetensors file", f"{problem} (dtype, shape or offsets)")
    return tuple(shape), offsets[1]


# -- zip -------------------------------------------------------------------------------------


def check_zip(path: Path, what: str) -> list[str]:
    """The member names of a zip archive whose declared sizes are safe to read; 422 for a zip
    bomb (too much data, too high a ratio, too many members), an encrypted or damaged archive."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as error:
        raise _bad(
            "Damaged archive",
            f"the {what} is a damaged zip archive ({error}); upload the complete file",
        ) from None
    if len(members) > MAX_MEMBERS:
        raise _bad(
            "Zip bomb refused",
            f"the {what} is a zip archive of {len(members):,} "
            f"members (at most {MAX_MEMBERS:,}); refused as a zip bomb",
        )
    total = sum(member.file_size for member in members)
    packed = max(path.stat().st_size, 1)
    if total > MAX_UNCOMPRESSED or (total > RATIO_FLOOR and total > MAX_RATIO * packed):
        raise _bad(
            "Zip bomb refused",
            f"the {what} is a zip bomb: {packed:,} bytes that would "
            f"expand to {total:,} (x{total / packed:,.0f}; at most "
            f"{MAX_UNCOMPRESSED // MIB:,} MB and x{MAX_RATIO} are allowed); nothing "
            "was extracted",
        )
    if any(member.flag_bits & 0x1 for member in members):
        raise _bad(
            "Encrypted archive", f"the {what} is an encrypted zip archive; upload it unencrypted"
        )
    return [member.filename for member in members]


def read_member(path: Path, name: str) -> bytes:
    """One member of an archive that :func:`check_zip` accepted (so its size is bounded)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.read(name)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as error:
        raise _bad(
            "Damaged archive",
            f"the zip member {name[:100]!r} cannot be read ({error}); upload the complete file",
        ) from None


# -- pickle ----------------------------------------------------------------------------------

_STRING_OPS = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
}


def pickle_globals(data: bytes) -> list[str] | None:
    """The globals (``module.name``) a pickle would look up (and most likely call) on load, from
    its opcodes alone; None if ``data`` is not a pickle at all."""
    found: list[str] = []
    strings: list[str] = []  # string pushes seen so far (STACK_GLOBAL takes the last two)
    memo: dict[int, str | None] = {}
    last: str | None = None
    try:
        for count, (op, arg, _) in enumerate(pickletools.genops(io.BytesIO(data))):
            if count > MAX_PICKLE_OPS:
                break
            name = op.name
            value: str | None = None
            if name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", ".", 1))
            elif name == "STACK_GLOBAL":
                found.append(".".join(strings[-2:]) if len(strings) >= 2 else "?")
            elif name in _STRING_OPS:
                value = arg.decode("latin-1") if isinstance(arg, bytes) else str(arg)
                strings.append(value)
            elif name == "MEMOIZE":
                memo[len(memo)] = last
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = last
            elif name in ("GET", "BINGET", "LONG_BINGET") and memo.get(int(arg)) is not None:
                value = memo[int(arg)]
                strings.append(value)  # type: ignore[arg-type]
            if name not in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                last = value
    except (ValueError, EOFError, UnicodeDecodeError, struct.error, IndexError, KeyError):
        return found or None
    return found


def code_globals(globals_: list[str]) -> list[str]:
    """The globals among ``globals_`` that run arbitrary code or touch the system."""
    risky = []
    for dotted in globals_:
        module, _, name = dotted.partition(".")
        if module in CODE_MODULES or (
            module in ("builtins", "__builtin__") and name in CODE_BUILTINS
        ):
            risky.append(dotted)
    return risky
