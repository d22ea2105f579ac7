"""``service.server.ranges``: a Range header is refused (problem+json) exactly when the
FileResponse that serves the file would refuse it (in plain text), and with the status the
service has always given (400: not a byte range, 416: does not fit)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import FileResponse

from service.server.ranges import range_status

SIZE = 100
number = st.sampled_from(["0", "5", "99", "100", "150", "", " 3", "1_0", "a", "-"])
part = st.builds(lambda a, dash, b: a + dash + b, number, st.sampled_from(["-", "", "--"]), number)
header = st.lists(part, min_size=1, max_size=4).map(lambda parts: "bytes=" + ",".join(parts))


def starlette_status(value: str) -> int | None:
    """What the service answered when it asked Starlette's own parser (before ranges.py)."""
    try:
        ranges = FileResponse._parse_range_header(value, SIZE)
    except Exception:
        return 416 if value.startswith("bytes=") else 400
    return None if ranges else 416


@settings(max_examples=2000, deadline=None)
@given(header)
def test_a_header_is_refused_exactly_when_file_response_refuses_it(value: str) -> None:
    assert range_status(value, SIZE) == starlette_status(value)


def test_the_documented_cases() -> None:
    assert range_status("bytes=0-9", SIZE) is None
    assert range_status("bytes=-5", SIZE) is None  # the last five bytes
    assert range_status("bytes=0-1, junk", SIZE) is None  # a part that is not one is passed over
    assert range_status(f"bytes={SIZE}-", SIZE) == 416  # starts past the end
    assert range_status("bytes=5-2", SIZE) == 416  # ends before it starts
    assert range_status("items=0-1", SIZE) == 400  # not a byte range at all
    assert range_status("bytes=" + ",".join(["0-1"] * 101), SIZE) == 416  # too many parts
