"""Recording of finished requests for drafter distillation (`--record DIR`).

What a row holds (one JSON object per line, schema ``specdec.record/1``): the token ids the
target saw (the session's history and the turn's prompt: ``prompt_ids``, of which the first
``history_tokens`` are history), the ids it produced (``output_ids``), each speculation
round's draft length and accepted count (``round_k``, ``round_accepted``, from the rounds'
`Outcome`s), where the draft came from (``round_source``: ``drafter``, ``prepared``, a
lookup source, ...) and how many of its last tokens a lookup appended to a model draft
(``round_extended``), the drafter's model version, the target's model id, the sampling settings and
the finish reason. Token ids decode to the user's text: a recording holds user data. The
user's session id is not stored.

Off by default; a request with ``record: false`` (GenerateRequest.record, the HTTP
extension field ``record``) is never handed to the recorder. Files are JSONL, named
``record-<UTC time>-<pid>-<n>.jsonl`` (sorting by name sorts by time), a new one once a
file would pass --record-max-bytes; the oldest are deleted beyond --record-max-files.

Never in a request's way: `Recorder.submit` puts the row on a bounded queue (no wait) and
one writer thread writes it. A full queue, a row larger than a file, or a failed write (a
full disk) drops the row, logs it and counts it in ``specdec_gateway_record_dropped_rows``
by reason; the request has already been answered either way.

With ``--record-top-logprobs M`` (0 by default) a row also holds the target's scores of
its output, from the Verify calls the request made anyway (specdec.replica.logprobs, the
code behind the API's ``logprobs``: after the request's logits processors, before
temperature, top-k and top-p): ``target_logprobs`` (each output token's), and
``target_top_ids`` / ``target_top_logprobs`` (the M likeliest tokens at each output
position, likeliest first), one entry per output id. `specdec distill` takes its KL
target from them instead of a teacher forward of the target.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from specdec.common.params import SamplingParams
from specdec.common.settings import ConfigError
from specdec.gateway.observe import metrics
from specdec.gateway.outcome import Outcome
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)

SCHEMA = "specdec.record/1"
SCORE_DIGITS = 5  # decimals kept of a recorded log-probability (float32 has about 7)
FILE_GLOB = "record-*.jsonl"
QUEUE_ROWS = 1024  # rows waiting for the writer; past it, rows are dropped (counted)


def recording_row(
    *,
    prompt_ids: Sequence[int],
    history_tokens: int,
    output_ids: Sequence[int],
    rounds: Sequence[Outcome],
    drafter_version: str,
    target_model: str,
    sampling: SamplingParams,
    finish_reason: str,
    scores: common_pb2.TokenLogprobs | None = None,
) -> dict[str, Any]:
    """One finished request as a recording row (see the module docstring); `scores`: the
    output tokens' rows from the Verify calls (--record-top-logprobs), one per output id."""
    row: dict[str, Any] = {
        "schema": SCHEMA,
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"),
        "target_model": target_model,
        "drafter_version": drafter_version,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "history_tokens": history_tokens,
        "prompt_ids": list(prompt_ids),
        "output_ids": list(output_ids),
        "round_k": [o.k for o in rounds],
        "round_accepted": [o.accepted for o in rounds],
        "round_source": [o.source for o in rounds],
        "round_extended": [o.extended for o in rounds],
        "finish_reason": finish_reason,
    }
    if scores is not None:
        if len(scores.logprobs) != len(output_ids):
            raise ValueError(f"{len(scores.logprobs)} scored tokens for {len(output_ids)} outputs")
        m = scores.num_top
        row["target_logprobs"] = [round(v, SCORE_DIGITS) for v in scores.logprobs]
        row["target_top_ids"] = [
            list(scores.top_token_ids[i * m : (i + 1) * m]) for i in range(len(output_ids))
        ]
        row["target_top_logprobs"] = [
            [round(v, SCORE_DIGITS) for v in scores.top_logprobs[i * m : (i + 1) * m]]
            for i in range(len(output_ids))
        ]
    return row


class Recorder:
    """Writes rows to rotated JSONL files in `directory` from a thread of its own."""

    def __init__(self, directory: str | Path, max_file_bytes: int, max_files: int):
        if max_file_bytes <= 0 or max_files <= 0:
            raise ValueError("max_file_bytes and max_files must be > 0")
        self.directory = Path(directory)
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--record {self.directory}: cannot create it ({e})") from None
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise ConfigError(f"--record {self.directory}: not writable by this process")
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(
            maxsize=QUEUE_ROWS
        )  # None: stop
        self._file: BinaryIO | None = None
        self._size = 0
        self._count = 0
        self._thread = threading.Thread(target=self._run, name="specdec-recorder", daemon=True)
        self._thread.start()

    def submit(self, row: dict[str, Any]) -> bool:
        """Queue a row for writing; False (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            self._dropped("queue_full")
            return False
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the writer thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    @staticmethod
    def _dropped(reason: str) -> None:
        metrics.RECORD_DROPPED.labels(reason=reason).inc()

    def _run(self) -> None:
        while (row := self._queue.get()) is not None:
            self._write(row)
        if self._file is not None:
            self._file.close()

    def _write(self, row: dict[str, Any]) -> None:
        try:
            line = (json.dumps(row, separators=(",", ":")) + "\n").encode()
        except (TypeError, ValueError) as e:  # a bug, not a reason to stop the writer
            log.error("recording row not serialisable; dropped", extra={"why": str(e)})
            self._dropped("bad_row")
            return
        if len(line) > self.max_file_bytes:
            log.warning(
                "recording row larger than --record-max-bytes; dropped", extra={"bytes": len(line)}
            )
            self._dropped("too_large")
            return
        try:
            file = self._file
            if file is None or self._size + len(line) > self.max_file_bytes:
                file = self._rotate()
            file.write(line)
            file.flush()
        except OSError as e:
            log.error("recording write failed; row dropped", extra={"why": str(e)})
            self._dropped("write_error")
            self._close_file()  # the next row starts a new file
            return
        self._size += len(line)
        metrics.RECORD_ROWS.inc()
        metrics.RECORD_BYTES.inc(len(line))

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _rotate(self) -> BinaryIO:
        """A new file, the one rows go to now (the oldest beyond max_files deleted)."""
        self._close_file()
        self._count += 1
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        path = self.directory / f"record-{stamp}-{os.getpid()}-{self._count:06d}.jsonl"
        self._file = file = open(path, "ab")  # noqa: SIM115 (kept open across rows)
        self._size = 0
        files = sorted(self.directory.glob(FILE_GLOB))
        for old in files[: max(0, len(files) - self.max_files)]:
            try:
                old.unlink()
            except OSError as e:
                log.warning(
                    "could not delete an old recording", extra={"file": str(old), "why": str(e)}
                )
        return file
