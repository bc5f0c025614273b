"""The bench report's peer table and machine header (tools/specdec/tools/bench/report.py) from results
shaped as `specdec bench --peers` writes them."""

from __future__ import annotations

from specdec.tools.bench.report import machine_header, peers_table

ROWS = {
    "target": {"tokens_per_second": 2.0, "contender": True, "engine": "hf"},
    "k=3": {"tokens_per_second": 3.0, "contender": True, "engine": "stack"},
    "hybrid adaptive k<=3": {"tokens_per_second": 5.0, "contender": True, "engine": "stack"},
    "draft": {"tokens_per_second": 9.0, "contender": False, "engine": "hf"},
}


def test_peer_rows_against_their_own_target_and_ours():
    peers = {
        "threads": 2,
        "by_peer": {
            "vllm": {
                "modes": {
                    "target": {"tokens_per_second": 2.5},
                    "ngram k=3": {"tokens_per_second": 3.75, "acceptance": 0.4},
                    "draft k=3": {"error": "boom\nmore"},
                }
            },
            "llamacpp": {"skipped": "not installed: run make peer-bench-install"},
        },
    }
    text = peers_table(peers, ROWS)
    assert "hybrid adaptive k<=3 at 5.00 tok/s" in text
    assert "| vllm target | 2.50 | 1.00x | 1.25x | 2.00x |  |" in text
    assert "| vllm ngram k=3 | 3.75 | 1.50x | 1.88x | 1.33x | 40% |" in text
    assert "- vllm draft k=3: boom" in text
    assert "- llamacpp: not installed" in text
    assert peers_table(None, ROWS) == ""


def test_machine_header_names_the_cpu_and_the_curves():
    meta = {
        "dtype": "float32",
        "machine": {"describe": "CPU: Xeon (avx2 avx512f); no avx512_bf16/amx on this CPU"},
        "cost_curves": {
            "int8": {
                "verifier": {"dtype": "float32", "base_ms": 300.0, "per_token_ms": 100.0},
                "drafter-old": {"dtype": "float32", "base_ms": 50.0, "per_token_ms": 5.0},
                "drafter": {"dtype": "float32", "base_ms": None, "per_token_ms": None},
            }
        },
    }
    text = machine_header(meta)
    assert "Machine: CPU: Xeon" in text and "dtype float32" in text
    assert (
        "verifier (float32): t(n) = 300.0 + 100.00·n ms (2 tokens: 1.25 steps, 4 tokens: 1.75"
        in text
    )
    # A step off the line (a one-token forward on another path), and a run recorded before
    # steps were (no step_ms): on the line.
    meta["cost_curves"]["int8"]["verifier"]["step_ms"] = 250.0
    text = machine_header(meta)
    assert "t(n) = 300.0 + 100.00·n ms for n >= 2, t(1) = 250.0 ms (2 tokens: 2.00 steps" in text
    assert "drafter-old (float32): t(n) = 50.0 + 5.00·n ms (2 tokens: 1.09 steps" in text
    assert "drafter (" not in text
    assert machine_header({}) == ""
