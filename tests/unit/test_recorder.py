"""The gateway's recorder: rows round-trip, files rotate and stay bounded, failures are
counted and never raised."""

from __future__ import annotations

import json
import shutil

import pytest
from prometheus_client import REGISTRY

from specdec.gateway.outcome import DRAFTED, NO_DRAFT, Outcome
from specdec.gateway.recorder import FILE_GLOB, Recorder, recording_row
from specdec.tools.distill.data import load_recordings, read_rows
from specdec.v1 import common_pb2


def line_bytes(r: dict) -> int:
    return len(json.dumps(r, separators=(",", ":")).encode()) + 1


def dropped(reason: str) -> float:
    return (
        REGISTRY.get_sample_value("specdec_gateway_record_dropped_rows_total", {"reason": reason})
        or 0.0
    )


def outcome(
    k: int, accepted: int, index: int, source: str = NO_DRAFT, extended: int = 0
) -> Outcome:
    return Outcome(
        index=index,
        max_k=k,
        k=k,
        draft=tuple(range(k)),
        accepted=accepted,
        next_token=7,
        source=source,
        draft_seconds=0.0,
        verify_seconds=0.0,
        queue_depth=0,
        resends=0,
        extended=extended,
    )


def row(i: int, n_out: int = 3) -> dict:
    return recording_row(
        prompt_ids=[1, 2, 3, i],
        history_tokens=1,
        output_ids=list(range(10, 10 + n_out)),
        rounds=[outcome(3, 2, 0, DRAFTED, extended=1), outcome(0, 0, 1)],
        drafter_version="v1",
        target_model="target",
        sampling=common_pb2.SamplingParams(temperature=0.5, top_p=0.9, top_k=4),
        finish_reason="length",
    )


def test_rows_round_trip(tmp_path):
    rec = Recorder(tmp_path, max_file_bytes=1 << 20, max_files=4)
    rows = [row(i) for i in range(5)]
    assert all(rec.submit(r) for r in rows)
    rec.close()
    (path,) = tmp_path.glob(FILE_GLOB)
    assert read_rows(path) == rows
    first = rows[0]
    assert first["round_k"] == [3, 0] and first["round_accepted"] == [2, 0]
    assert first["round_source"] == ["drafter", "none"] and first["round_extended"] == [1, 0]
    assert first["drafter_version"] == "v1" and first["top_k"] == 4
    seqs = load_recordings(tmp_path, vocab_size=100)
    assert [s.prompt_ids for s in seqs] == [(1, 2, 3, i) for i in range(5)]
    assert seqs[0].output_ids == (10, 11, 12)


def test_files_rotate_and_the_oldest_go(tmp_path):
    one = line_bytes(row(0))
    rec = Recorder(tmp_path, max_file_bytes=2 * one + 10, max_files=2)
    for i in range(7):
        rec.submit(row(i))
    rec.close()
    files = sorted(tmp_path.glob(FILE_GLOB))
    assert len(files) == 2  # 4 files written (2 rows each), the oldest 2 deleted
    assert all(f.stat().st_size <= 2 * one + 10 for f in files)
    kept = [r["prompt_ids"][-1] for f in files for r in read_rows(f)]
    assert kept == [4, 5, 6]


def test_a_row_larger_than_a_file_is_dropped(tmp_path):
    before = dropped("too_large")
    rec = Recorder(tmp_path, max_file_bytes=line_bytes(row(1, n_out=1)) + 50, max_files=2)
    rec.submit(row(0, n_out=500))
    rec.submit(row(1, n_out=1))
    rec.close()
    assert dropped("too_large") == before + 1
    rows = [r for f in tmp_path.glob(FILE_GLOB) for r in read_rows(f)]
    assert [r["prompt_ids"][-1] for r in rows] == [1]


def test_a_failed_write_is_counted_and_the_next_row_goes_on(tmp_path):
    directory = tmp_path / "rec"
    before = dropped("write_error")
    rec = Recorder(directory, max_file_bytes=1 << 20, max_files=4)
    shutil.rmtree(directory)  # the disk goes away under it: opening a file fails
    rec.submit(row(0))
    rec.close(timeout=10)
    assert dropped("write_error") == before + 1
    directory.mkdir()
    rec = Recorder(directory, max_file_bytes=1 << 20, max_files=4)
    rec.submit(row(1))
    rec.close()
    rows = [r for f in directory.glob(FILE_GLOB) for r in read_rows(f)]
    assert [r["prompt_ids"][-1] for r in rows] == [1]


def test_a_cut_last_line_is_skipped(tmp_path):
    rec = Recorder(tmp_path, max_file_bytes=1 << 20, max_files=4)
    rec.submit(row(0))
    rec.close()
    (path,) = tmp_path.glob(FILE_GLOB)
    with path.open("a") as f:
        f.write('{"schema": "specdec.record/1", "prompt_')  # a gateway killed mid-write
    assert len(read_rows(path)) == 1


def test_a_directory_that_cannot_be_made_stops_start_up(tmp_path):
    from specdec.common.config import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="--record"):
        Recorder(blocker / "rec", max_file_bytes=100, max_files=1)
