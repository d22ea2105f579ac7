"""A streaming multipart/form-data reader: one part at a time, its data as an async iterator.

FastAPI's ``UploadFile`` parses the whole body (spooling files) before a route runs, so a size
limit could only be checked after everything arrived. Here the route pulls the body from the
socket as it writes each file (``files.save_upload``), so an oversize upload is cut off at the
limit, and form fields are read with a small cap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from ...errors import Refusal, UploadRejected, malformed

MAX_PARTS = 16


@dataclass(frozen=True)
class Part:
    name: str
    filename: str | None  # None for a plain form field
    content_type: str | None


def boundary_of(content_type: str | None) -> bytes:
    """The multipart boundary, or a 415/400 problem saying what to send."""
    kind, options = parse_options_header(content_type or "")
    if kind != b"multipart/form-data":
        raise UploadRejected(
            Refusal.NOT_A_FORM,
            "Unsupported media type",
            f"this route takes multipart/form-data, not {content_type or 'an empty body type'!r}; "
            "send the files as form fields (curl -F model=@model.safetensors ...)",
        )
    boundary = options.get(b"boundary")
    if not boundary or len(boundary) > 200:
        raise malformed("the multipart/form-data Content-Type has no usable boundary")
    return boundary


class MultipartReader:
    """``async for part in reader.parts()``; read each with ``data()`` or ``text(limit)``."""

    def __init__(self, body: AsyncIterator[bytes], boundary: bytes) -> None:
        self._body = body
        self._events: deque[tuple[str, Any]] = deque()
        self._header_field = b""
        self._headers: dict[bytes, bytes] = {}
        self._ended = False
        self._in_part = False
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._on_begin,
                "on_part_data": lambda d, s, e: self._events.append(("data", bytes(d[s:e]))),
                "on_part_end": lambda: self._events.append(("end", b"")),
                "on_header_field": self._on_field,
                "on_header_value": self._on_value,
                "on_header_end": self._on_header_end,
                "on_headers_finished": lambda: self._events.append(("headers", self._headers)),
                "on_end": lambda: self._events.append(("finish", b"")),
            },
        )

    def _on_begin(self) -> None:
        self._headers = {}  # the parser runs ahead of the reader: each part gets its own dict
        self._events.append(("begin", b""))

    def _on_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _on_value(self, data: bytes, start: int, end: int) -> None:
        key = self._header_field.lower()
        self._headers[key] = self._headers.get(key, b"") + data[start:end]

    def _on_header_end(self) -> None:
        self._header_field = b""

    async def _next_event(self) -> tuple[str, Any]:
        while not self._events:
            if self._ended:
                raise malformed(
                    "the multipart body ended before its closing boundary; "
                    "send a complete multipart/form-data body",
                )
            try:
                chunk = await anext(self._body)
            except StopAsyncIteration:
                self._ended = True
                continue
            if chunk:
                try:
                    self._parser.write(chunk)
                except MultipartParseError as error:
                    raise malformed(
                        f"the multipart body is malformed ({error}); send a "
                        "valid multipart/form-data body",
                    ) from None
        return self._events.popleft()

    async def parts(self) -> AsyncIterator[Part]:
        count = 0
        while True:
            if self._in_part:  # the caller skipped (part of) the previous part's data
                async for _ in self.data():
                    pass
            kind, _ = await self._next_event()
            if kind == "finish":
                return
            if kind != "begin":
                continue
            kind, headers = await self._next_event()
            while kind != "headers":
                kind, headers = await self._next_event()
            count += 1
            if count > MAX_PARTS:
                raise malformed(
                    f"the form has more than {MAX_PARTS} parts; send only the documented fields",
                )
            self._in_part = True
            yield self._part(headers)

    @staticmethod
    def _part(headers: dict[bytes, bytes]) -> Part:
        disposition = headers.get(b"content-disposition", b"")
        kind, options = parse_options_header(disposition)
        name = options.get(b"name")
        if kind != b"form-data" or name is None:
            raise malformed(
                "a multipart part has no Content-Disposition: form-data name; name every part"
            )
        filename = options.get(b"filename")
        content_type = headers.get(b"content-type")
        return Part(
            name.decode("utf-8", "replace"),
            None if filename is None else filename.decode("utf-8", "replace"),
            None if content_type is None else content_type.decode("latin-1"),
        )

    async def data(self) -> AsyncIterator[bytes]:
        """The current part's bytes, as they arrive."""
        while self._in_part:
            kind, chunk = await self._next_event()
            if kind == "data":
                yield chunk
            elif kind == "end":
                self._in_part = False

    async def text(self, field: str, limit: int = 1000) -> str:
        """A small form field's value as text (413-free: a long value is a 400)."""
        value = b""
        async for chunk in self.data():
            value += chunk
            if len(value) > limit:
                raise malformed(f"the form field {field!r} is longer than {limit} bytes")
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise malformed(f"the form field {field!r} is not UTF-8 text") from None
