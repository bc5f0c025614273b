"""Long inputs on the model runtime (issue 11, item 1): only the logits rows that are used
are computed, and a long input is fed in --prefill-chunk pieces with the same result."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.common.prefix import prefix_hash
from specdec.replica.engine import Prefix
from specdec.replica.runtime import ModelRuntime
from specdec.verifier.config import VerifierConfig


def load(test_models, chunk: int) -> ModelRuntime:
    rt = ModelRuntime(
        VerifierConfig(
            role="verifier",
            model=str(test_models.target),
            max_cached_tokens=4096,
            prefill_chunk=chunk,
            engine="dense",  # Calls instruments its one-session forward (model.forward)
        )
    )
    rt.load()
    return rt


@pytest.fixture(scope="module")
def runtimes(test_models):
    whole, chunked = load(test_models, 0), load(test_models, 16)
    yield whole, chunked
    whole.shutdown()
    chunked.shutdown()


class Calls:
    """What the runtime asked of the model: tokens per forward and logits rows kept."""

    def __init__(self, rt: ModelRuntime, monkeypatch):
        self.tokens: list[int] = []
        self.kept: list[int] = []
        real = rt.model.forward

        def forward(*args, **kwargs):
            self.tokens.append(kwargs["input_ids"].shape[1])
            out = real(*args, **kwargs)
            self.kept.append(out.logits.shape[1])
            return out

        monkeypatch.setattr(rt.model, "forward", forward)


def test_only_the_used_rows_are_computed(runtimes, monkeypatch):
    whole, _ = runtimes
    toks = random.Random(1).choices(range(whole.vocab_size), k=120)
    calls = Calls(whole, monkeypatch)
    _, logits = whole.extend("rows", Prefix(0, 0), toks, len(toks), keep=3)
    assert logits.shape == (3, whole.vocab_size)
    assert calls.tokens == [120] and calls.kept == [3]  # not [120, vocab]
    with torch.inference_mode():
        full = whole.model(input_ids=torch.tensor([toks])).logits[0].float()
    torch.testing.assert_close(logits, full[-3:], rtol=1e-5, atol=1e-5)
    whole.release("rows")


def test_chunked_prefill_matches_one_forward(runtimes, monkeypatch):
    whole, chunked = runtimes
    toks = random.Random(2).choices(range(whole.vocab_size), k=100)
    _, expected = whole.extend("c", Prefix(0, 0), toks, 110, keep=5)
    calls = Calls(chunked, monkeypatch)
    session, got = chunked.extend("c", Prefix(0, 0), toks, 110, keep=5)
    assert max(calls.tokens) <= 16 and sum(calls.tokens) == 100  # never one big forward
    assert calls.kept[:-1] == [1] * (len(calls.kept) - 1) and calls.kept[-1] == 5
    assert session.tokens == toks
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # The cache is the same too: the next step after it gives the same logits.
    _, a = whole.extend("c", Prefix(100, prefix_hash(toks)), [7, 8], 2, keep=2)
    _, b = chunked.extend("c", Prefix(100, prefix_hash(toks)), [7, 8], 2, keep=2)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # keep larger than a chunk: the last forward holds every kept row.
    calls.tokens.clear(), calls.kept.clear()
    _, rows = chunked.extend("d", Prefix(0, 0), toks, 100, keep=20)
    assert rows.shape[0] == 20 and calls.kept[-1] == 20 and calls.tokens[-1] == 20
