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
    with_trees,
)


def test_modes():
    modes = parse_modes("k0,k2,ssd2,adaptive,adaptive2,default")
    assert [(m.name, m.k, m.ssd, m.k_policy) for m in modes] == [
        ("k0", 0, False, "fixed"),
        ("k2", 2, False, "fixed"),
        ("ssd2", 2, True, "fixed"),
        ("adaptive", 4, True, "adaptive"),  # the upper bound: 4 unless named
        ("adaptive2", 2, True, "adaptive"),
        ("default", None, None, None),
    ]
    with pytest.raises(ValueError, match="upper bound of at least 1"):
        parse_modes("adaptive0")
    with pytest.raises(ValueError, match="unknown mode 'k-1'"):
        parse_modes("k-1")
    with pytest.raises(ValueError, match="at least 1"):
        parse_modes("ssd0")
    with pytest.raises(ValueError, match="twice"):
        parse_modes("k2,k2")


def test_a_mode_names_its_method():
    modes = parse_modes("k3@ngram,ssd2@hybrid,adaptive@suffix,default@model,k3")
    assert [(m.name, m.k, m.ssd, m.method) for m in modes] == [
        ("k3@ngram", 3, False, "ngram"),
        ("ssd2@hybrid", 2, True, "hybrid"),
        ("adaptive@suffix", 4, True, "suffix"),
        ("default@model", None, None, "model"),
        ("k3", 3, False, None),  # the gateway's --method
    ]
    assert modes[0].to_dict()["method"] == "ngram"
    with pytest.raises(ValueError, match="unknown method 'lookup'; known: model, ngram"):
        parse_modes("k3@lookup")
    with pytest.raises(ValueError, match="k0 runs no speculation"):
        parse_modes("k0@ngram")
    with pytest.raises(ValueError, match="unknown mode 'x@ngram'"):
        parse_modes("x@ngram")
    with pytest.raises(ValueError, match="twice"):
        parse_modes("k3@ngram,k3@ngram")


def test_tree_twins_follow_their_chains():
    modes = with_trees(parse_modes("k0,k3@ngram,default"), 3)
    assert [(m.name, m.tree_width) for m in modes] == [
        ("k0", None),
        ("k3@ngram", None),
        ("k3@ngram tree3", 3),
        ("default", None),
        ("default tree3", 3),
    ]
    assert modes[2].method == "ngram" and modes[2].k == 3
    assert with_trees(modes[:1], 1) == modes[:1]
    with pytest.raises(ValueError, match=r"--tree-width must be in \[1, 8\], got 9"):
        with_trees(modes, 9)


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
        "| c=2 | k2 | 2 | 3 | 1.00 | 3.0 | 0.0 | 0.50 | 2.00 | - | RESOURCE_EXHAUSTED 2, UNAVAILABLE 1 | 0/1 |"
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
            ["--modes", "k0,adaptive0"],
            "mode 'adaptive0': adaptive needs an upper bound of at least 1",
        ),
        (["--modes", "k2", "--k", "2"], "give --modes or --k/--ssd, not both"),
        (["--api", "rest"], "--api 'rest' is not built (have: grpc, openai)"),
        (["--check-exact", "--temperature", "0.7"], "--check-exact needs greedy decoding"),
        (["--output-len-range", "1"], "--output-len-range must be at least 0 and below 1"),
        (["--concurrency", "0"], "--concurrency: '0' is not a positive number"),
        (
            ["--concurrency", "8,32", "--modes", "k0,k2", "--num-requests", "32"],
            "concurrency 32 with --num-requests 32 over 2 slices: a slice of 16 requests "
            "never has 32 in flight; give --num-requests of at least 64 (or fewer --slices)",
        ),
    ],
)
def test_cli_refuses_what_it_cannot_do(argv, message, capsys):
    """Refused before anything is sent (no gateway listens at this address)."""
    from specdec.cli import main

    assert main(["loadtest", "--gateway", "127.0.0.1:9", *argv]) == 2
    assert message in capsys.readouterr().err


class FakeBackend:
    """Stands in for the gateway: streams two chunks per request after a short await and
    records what it was asked, so the scheduler can be checked without a server."""

    name = "fake"

    def __init__(self, fail_every: int = 0):
        self.calls: list[tuple[str, str, str | None, bool]] = []
        self.lengths: list[tuple[str, str, int]] = []  # (text, mode, max_new_tokens)
        self.in_flight = 0
        self.most_in_flight = 0
        self.fail_every = fail_every

    async def _stream(self, text, mode, session_id, first_turn):
        import asyncio

        from specdec.sdk import ResourceExhausted
        from specdec.sdk.types import Generation, SpeculationStats, StreamChunk, Timings, Usage

        self.calls.append((text, mode.name, session_id, first_turn))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.001)
            if self.fail_every and len(self.calls) % self.fail_every == 0:
                raise ResourceExhausted("replica busy: 3 requests queued for the model")
            yield StreamChunk("a", (1,))
            await asyncio.sleep(0.001)
            final = Generation(
                "ab",
                (1, 2),
                "length",
                Usage(prompt_tokens=3, completion_tokens=2),
                Timings(),
                SpeculationStats(rounds=1, draft_tokens=2, accepted_tokens=1),
            )
            yield StreamChunk("b", (2,), final=final)
        finally:
            self.in_flight -= 1

    def stream(self, text, mode, settings, seed, session_id, first_turn):
        self.lengths.append((text, mode.name, settings.max_new_tokens))
        return self._stream(text, mode, session_id, first_turn)

    async def close(self):
        pass


def _run(backend, conversations, modes, levels, **kw):
    import asyncio

    from specdec.sdk.loadtest.runner import LoadTest
    from specdec.sdk.loadtest.workload import RequestSettings

    test = LoadTest(backend, conversations, modes, levels, RequestSettings(), **kw)
    return test, asyncio.run(test.run())


def test_scheduler_keeps_concurrency_and_budget_and_replays_sessions():
    from specdec.sdk.loadtest.workload import Conversation

    convs = [Conversation(0, "code", ("p0",)), Conversation(1, "chat", ("t1", "t2", "t3"))]
    backend = FakeBackend()
    _, cells = _run(
        backend,
        convs,
        parse_modes("k0,k2"),
        parse_levels("1,3", None),
        num_requests=10,
        duration=None,
        slices=2,
    )
    assert backend.most_in_flight == 3
    assert [len(c.records) for c in cells] == [10, 10, 10, 10]
    assert all(
        r.ok and r.output_tokens == 2 and len(r.itl_s) == 1 for c in cells for r in c.records
    )
    # Slice 1 of every level and mode before slice 2; mode order rotates per slice.
    modes_in_order = [mode for _, mode, _, _ in backend.calls]
    assert modes_in_order[:5] == ["k0"] * 5 and modes_in_order[5:10] == ["k2"] * 5
    # A conversation's turns go in order in one session, the first one resetting it.
    one_user = [(t, s, f) for t, m, s, f in backend.calls[:5]]
    assert one_user[0] == ("p0", None, True)
    assert [t for t, _, _ in one_user[1:4]] == ["t1", "t2", "t3"]
    assert one_user[1][1] == one_user[3][1] and one_user[1][1].startswith("loadtest-")
    assert [f for _, _, f in one_user[1:4]] == [True, False, False]


def test_failed_turn_ends_its_conversation_and_is_counted():
    from specdec.sdk.loadtest.summary import summarize
    from specdec.sdk.loadtest.workload import Conversation

    backend = FakeBackend(fail_every=2)
    _, (cell,) = _run(
        backend,
        [Conversation(0, "chat", ("t1", "t2", "t3"))],
        parse_modes("k2"),
        parse_levels("1", None),
        num_requests=6,
        duration=None,
    )
    result = summarize(cell)
    assert result["completed"] + result["failed"] == 6
    assert result["errors"] == {"RESOURCE_EXHAUSTED": 3}
    # Every failure (the second call of each conversation) started a new conversation.
    assert [r.turn for r in cell.records] == [0, 1, 0, 1, 0, 1]


def test_poisson_levels_start_every_request_of_the_budget():
    from specdec.sdk.loadtest.workload import Conversation

    backend = FakeBackend()
    _, (cell,) = _run(
        backend,
        [Conversation(0, "code", ("p",))],
        parse_modes("k0"),
        parse_levels(None, "2000", max_concurrency=2),
        num_requests=12,
        duration=None,
        seed=3,
    )
    assert len(cell.records) == 12 and all(r.ok for r in cell.records)
    assert backend.most_in_flight <= 2


def test_a_test_repeats_prompts_over_cells_or_within_one():
    from specdec.sdk.loadtest.cli import repeats_prompts

    assert repeats_prompts(12, 16, 1, None)  # 16 requests cycle through 12 prompts
    assert repeats_prompts(12, 4, 2, None)  # a second cell starts from the first prompt
    assert repeats_prompts(12, None, 1, 60.0)  # a duration sends as many as it can
    assert not repeats_prompts(12, 12, 1, None)


def test_steady_throughput_counts_only_while_every_user_has_a_request_in_flight():
    """Two users: one request of 10 s; beside it two short ones back to back, then nothing
    (the drain). Full from 0 to 6 s, where 12 of the 16 tokens arrived."""
    from specdec.sdk.loadtest.runner import RequestRecord
    from specdec.sdk.loadtest.summary import steady

    def record(sent, ended, chunks):
        r = RequestRecord("c=2", "k0", 0, 0, ok=True, sent_s=sent, ended_s=ended)
        r.chunks = chunks
        return r

    long = record(0.0, 10.0, [(float(t), 1) for t in range(1, 11)])
    first = record(0.0, 4.0, [(2.0, 2), (4.0, 2)])  # its last chunk as it ends: counted
    second = record(4.0, 6.0, [(5.0, 1), (6.0, 1)])
    rate, seconds = steady([long, first, second], 2)
    assert seconds == 6.0 and rate == 12 / 6.0
    assert steady([long], 2) == (0.0, 0.0)  # never two in flight
    assert steady([long], 1) == (1.0, 10.0)


def test_an_output_len_range_gives_each_prompt_its_own_length_at_every_level_and_mode():
    """--output-len-range: each prompt's turn asks for its own max_new_tokens within the
    range, drawn from the prompt and turn alone: the same at every level and in every mode
    (and in its reference), different between prompts, so that a closed loop's users end
    their requests apart."""
    import asyncio

    from specdec.sdk.loadtest.runner import LoadTest
    from specdec.sdk.loadtest.workload import Conversation, RequestSettings

    convs = [Conversation(i, "code", (f"p{i}",)) for i in range(8)]
    convs.append(Conversation(8, "chat", ("t1", "t2")))
    settings = RequestSettings(max_new_tokens=32, output_len_range=0.5)
    backend = FakeBackend()
    test = LoadTest(
        backend, convs, parse_modes("k0,k2"), parse_levels("1,3", None), settings, 27, None
    )
    asyncio.run(test.run())
    lengths: dict[str, set[int]] = {}
    for text, _, n in backend.lengths:
        lengths.setdefault(text, set()).add(n)
    assert len(lengths) == 10
    assert all(len(ns) == 1 for ns in lengths.values()), lengths  # one length per turn
    drawn = [n for (n,) in lengths.values()]
    assert all(16 <= n <= 48 for n in drawn) and len(set(drawn)) >= 5, drawn
    assert settings.for_turn(convs[8], 1).max_new_tokens == next(iter(lengths["t2"]))
    assert RequestSettings(max_new_tokens=32).for_turn(convs[3], 0).max_new_tokens == 32
