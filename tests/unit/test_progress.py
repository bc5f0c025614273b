"""Progress of long commands (specdec.sdk.progress): done of total, elapsed, time left."""

from __future__ import annotations

import argparse
import io
import time

import pytest

from specdec.sdk.progress import Progress, add_progress_argument, format_seconds, progress_enabled


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_format_seconds():
    assert format_seconds(0) == "0:00"
    assert format_seconds(75.4) == "1:15"
    assert format_seconds(3725) == "1:02:05"
    assert format_seconds(-3) == "0:00"


def test_time_left_from_the_pace_so_far():
    out = io.StringIO()
    p = Progress(out, 4)
    assert p.remaining_s() is None and "time left unknown" in p.line()
    p.step(label="prompt 1/4 k=2")
    p.step(label="prompt 2/4 k=2")
    p.started = time.monotonic() - 60  # two steps in a minute: two more take another
    assert p.remaining_s() == pytest.approx(60, abs=2)
    line = p.line()
    assert "2/4" in line and "1:00 elapsed" in line and "1:00 left" in line
    # not a terminal: one line per step, no redraw
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert lines[0].startswith("[") and "1/4" in lines[0] and lines[0].endswith("prompt 1/4 k=2")


def test_time_left_by_the_deadline():
    p = Progress(io.StringIO(), None, deadline_s=100)
    p.started = time.monotonic() - 30
    assert p.remaining_s() == pytest.approx(70, abs=2)
    assert "1:10 left" in p.line() or "1:09 left" in p.line()


def test_terminal_redraws_in_place_and_clears_for_output():
    out = Terminal()
    p = Progress(out, 2, tick_s=0)
    p.begin("first")
    p.advance()
    assert out.getvalue().count("\r\033[K") == 2 and "1/2" in out.getvalue()
    p.clear()
    assert out.getvalue().endswith("\r\033[K")
    p.close()
    assert out.getvalue().endswith("\n")


def test_disabled_writes_nothing():
    out = Terminal()
    p = Progress(out, 3, enabled=False)
    p.begin("x")
    p.step()
    p.close()
    assert out.getvalue() == ""


@pytest.mark.parametrize(
    ("argv", "stream", "shown"),
    [
        ([], io.StringIO(), False),  # not a terminal: off by default
        ([], Terminal(), True),
        (["--progress"], io.StringIO(), True),
        (["--no-progress"], Terminal(), False),
    ],
)
def test_progress_flag(argv, stream, shown):
    parser = argparse.ArgumentParser()
    add_progress_argument(parser)
    assert progress_enabled(parser.parse_args(argv), stream) is shown
