"""Progress of a long command on stderr: done of total, elapsed and the time left.

`specdec loadtest`, `bench` and `distill` show it when stderr is a terminal, or always with
`--progress` (never with `--no-progress`). On a terminal it is one line redrawn in place
(and every second while a step runs, so the clock moves); elsewhere one line per finished
step. Standard library only: the SDK stays light.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import TextIO


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress and the time left on stderr (default: when stderr is a terminal)",
    )


def progress_enabled(args: argparse.Namespace, stream: TextIO | None = None) -> bool:
    """--progress / --no-progress, else whether the stream (stderr) is a terminal."""
    if args.progress is not None:
        return bool(args.progress)
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def format_seconds(seconds: float) -> str:
    """75 -> '1:15', 3725 -> '1:02:05'."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Steps done of a known total, with the time left at the rate so far.

    ``total=None``: a count without an end. ``deadline_s``: the run ends after this many
    seconds whatever the count (a load test by duration), so the time left is the clock's.
    """

    def __init__(
        self,
        stream: TextIO | None,
        total: int | None,
        enabled: bool = True,
        deadline_s: float | None = None,
        tick_s: float = 1.0,
    ):
        self.stream = stream
        self.total = total
        self.enabled = enabled and stream is not None
        self.tty = self.enabled and stream is not None and bool(stream.isatty())
        self.deadline_s = deadline_s
        self.done = 0
        self.failed = 0
        self.started = time.monotonic()
        self.label = ""
        self._hidden = False  # cleared for a line of output; drawn again by the next call
        self._lock = threading.Lock()
        self._closed = threading.Event()
        if self.tty and tick_s > 0:
            threading.Thread(target=self._tick, args=(tick_s,), daemon=True).start()

    def restart(self) -> None:
        """The clock starts now (the rate and the deadline count from here)."""
        self.started = time.monotonic()

    def begin(self, label: str) -> None:
        """What runs now (redrawn on a terminal)."""
        self.label = label
        self._hidden = False
        self._draw()

    def clear(self) -> None:
        """Erase the bar before a line of other output (it comes back at the next call)."""
        self._hidden = True
        if self.tty:
            self._write("\r\033[K")

    def advance(self, ok: bool = True, steps: int = 1) -> None:
        """Steps finished (drawn on a terminal; see end_slice for other streams)."""
        with self._lock:
            self.done += steps
            self.failed += 0 if ok else steps
        self._hidden = False
        self._draw()

    def step(self, ok: bool = True, label: str | None = None) -> None:
        """One step finished: redrawn on a terminal, one line elsewhere."""
        if label is not None:
            self.label = label
        self.advance(ok)
        self.end_slice()

    def end_slice(self) -> None:
        """One line on a stream that is not a terminal."""
        if self.enabled and not self.tty:
            self._write(self.line() + "\n")

    def close(self) -> None:
        self._closed.set()
        if self.tty:
            self._write("\n")

    def remaining_s(self) -> float | None:
        """Seconds left: by the deadline, else by the rate of the steps so far."""
        elapsed = time.monotonic() - self.started
        if self.deadline_s is not None:
            return max(0.0, self.deadline_s - elapsed)
        if not self.total or not self.done:
            return None
        return elapsed / self.done * max(0, self.total - self.done)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        if self.total:
            width = 30
            filled = min(width, width * self.done // self.total)
            count = f"[{'#' * filled}{'-' * (width - filled)}] {self.done}/{self.total}"
        else:
            count = f"{self.done} done"
        failed = f" failed {self.failed}" if self.failed else ""
        left = self.remaining_s()
        eta = f", {format_seconds(left)} left" if left is not None else ", time left unknown"
        return f"{count}{failed} {format_seconds(elapsed)} elapsed{eta}  {self.label}".rstrip()

    def _draw(self) -> None:
        if self.tty:
            self._write("\r\033[K" + self.line())

    def _write(self, text: str) -> None:
        assert self.stream is not None
        with self._lock:
            self.stream.write(text)
            self.stream.flush()

    def _tick(self, every: float) -> None:
        while not self._closed.wait(every):
            if not self._hidden:
                self._draw()
