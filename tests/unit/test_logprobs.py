"""The verifier's scores (specdec.replica.logprobs) and the KV fork of n > 1, in-process on
the fp32 tiny target: every score equals log_softmax of transformers' own logits at its
position, for greedy and sampled verdicts, with the prompt's (echo) and without."""

from __future__ import annotations

import pytest
import torch

from specdec.common.errors import CacheMiss
from specdec.common.params import SamplingParams
from specdec.common.prefix import prefix_hash
from specdec.replica.engine import Prefix
from specdec.replica.logprobs import LogprobsAsk, emitted_tokens, token_logprobs
from specdec.replica.runtime import ModelRuntime
from specdec.verifier.config import VerifierConfig
from specdec.verifier.scorer import VerifyCall, verify

PROMPT = [3, 17, 42, 8, 99, 23, 61]
DRAFT = [5, 11, 7, 30]


@pytest.fixture(scope="module")
def runtime(test_models):
    rt = ModelRuntime(
        VerifierConfig(role="verifier", model=str(test_models.target), max_cached_tokens=400)
    )
    rt.load()
    rt.shutdown()  # driven here
    yield rt


def reference(target_model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits over tokens, by transformers alone [n, vocab]."""
    with torch.inference_mode():
        logits = target_model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_token_logprobs_and_emitted_tokens():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    rows = token_logprobs(logits, torch.tensor([0, 0]), 2)
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(rows.chosen, lp[:, 0])
    assert rows.top_ids.tolist() == [[2, 1], [0, 1]] or rows.top_ids.tolist() == [[2, 1], [0, 2]]
    torch.testing.assert_close(rows.top_values, lp.sort(-1, descending=True).values[:, :2])
    assert token_logprobs(logits, torch.tensor([1, 1]), 0).top_ids.shape == (2, 0)
    drafts = torch.tensor([4, 5, 6])
    out = emitted_tokens(drafts, torch.tensor([1]), torch.tensor([9]))
    assert out.tolist()[:2] == [4, 9]
    assert emitted_tokens(drafts, torch.tensor([3]), torch.tensor([9])).tolist() == [4, 5, 6, 9]
    with pytest.raises(ValueError, match="top_logprobs"):
        LogprobsAsk(top=21)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=3)],
    ids=["greedy", "sampled"],
)
@pytest.mark.parametrize("k", [0, 4])
def test_verify_scores_equal_log_softmax(runtime, target_model, params, k):
    draft = DRAFT[:k]
    probs = None
    if not params.greedy:  # a uniform proposal over the vocabulary
        probs = torch.full((k, runtime.vocab_size), 1.0 / runtime.vocab_size)
    session = f"lp/{k}/{params.greedy}"
    job = verify(
        VerifyCall(
            runtime,
            session,
            Prefix(0, 0),
            PROMPT,
            draft,
            probs,
            params,
            logprobs=LogprobsAsk(top=5, prompt=True),
        )
    )
    verdict = runtime.drive(job)
    emitted = [*draft[: verdict.accepted], verdict.next_token]
    ref = reference(target_model, [*PROMPT, *emitted])
    at = len(PROMPT) - 1  # the row that scores the first emitted token
    rows = verdict.logprobs
    assert rows.chosen.shape == (len(emitted),)
    want = ref[at : at + len(emitted)].gather(-1, torch.tensor(emitted)[:, None])[:, 0]
    torch.testing.assert_close(rows.chosen, want, atol=1e-4, rtol=0)
    top = ref[at : at + len(emitted)].topk(5, dim=-1)
    torch.testing.assert_close(rows.top_values, top.values, atol=1e-4, rtol=0)
    assert (rows.top_values[:, :-1] >= rows.top_values[:, 1:]).all()  # most likely first
    # The ids hold the values they are paired with (ties may order either way).
    paired = ref[at : at + len(emitted)].gather(-1, rows.top_ids)
    torch.testing.assert_close(paired, rows.top_values, atol=1e-4, rtol=0)
    # Echo: new_tokens[1:] each scored given what precedes it.
    prompt = verdict.prompt_logprobs
    want = ref[: len(PROMPT) - 1].gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    torch.testing.assert_close(prompt.chosen, want, atol=1e-4, rtol=0)
    assert prompt.top_ids.shape == (len(PROMPT) - 1, 5)
    # The cache holds what it would without scores.
    assert runtime.store.tokens(session) == [*PROMPT, *draft[: verdict.accepted]]


def test_greedy_verdict_unchanged_by_scores(runtime):
    plain = runtime.drive(
        verify(VerifyCall(runtime, "lp/plain", Prefix(0, 0), PROMPT, DRAFT, None, SamplingParams()))
    )
    scored = runtime.drive(
        verify(
            VerifyCall(
                runtime,
                "lp/scored",
                Prefix(0, 0),
                PROMPT,
                DRAFT,
                None,
                SamplingParams(),
                logprobs=LogprobsAsk(),
            )
        )
    )
    assert (plain.accepted, plain.next_token) == (scored.accepted, scored.next_token)
    assert scored.logprobs.top_ids.shape == (scored.accepted + 1, 0)
    assert scored.prompt_logprobs is None


def test_fork_copies_the_prefix_and_misses_cleanly(runtime, target_model):
    seq = [*PROMPT, 1, 2, 3]
    runtime.drive(
        verify(VerifyCall(runtime, "fork/src", Prefix(0, 0), seq, [], None, SamplingParams()))
    )
    n = len(PROMPT) - 1
    prefix = Prefix(n, prefix_hash(PROMPT[:n]))
    verdict = runtime.drive(
        verify(
            VerifyCall(
                runtime,
                "fork/dst",
                prefix,
                PROMPT[n:],
                [],
                None,
                SamplingParams(),
                logprobs=LogprobsAsk(),
                fork_from="fork/src",
            )
        )
    )
    assert runtime.store.tokens("fork/dst") == PROMPT
    assert runtime.store.tokens("fork/src") == seq  # the source is untouched
    ref = reference(target_model, PROMPT)
    assert verdict.next_token == int(ref[-1].argmax())
    torch.testing.assert_close(verdict.logprobs.chosen, ref[-1:].max(-1).values, atol=1e-4, rtol=0)
    with pytest.raises(CacheMiss, match="fork source"):
        runtime.store.acquire("fork/x", n, prefix.hash, 1, fork_from="fork/none")
    with pytest.raises(CacheMiss, match="holds 10 tokens"):
        runtime.store.acquire("fork/x", 12, 0, 1, fork_from="fork/src")
    with pytest.raises(CacheMiss, match="different tokens"):
        runtime.store.acquire("fork/y", n, prefix_hash([0] * n), 1, fork_from="fork/src")
    # prefix 0: a fresh cache, no copy.
    assert runtime.store.acquire("fork/z", 0, 0, 1, fork_from="fork/src").tokens == []


def test_a_one_token_prompt_has_no_prompt_scores(runtime):
    ask = LogprobsAsk(top=2, prompt=True)
    verdict = runtime.drive(
        verify(
            VerifyCall(
                runtime,
                "lp/one",
                Prefix(0, 0),
                PROMPT[:1],
                DRAFT[:2],
                None,
                SamplingParams(),
                logprobs=ask,
            )
        )
    )
    assert verdict.prompt_logprobs.chosen.shape == (0,)
    assert verdict.prompt_logprobs.top_ids.shape == (0, 2)
    assert verdict.logprobs.chosen.shape == (verdict.accepted + 1,)
