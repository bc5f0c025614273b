"""`specdec loadtest` pieces that need no server: workload parsing, metrics, report."""

from __future__ import annotations

import json

import pytest

from specdec.sdk.loadtest.report import tables, write_json, write_png
from specdec.sdk.loadtest.runner import Cell, RequestRecord
from specdec.sdk.loadtest.summary import percentile, summarize
from specdec.sdk.loadtest.workload import (
    Level,
    Mode,
    load_conversations,
    parse_levels,
    parse_modes,
)


def test_modes():
    modes = parse_modes("k0,k2,ssd2,default")
    assert [(m.name, m.k, m.ssd) for m in modes] == [
        ("k0", 0, False),
        ("k2", 2, False),
        ("ssd2", 2, True),
        ("default", None, None),
    ]
    with pytest.raises(ValueError, match=r"'adaptive'.*not built yet"):
        parse_modes("k0,adaptive")
    with pytest.raises(ValueError, match="unknown mode 'k-1'"):
        parse_modes("k-1")
    with pytest.raises(ValueError, match="at least 1"):
        parse_modes("ssd0")
    with pytest.raises(ValueError, match="twice"):
        parse_modes("k2,k2")


def test_levels():
    assert [lv.label for lv in parse_levels("1,2,8", None)] == ["c=1", "c=2", "c=8"]
    rates = parse_levels(None, "0.5,2", max_concurrency=4)
    assert [(lv.rate, lv.max_concurrency, lv.label) for lv in rates] == [
        (0.5, 4, "rate=0.5/s"),
        (2.0, 4, "rate=2/s"),
    ]
    for bad in ("0", "x", "-2"):
        with pytest.raises(ValueError, match="not a positive number"):
            parse_levels(bad, None)
    with pytest.raises(ValueError, match="given twice"):
        parse_levels("1,8,1", None)
    with pytest.raises(ValueError, match="one of --concurrency or --rate"):
        parse_levels("1", "2")


def test_shipped_prompts_and_conversation_files(tmp_path):
    shipped = load_conversations()
    assert len(shipped) == 12
    assert {c.kind for c in shipped} == {"code", "prose", "chat"}
    assert all(len(c.turns) == 1 for c in shipped)
    assert len(load_conversations(limit=3)) == 3

    path = tmp_path / "convs.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(row)
            for row in (
                {"prompt": "def f():"},
                {"kind": "chat", "turns": ["Hello", "And then?"]},
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "one"},
                        {"role": "assistant", "content": "ignored"},
                        {"role": "user", "content": "two"},
                    ]
                },
            )
        )
        + "\n"
    )
    convs = load_conversations(str(path))
    assert [c.turns for c in convs] == [("def f():",), ("Hello", "And then?"), ("one", "two")]
    assert [c.index for c in convs] == [0, 1, 2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "turns": ["b"]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: give exactly one of"):
        load_conversations(str(bad))
    bad.write_text('{"turns": []}\n')
    with pytest.raises(ValueError, match="non-empty"):
        load_conversations(str(bad))


def test_percentile_matches_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([], 50) == 0.0


def _record(i: int, ok: bool = True, **kw) -> RequestRecord:
    r = RequestRecord("c=2", "k2", conversation=i, turn=0, ok=ok)
    for key, value in kw.items():
        setattr(r, key, value)
    return r


def _cell() -> Cell:
    cell = Cell(Level(concurrency=2), Mode("k2", k=2, ssd=False), duration_s=2.0)
    cell.records = [
        _record(0, ttft_s=0.1, e2el_s=0.5, itl_s=[0.2, 0.2], prompt_tokens=5, output_tokens=5,
                tokens=(1, 2, 3, 4, 5), rounds=2, draft_tokens=4, accepted_tokens=3),
        _record(1, ttft_s=0.3, e2el_s=0.3, prompt_tokens=7, output_tokens=1, tokens=(9,),
                rounds=1, draft_tokens=2, accepted_tokens=0),
        _record(2, ok=False, error="RESOURCE_EXHAUSTED", details="replica busy"),
        _record(3, ok=False, error="RESOURCE_EXHAUSTED", details="replica busy"),
        _record(4, ok=False, error="UNAVAILABLE", details="gone"),
    ]  # fmt: skip
    return cell


def test_summary_uses_vllm_names_and_counts_what_happened():
    result = summarize(_cell(), references={(0, 0): (1, 2, 3, 4, 5), (1, 0): (9, 9)})
    assert result["completed"] == 2 and result["failed"] == 3
    assert result["errors"] == {"RESOURCE_EXHAUSTED": 2, "UNAVAILABLE": 1}
    assert result["request_throughput"] == 1.0  # 2 requests in 2 s
    assert result["output_throughput"] == 3.0  # 6 tokens in 2 s
    assert result["total_token_throughput"] == 9.0
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_e2el_ms"] == pytest.approx(400.0)
    assert result["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4, one request
    assert result["p99_itl_ms"] == pytest.approx(200.0)
    assert result["acceptance_rate"] == pytest.approx(0.5)  # 3 of 6 draft tokens
    assert result["tokens_per_round"] == pytest.approx(2.0)  # (3 + 3) / 3
    assert result["exact_checked"] == 2 and result["exact_mismatches"] == 1
    assert result["exact_mismatch_examples"] == [
        {"conversation": 1, "turn": 0, "first_difference": 1}
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert f"{stat}_{name}_ms" in result
    assert "exact_checked" not in summarize(_cell())


def test_report_table_json_and_png(tmp_path):
    results = [summarize(_cell(), references={(0, 0): (1, 2, 3, 4, 5)})]
    text = tables(results)
    assert (
        "| c=2 | k2 | 2 | 3 | 1.00 | 3.0 | 0.50 | 2.00 | - | RESOURCE_EXHAUSTED 2, UNAVAILABLE 1 | 0/1 |"
        in text
    )
    assert "| c=2 | k2 | TTFT | 200.0 | 200.0 |" in text
    path = write_json(tmp_path, {"results": results})
    assert json.loads(path.read_text())["results"][0]["failed"] == 3
    png = write_png(tmp_path, results, by_rate=False)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--modes", "k0,adaptive"],
            "mode 'adaptive' (speculation that adapts its draft length) is not built yet",
        ),
        (["--modes", "k2", "--k", "2"], "give --modes or --k/--ssd, not both"),
        (["--api", "openai"], "--api 'openai' is not built (have: grpc)"),
        (["--check-exact", "--temperature", "0.7"], "--check-exact needs greedy decoding"),
        (["--concurrency", "0"], "--concurrency: '0' is not a positive number"),
    ],
)
def test_cli_refuses_what_it_cannot_do(argv, message, capsys):
    """Refused before anything is sent (no gateway listens at this address)."""
    from specdec.cli import main

    assert main(["loadtest", "--gateway", "127.0.0.1:9", *argv]) == 2
    assert message in capsys.readouterr().err
