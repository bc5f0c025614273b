"""The gateway's recorder: rows round-trip, files rotate and stay bounded, failures are
counted and never raised."""

from __future__ import annotations

import json
import shutil

import pytest
from prometheus_client import REGISTRY

from specdec.gateway.front.logprobs import LogprobsTrack, narrowed
from specdec.gateway.observe.recorder import FILE_GLOB, Recorder, recording_row
from specdec.gateway.outcome import DRAFTED, NO_DRAFT, Outcome
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


ROW_ARGS = {  # one row's arguments: a 3-token output
    "prompt_ids": [1, 2, 3],
    "history_tokens": 0,
    "output_ids": [10, 11, 12],
    "rounds": [outcome(3, 2, 0, DRAFTED)],
    "drafter_version": "v1",
    "target_model": "target",
    "sampling": common_pb2.SamplingParams(),
    "finish_reason": "length",
}


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
    from specdec.common.settings import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="--record"):
        Recorder(blocker / "rec", max_file_bytes=100, max_files=1)


def scores(n: int, m: int) -> common_pb2.TokenLogprobs:
    """Rows of n scored tokens with m alternatives each: token 10 + i, its alternatives
    10 + i, 50 + i, ... with log-probabilities -0.1 (i + 1), -1, -2, ..."""
    return common_pb2.TokenLogprobs(
        token_ids=[10 + i for i in range(n)],
        logprobs=[-0.1 * (i + 1) for i in range(n)],
        num_top=m,
        top_token_ids=[t for i in range(n) for t in [10 + i, *(50 * j + i for j in range(1, m))]],
        top_logprobs=[v for i in range(n) for v in [-0.1 * (i + 1), *(-j for j in range(1, m))]],
    )


def test_recorded_scores_round_trip_into_distills_sequences(tmp_path):
    rec = Recorder(tmp_path, max_file_bytes=1 << 20, max_files=4)
    r = recording_row(**{**ROW_ARGS, "scores": scores(3, 2)})
    assert r["target_logprobs"] == [-0.1, -0.2, -0.3]
    assert r["target_top_ids"] == [[10, 50], [11, 51], [12, 52]]
    assert r["target_top_logprobs"] == [[-0.1, -1.0], [-0.2, -1.0], [-0.3, -1.0]]
    plain = recording_row(**ROW_ARGS)
    assert "target_top_ids" not in plain  # off (--record-top-logprobs 0): not in the row
    assert rec.submit(r) and rec.submit(plain)
    rec.close()
    with_scores, without = load_recordings(tmp_path, vocab_size=100)
    assert with_scores.top_ids == ((10, 50), (11, 51), (12, 52))
    assert with_scores.top_logprobs[2] == pytest.approx((-0.3, -1.0))
    assert without.top_ids is None and without.top_logprobs is None


def test_scores_that_do_not_match_the_output_are_refused(tmp_path):
    with pytest.raises(ValueError, match="2 scored tokens for 3 outputs"):
        recording_row(**{**ROW_ARGS, "scores": scores(2, 2)})
    r = recording_row(**{**ROW_ARGS, "scores": scores(3, 2)})
    r["target_top_ids"] = r["target_top_ids"][:2]  # a row edited by hand
    (tmp_path / "record-x.jsonl").write_text(json.dumps(r) + "\n")
    with pytest.raises(ValueError, match=r"record-x\.jsonl: target_top_ids"):
        load_recordings(tmp_path, vocab_size=100)


def test_one_verify_serves_the_request_and_the_recording_each_its_own_width():
    """A recorded request asks each Verify for max(its top_logprobs, the recorder's M);
    the request's track keeps its own alternatives, the recording's its M."""
    wide = scores(3, 4)
    request, recording = LogprobsTrack(1), LogprobsTrack(4)
    request.add(wide)
    recording.add(wide)
    assert request.rows(0, 3) == narrowed(wide, 1)
    assert list(request.rows(0, 3).top_token_ids) == [10, 11, 12]
    assert recording.rows(0, 3) == wide
    assert narrowed(wide, 0).top_token_ids == [] and narrowed(wide, 0).logprobs == wide.logprobs
    assert narrowed(wide, 9) is wide
    with pytest.raises(ValueError, match="with 1 alternatives \\(4 asked\\)"):
        recording.add(narrowed(wide, 1))  # never fewer than asked
