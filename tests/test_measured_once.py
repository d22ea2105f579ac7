"""quant.measured_once: one measurement per job and key, none left by one that failed."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from quant.measured_once import file_key, measured_once


def test_the_first_build_measures_and_the_next_reads_its_result(tmp_path: Path) -> None:
    calls: list[int] = []

    def measure() -> dict:
        calls.append(1)
        return {"agreement": 0.99, "layers": [("softmax_3", "Softmax", float("inf"))]}

    first = measured_once(tmp_path, "drift-abc", measure)
    second = measured_once(tmp_path, "drift-abc", measure)
    assert len(calls) == 1
    assert (
        first == second == {"agreement": 0.99, "layers": [["softmax_3", "Softmax", float("inf")]]}
    )
    measured_once(tmp_path, "drift-def", measure)  # another key is another measurement
    assert len(calls) == 2


def test_without_a_shared_directory_every_call_measures() -> None:
    calls: list[int] = []
    for _ in range(2):
        assert measured_once(None, "k", lambda: calls.append(1) or (1, 2)) == (1, 2)
    assert len(calls) == 2


def test_a_measurement_that_failed_leaves_nothing_and_the_next_build_measures(
    tmp_path: Path,
) -> None:
    def crash() -> dict:
        raise RuntimeError("LiteRT aborted")

    with pytest.raises(RuntimeError, match="LiteRT aborted"):
        measured_once(tmp_path, "k", crash)
    assert measured_once(tmp_path, "k", lambda: [3]) == [3]


def _measure_in_child(shared: Path, log: Path) -> None:
    def measure() -> int:
        with log.open("a") as stream:
            stream.write("measured\n")
        return 7

    assert measured_once(shared, "latency-x-1", measure) == 7


def test_builds_at_once_measure_once_and_a_killed_one_leaves_no_result(tmp_path: Path) -> None:
    """Four processes ask at once: one measures, the others wait on the lock and read. A
    process killed holding the lock (mid-measurement) releases it with no result written."""
    context = multiprocessing.get_context("fork")
    log = tmp_path / "log"
    children = [
        context.Process(target=_measure_in_child, args=(tmp_path / "a", log)) for _ in range(4)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    assert [child.exitcode for child in children] == [0] * 4
    assert log.read_text() == "measured\n"

    started = tmp_path / "started"
    stuck = context.Process(target=_measure_forever, args=(tmp_path / "b", started))
    stuck.start()
    while not started.is_file():
        stuck.join(0.05)
    stuck.kill()
    stuck.join(10)
    assert not (tmp_path / "b" / "measured" / "k.json").exists()
    assert measured_once(tmp_path / "b", "k", lambda: "again") == "again"


def _measure_forever(shared: Path, started: Path) -> None:
    def measure() -> None:
        started.touch()
        time.sleep(120)

    measured_once(shared, "k", measure)


def test_a_files_key_changes_with_its_content_and_the_details(tmp_path: Path) -> None:
    path = tmp_path / "model_int8.tflite"
    path.write_bytes(b"one")
    key = file_key("litert-latency", path, 1, 100)
    assert key.startswith("litert-latency-") and key.endswith("-1-100")
    assert file_key("litert-latency", path, 2, 100) != key
    path.write_bytes(b"two")
    assert file_key("litert-latency", path, 1, 100) != key
