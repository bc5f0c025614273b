"""`specdec bench` end to end on tiny models: every mode is measured and reproduces the
target's greedy tokens, and the JSON, markdown and chart are written."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_bench_quick_on_tiny_models(tmp_path):
    """Two drafter variants (--drafters bf16,int8), each on its own stack: every row of
    each (the fixed k rows and the default settings' adaptive rows), and each variant's
    cost ratio beside its acceptance."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specdec", "bench", "--tiny", str(tmp_path / "models")]
    cmd += ["--quick", "--max-new-tokens", "12", "--k", "2,3", "--ssd-k", "2", "--out", str(out)]
    done = subprocess.run(
        [*cmd, "--drafters", "bf16,int8"], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    modes = result["modes"]
    shared = {"target", "k=0", "assisted", "draft"}
    bf16 = {"k=2", "k=3", "ssd k=2", "draft [bf16]", "adaptive k<=3", "ssd adaptive k<=2"}
    int8 = {"target [int8]", "k=2 [int8]", "k=3 [int8]", "ssd k=2 [int8]", "draft [int8]"}
    int8 |= {"adaptive k<=3 [int8]", "ssd adaptive k<=2 [int8]"}
    assert set(modes) == shared | bf16 | int8
    for name in ("k=2", "ssd k=2 [int8]", "adaptive k<=3", "ssd adaptive k<=2 [int8]"):
        policy = "adaptive" if "adaptive" in name else "fixed"
        assert modes[name]["k_policy"] == policy, name
        assert all(p["stats"]["k_policy"] == policy for p in modes[name]["per_prompt"]), name
    assert result["meta"]["prompt_kinds"] == ["code", "prose", "chat"]
    for name in ("draft", "draft [bf16]", "draft [int8]"):  # cost ratios, not contenders
        assert "exact" not in modes[name]
    for name, row in modes.items():
        assert row.get("exact", True), name
        assert row["tokens"] == 3 * 12, name  # tiny greedy models never emit EOS
        assert row["tokens_per_second"] > 0
    drafters = result["meta"]["drafters"]
    assert list(drafters) == ["bf16", "int8"]
    assert drafters["int8"]["flags"] == ["--quantize", "int8", "--dtype", "float32"]
    for variant, target in (("bf16", "target"), ("int8", "target [int8]")):
        d = drafters[variant]
        alone = modes[f"draft [{variant}]"]
        assert d["baseline"] == target == alone["baseline"]
        # c = the target's time per token / ... the drafter's, both measured in this run
        expected = modes[target]["tokens_per_second"] / alone["tokens_per_second"]
        assert d["cost_ratio"] == pytest.approx(expected, rel=1e-2) and d["cost_ratio"] > 0
        assert alone["cost_ratio"] == d["cost_ratio"]
    for name in ("k=2", "k=3", "ssd k=2", "k=2 [int8]", "k=3 [int8]", "ssd k=2 [int8]"):
        row = modes[name]
        variant = "int8" if "[int8]" in name else "bf16"
        assert row["drafter"] == variant
        assert row["baseline"] == ("target [int8]" if variant == "int8" else "target")
        assert row["cost_ratio"] == drafters[variant]["cost_ratio"]
        assert len(row["accepted_per_position"]) == row["k"]
        assert 0 < row["acceptance_rate"] <= 1
        mean = row["mean_accepted_length"]
        assert row["bound_speedup"] == pytest.approx(
            mean / (row["cost_ratio"] * row["k"] + 1), rel=1e-2
        )
        assert row["round_ms"] > 0 and row["drafter_wait_ms_per_round"] >= 0
    assert modes["target [int8]"]["speedup_vs_target"] == 1.0
    assert modes["k=2 [int8]"]["speedup_vs_k0"] is None  # k=0 ran on the first stack only
    ssd = modes["ssd k=2"]
    assert ssd["ssd"] and 0 < ssd["ssd_hit_rate"] <= 1 and 0 <= ssd["ssd_late_rate"] <= 1
    # Branches are counted from the Speculates answered before their verdict: none when
    # every one was late (tiny models verify faster than the drafter speculates).
    assert (ssd["ssd_branches_per_round"] > 0) == (ssd["ssd_late_rate"] < 1)
    assert ssd["ssd_hidden_ms_per_round"] > 0 and ssd["ssd_bytes_per_round"] > 0
    assert modes["target"]["speedup_vs_target"] == 1.0
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "results.md").read_text()
    assert "| k=2 |" in table and "| k=2 [int8] |" in table
    assert (
        f"| int8 | --quantize int8 --dtype float32 | {drafters['int8']['cost_ratio']:.3f} |"
        in table
    )


def test_bench_lookup_methods_on_the_grounded_set(tmp_path):
    """--prompt-set grounded --methods: a row per lookup method with and without SSD and
    transformers' prompt lookup, every one reproducing the target's tokens. The in-process
    rows run after the stack's here (--in-process-rows after: their models load once the
    stack has stopped), and are as exact."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specdec", "bench", "--tiny", str(tmp_path / "models")]
    cmd += ["--quick", "--max-new-tokens", "8", "--k", "2", "--ssd-k", "2", "--out", str(out)]
    cmd += ["--prompt-set", "grounded", "--methods", "ngram,suffix,hybrid"]
    cmd += ["--in-process-rows", "after"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "in-process rows, the stack stopped" in done.stdout
    result = json.loads((out / "results.json").read_text())
    assert result["meta"]["in_process_rows"] == "after"
    modes = result["modes"]
    lookup = {f"{s}{m} k=2" for m in ("ngram", "suffix", "hybrid") for s in ("", "ssd ")}
    anchors = {"prompt lookup", "prompt lookup, 2 CPUs"}
    assert lookup | anchors | {"target", "k=0", "k=2", "ssd k=2", "assisted"} <= set(modes)
    assert result["meta"]["prompt_kinds"] == ["edit", "refactor", "extract"]
    assert result["meta"]["methods"] == ["ngram", "suffix", "hybrid"]
    for name in lookup | anchors:
        assert modes[name]["exact"], name
        assert modes[name]["tokens"] == 3 * 8, name
    for name in lookup:
        assert modes[name]["method"] == name.split()[-2]
        assert "bound_speedup" not in modes[name]
    assert set(modes["ngram k=2"]["by_source"]) <= {"ngram"}
    assert "model" not in modes["suffix k=2"]["by_source"]
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([*cmd[:5], "--methods", "eagle"], check=True, capture_output=True)


def test_demo_on_tiny_models(tmp_path):
    """`specdec demo --tiny`: the stack streams every prompt and k=0, speculation and SSD
    agree token for token (float32: any difference fails the command), with the int8
    drafter it runs by default."""
    cmd = [sys.executable, "-m", "specdec", "demo", "--tiny", str(tmp_path / "models")]
    done = subprocess.run(
        [*cmd, "--max-new-tokens", "10"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The best drafter variant by default, and it says so.
    assert "drafter variant int8: --quantize int8 --dtype float32" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines()]
    table = {r[0]: r for r in rows if r and r[0] in ("code", "prose", "chat")}
    assert set(table) == {"code", "prose", "chat"}
    assert all(r[-1] == "yes" for r in table.values())


def test_bench_tracing_overhead_on_tiny_models(tmp_path):
    """`--tracing`: every stack mode also runs traced (sampled traceparent) on the same
    stack, interleaved; every traced request's trace reaches the receiver, no untraced one
    leaves a span there (bench checks both), and the overhead is reported."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specdec", "bench", "--tiny", str(tmp_path / "models")]
    cmd += ["--quick", "--max-new-tokens", "12", "--k", "2", "--ssd-k", "2", "--tracing"]
    cmd += ["--no-adaptive"]
    done = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    modes = result["modes"]
    assert {"k=0 traced", "k=2 traced", "ssd k=2 traced"} <= set(modes)
    for name in ("k=0", "k=2", "ssd k=2"):
        traced, plain = modes[f"{name} traced"], modes[name]
        assert traced["traced"] and not plain["traced"]
        assert traced["exact"] and traced["tokens"] == plain["tokens"]
        assert traced["untraced_seconds"] == plain["seconds"]
        expected = plain["tokens_per_second"] / traced["tokens_per_second"] - 1
        assert traced["tracing_slowdown"] == pytest.approx(expected, abs=1e-3)
    meta = result["meta"]["tracing"]
    assert meta["traced_requests"] == meta["untraced_requests"] == 3 * 3  # 3 prompts x 3 modes
    assert meta["spans_received"] > meta["traced_requests"] * 5  # rounds, calls, forwards
    assert "Tracing overhead" in (out / "results.md").read_text()


def test_overhead_on_standins(tmp_path):
    """`specdec bench --overhead`: every mode through the stack equals the in-process target
    alone, and each row's overhead is its time per round less the in-process one."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specdec", "bench", "--overhead", "--target-ms", "0.5"]
    cmd += ["--draft-ms", "0.2", "--max-new-tokens", "16", "--requests", "1"]
    cmd += ["--in-process-prompts", "2", "--concurrency", "1,2", "--k", "0,2", "--ssd-k", "2"]
    cmd += ["--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "overhead.json").read_text())
    assert set(result["modes"]) == {f"{m} c={c}" for m in ("k=0", "k=2", "ssd k=2") for c in (1, 2)}
    for name, row in result["modes"].items():
        assert row["exact"], name
        assert row["overhead_ms"] == pytest.approx(
            row["ms_per_round"] - row["in_process_ms_per_round"], abs=1e-3
        )
        # the drafter's k tokens and the verifier's own at most, as in-process (the
        # gateway's hybrid default would extend the drafts by lookups)
        assert 1 <= row["tokens_per_round"] <= row["k"] + 1, name
    assert {p["step_ms"] for p in result["projections"]} == {7.0, 25.0}
    assert "| k=0 | 1 |" in (out / "overhead.md").read_text()


def test_bench_structured_on_tiny_models(tmp_path):
    """`specdec bench --structured`: every constrained mode equals the target's constrained
    generate(), and acceptance and tokens/s are reported for each stack mode."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specdec", "bench", "--structured", "--tiny"]
    cmd += [str(tmp_path / "models"), "--num-prompts", "2", "--max-new-tokens", "12"]
    done = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"target json", "k=3", "k=3 json", "ssd k=3", "ssd k=3 json"}
    for name in ("k=3 json", "ssd k=3 json"):
        assert rows[name]["equals_target_json"] is True
    for name in ("k=3", "k=3 json", "ssd k=3", "ssd k=3 json"):
        assert rows[name]["tokens_per_second"] > 0 and rows[name]["acceptance_rate"] is not None
    assert "| k=3 json |" in (out / "results.md").read_text()


def test_bench_shapes_on_tiny_models(tmp_path):
    """`specdec bench --shapes`: every layout asked for is timed at every shape, each cell
    over its layout's own one-token step; an unknown layout is refused."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specdec", "bench", "--shapes", "--tiny", str(tmp_path / "m")]
    cmd += ["--shape-tokens", "1,4", "--shape-rows", "1,2", "--shape-prefix", "8"]
    cmd += ["--shape-repeats", "1", "--target-threads", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ms = json.loads((out / "results.json").read_text())["ms"]
    assert list(ms) == ["float32", "float32+packed", "bfloat16", "bfloat16+packed"]
    for cells in ms.values():
        assert set(cells) == {"1x1", "1x4", "2x1", "2x4"} and all(t > 0 for t in cells.values())
    table = (out / "results.md").read_text()
    assert "| float32+packed |" in table and " (1.00) |" in table
    bad = [sys.executable, "-m", "specdec", "bench", "--shapes", "--tiny", str(tmp_path / "m")]
    refused = subprocess.run([*bad, "--shape-variants", "int4"], capture_output=True, text=True)
    assert refused.returncode == 2 and "unknown ['int4']" in refused.stderr
