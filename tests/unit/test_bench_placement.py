"""Where the bench's in-process anchors run under --pin (no models loaded), and the
drafter variants --drafters names."""

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
