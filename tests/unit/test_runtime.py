"""ModelRuntime in-process: KV cache per session, rollback, LRU eviction, cache misses."""

from __future__ import annotations

import inspect

import pytest
import torch

from specdec.common.errors import CacheMiss, CapacityExceeded, InvalidRequest
from specdec.common.prefix import prefix_hash
from specdec.drafter.config import DrafterConfig
from specdec.replica.engine import CachedSession, Engine, Prefix, SessionStore
from specdec.replica.runtime import ModelRuntime
from specdec.verifier.config import VerifierConfig


def p(tokens, n):
    return Prefix(n, prefix_hash(tokens[:n]))


@pytest.fixture(scope="module")
def runtime(test_models):
    rt = ModelRuntime(
        VerifierConfig(role="verifier", model=str(test_models.target), max_cached_tokens=100)
    )
    rt.load()
    yield rt
    rt.shutdown()


def full_logits(rt, tokens):
    with torch.inference_mode():
        return rt.model(input_ids=torch.tensor([tokens])).logits[0].float()


def test_rollback_then_continue_matches_fresh_forward(runtime):
    toks = list(range(20, 45))
    session, logits = runtime.extend("r", p(toks, 0), toks[:20], 20)
    torch.testing.assert_close(logits, full_logits(runtime, toks[:20]), atol=1e-4, rtol=1e-4)
    runtime.forward(session, [99, 98, 97])  # a draft that is then rejected
    runtime.store.truncate(session, 20)
    assert session.tokens == toks[:20]
    _, logits = runtime.extend("r", p(toks, 20), toks[20:], 5)
    torch.testing.assert_close(logits, full_logits(runtime, toks)[20:], atol=1e-4, rtol=1e-4)
    # Cropping to an earlier prefix through the request itself.
    _, logits = runtime.extend("r", p(toks, 10), toks[10:], 15)
    torch.testing.assert_close(logits, full_logits(runtime, toks)[10:], atol=1e-4, rtol=1e-4)


def test_cache_miss_cases(runtime):
    toks = list(range(5, 15))
    runtime.extend("m", p(toks, 0), toks, 10)
    with pytest.raises(CacheMiss, match="not cached"):
        runtime.extend("unknown", p(toks, 3), toks[3:], 7)
    with pytest.raises(CacheMiss, match="holds 10 tokens"):
        runtime.extend("m", p([*toks, 1, 2], 12), [3], 1)
    with pytest.raises(CacheMiss, match="different tokens"):
        runtime.extend("m", p([0, *toks[1:]], 10), [3], 1)
    # A miss leaves the session as it was.
    assert runtime.store.tokens("m") == toks


def test_lru_eviction_and_capacity(runtime):
    for sid in ("r", "m"):  # sessions of the earlier tests
        runtime.release(sid)
    assert len(runtime.store) == 0
    a, b, c = [1] * 40, [2] * 40, [3] * 40
    runtime.extend("e1", p(a, 0), a, 40)
    runtime.extend("e2", p(b, 0), b, 40)
    runtime.extend("e1", p(a, 40), [4], 1)  # e1 used last: e2 is now least recent
    runtime.extend("e3", p(c, 0), c, 40)
    assert "e2" not in runtime.store and "e1" in runtime.store and "e3" in runtime.store
    assert runtime.store.cached_tokens <= 100
    with pytest.raises(CapacityExceeded):
        runtime.extend("big", p([], 0), [1] * 101, 101)


def test_validation(runtime):
    with pytest.raises(InvalidRequest, match="empty"):
        runtime.validate_extent(Prefix(0, 0), [], 0)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        runtime.validate_extent(Prefix(0, 0), [runtime.vocab_size], 0)
    with pytest.raises(InvalidRequest, match="context"):
        runtime.validate_extent(Prefix(500, 0), [1] * 10, 3)


def test_failed_forward_drops_the_session(runtime):
    toks = list(range(30, 40))
    with runtime.guarded("g"):
        session, _ = runtime.extend("g", p(toks, 0), toks, 12)
    assert "g" in runtime.store
    with pytest.raises(IndexError), runtime.guarded("g"):
        runtime.forward(session, [runtime.vocab_size + 10])  # fails inside the model
    assert "g" not in runtime.store  # the next request misses and resends everything
    with pytest.raises(CacheMiss), runtime.guarded("g"):
        runtime.extend("g", p(toks, 10), [1], 1)


def test_refuses_models_whose_cache_cannot_roll_back(tmp_path, test_models):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=test_models.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=8,
    )
    MistralForCausalLM(config).save_pretrained(tmp_path / "swa")
    for f in test_models.tokenizer.iterdir():
        (tmp_path / "swa" / f.name).write_bytes(f.read_bytes())
    rt = ModelRuntime(DrafterConfig(role="drafter", model=str(tmp_path / "swa")))
    with pytest.raises(ValueError, match="sliding-window"):
        rt.load()
    rt.shutdown()


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def _same_operations(protocol, impl) -> None:
    """impl has every member of protocol, each method with the protocol's parameters."""
    assert isinstance(impl, protocol)
    for name, member in vars(protocol).items():
        if inspect.isfunction(member) and not name.startswith("_"):
            assert _parameters(member)[1:] == _parameters(getattr(impl, name)), name


def test_model_runtime_is_the_engine(runtime):
    """The one implementation of the engine's seam (specdec.replica.engine) has every
    operation the servicers use, with the protocol's parameters."""
    _same_operations(Engine, runtime)
    _same_operations(SessionStore, runtime.store)
    toks = list(range(3, 9))
    session = runtime.store.acquire("engine", 0, 0, len(toks))
    assert isinstance(session, CachedSession)
    runtime.release("engine")
