"""Where the bench's in-process anchors run under --pin (no models loaded), the drafter
variants --drafters names, and the report's lines on the fastest target and on a head's
features."""

import pytest

from specdec.tools.bench.hf import HFRunner
from specdec.tools.bench.modes import DRAFTERS, build_modes, parse_drafters


def runner(pinned):
    hf = HFRunner.__new__(HFRunner)  # placement needs no model
    hf.pinned, hf.default_threads = pinned, 7
    return hf


def test_every_target_alone_gets_the_verifiers_cpu_and_one_thread():
    """A later drafter variant's baseline ('target [int8]') is the target alone as much as
    the first variant's 'target': both get the verifier's CPU and one thread. (It used to
    fall through to assisted generation's two CPUs and two threads, which made a later
    variant's target twice as fast as the first's and its speed-ups half what they were.)"""
    hf = runner((0, 1))
    modes = [
        m
        for i, d in enumerate(["bf16", "int8", "vocab32k"])
        for m in build_modes([2], [2], drafter=d, shared=i == 0)
        if m.engine == "hf"
    ]
    placed = {m.name: hf._placement(m) for m in modes}
    assert placed == {
        "target": ({1}, 1),
        "target [int8]": ({1}, 1),
        "target [vocab32k]": ({1}, 1),
        "draft": ({0}, 1),
        "assisted": ({0, 1}, 2),
    }


def test_prompt_lookup_runs_where_the_target_alone_runs_and_its_twin_on_both_cpus():
    """transformers' prompt lookup uses the target alone: the verifier's CPU, as a lookup
    method in the stack has; its '2 CPUs' twin has assisted generation's placement."""
    hf = runner((0, 1))
    placed = {
        m.name: hf._placement(m)
        for m in build_modes([3], [3], methods=("ngram",))
        if m.name.startswith("prompt lookup")
    }
    assert placed == {"prompt lookup": ({1}, 1), "prompt lookup, 2 CPUs": ({0, 1}, 2)}


def test_drafter_variants_known_and_from_a_directory():
    got = parse_drafters("bf16, int8,distilled=/m/d ,distilled-int8=/m/d:int8")
    assert list(got) == ["bf16", "int8", "distilled", "distilled-int8"]
    assert got["int8"] == DRAFTERS["int8"]
    assert got["distilled"] == ("--model", "/m/d")
    assert got["distilled-int8"] == (*DRAFTERS["int8"], "--model", "/m/d")
    assert parse_drafters("x=/a:b")["x"] == ("--model", "/a:b")  # ':b' is no variant
    for bad, why in [
        ("eagle", "unknown variant 'eagle'"),
        ("bf16,bf16", "twice"),
        ("=/m/d", "names no variant"),
        (" , ", "no variant named"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_drafters(bad)


def test_unpinned_runs_everything_with_the_default_threads():
    hf = runner(None)
    for m in build_modes([2], [2], drafter="int8", shared=False):
        if m.engine == "hf":
            assert hf._placement(m) == (None, 7)


def test_the_target_alone_in_its_fastest_step_layout():
    """When the calibration timed another layout's one-token step faster than the stack's
    (a verifier prices several-token forwards too), the shared run also measures the
    target alone in it, on the verifier's CPU, and every row is compared with the faster
    target alone; the report says so."""
    from specdec.replica.calibrate import DtypeChoice
    from specdec.tools.bench.cli import fastest_step
    from specdec.tools.bench.modes import ModeRun, Sample
    from specdec.tools.bench.report import fastest_target, markdown
    from specdec.tools.bench.stats import summarize

    timings = {
        "float32": {1: 600.0, 8: 1800.0},
        "float32+packed": {1: 650.0, 8: 800.0},
        "bfloat16+packed": {1: 400.0, 8: 2000.0},
    }
    chosen = DtypeChoice("float32", "r", timings, packed=True)
    assert fastest_step(chosen) == "bfloat16+packed"
    assert fastest_step(DtypeChoice("bfloat16", "r", timings | {"bfloat16": {1: 1, 8: 9}})) is None
    assert fastest_step(DtypeChoice("float32", "as asked")) is None  # nothing measured

    modes = build_modes([3], [], shared=True, step_layout="bfloat16+packed", adaptive=False)
    step = next(m for m in modes if m.name == "target, fastest step [bfloat16+packed]")
    assert not step.contender and step.baseline == step.name and step.engine == "hf"
    assert runner((0, 1))._placement(step) == ({1}, 1)
    assert not any("fastest step" in m.name for m in build_modes([3], [], shared=False))

    stats = {
        "rounds": 4,
        "draft_tokens": 12,
        "accepted_tokens": 6,
        "accepted_per_position": [3, 2, 1],
        "cache_misses": 0,
        "drafter_wait_ms": 0.0,
    }

    def run(mode, seconds):
        r = ModeRun(mode)
        r.samples = [Sample([1] * 10, seconds, 1.0, dict(stats))]
        return r

    by_name = {m.name: m for m in modes}
    runs = {
        "target": run(by_name["target"], 10.0),  # 1 tok/s
        step.name: run(step, 5.0),  # 2 tok/s
        "k=0": run(by_name["k=0"], 10.0),
        "k=3": run(by_name["k=3"], 4.0),  # 2.5 tok/s
    }
    rows = summarize(runs, None)
    assert rows["k=3"]["speedup_vs_target"] == 2.5
    assert rows["k=3"]["speedup_vs_fastest_target"] == 1.25
    text = fastest_target(rows)
    assert "2.00x the target alone in the stack's layout" in text
    assert "the fastest stack row (k=3) is 1.25x" in text
    assert "features per round" not in markdown(rows, None)
    # A head drafter's rows: the target's features they moved, per round.
    runs["k=3"].samples[0].stats["feature_bytes"] = 4 * 3072
    rows = summarize(runs, None)
    assert rows["k=3"]["feature_bytes_per_round"] == 3072
    assert "verifier to head drafter): k=3 3.0 KiB." in markdown(rows, None)
