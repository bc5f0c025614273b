"""Speculate after a Draft feeds only the draft's last token: the Draft cached the rest and
kept the distributions it drew from (issue 12, item 3). Counted at the model's forward."""

from __future__ import annotations

import pytest

from specdec.common.params import SamplingParams
from specdec.common.prefix import prefix_hash
from specdec.drafter.config import DrafterConfig
from specdec.drafter.proposer import DraftCall, propose
from specdec.drafter.speculate import BranchStore, SpeculateCall, speculate
from specdec.replica.engine import Prefix
from specdec.replica.runtime import ModelRuntime

CONTEXT = list(range(10, 40))
K = 4


@pytest.fixture(scope="module")
def drafter(test_models):
    # the dense engine: `fed` counts its one-session forwards (`_forward`)
    rt = ModelRuntime(
        DrafterConfig(role="drafter", model=str(test_models.draft_noisy), engine="dense")
    )
    rt.load()
    yield rt
    rt.shutdown()


@pytest.fixture
def fed(drafter, monkeypatch):
    """Tokens fed through each session forward (one per ForwardRequest), per call."""
    calls: list[int] = []
    forward = drafter._forward

    def counting(request):
        calls.append(len(request.tokens))
        return forward(request)

    monkeypatch.setattr(drafter, "_forward", counting)
    return calls


def _speculate(rt, store, session, prefix_len, seq, params):
    """Speculate for the draft at the end of seq, naming the first prefix_len as cached."""
    return rt.drive(
        speculate(
            SpeculateCall(
                rt,
                store,
                session,
                Prefix(prefix_len, prefix_hash(seq[:prefix_len])),
                seq[prefix_len:],
                K,
                K,
                params,
                6,
                0.7,
                3,
            )
        )
    )


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)])
def test_speculate_after_draft_feeds_one_token(drafter, fed, params):
    store = BranchStore()
    # A Draft (prefix fed whole), then Speculate the way the gateway sends it now.
    draft = drafter.drive(
        propose(DraftCall(drafter, store, "s/new", Prefix(0, 0), CONTEXT, K, params))
    )
    assert draft.cached_length == len(CONTEXT) + K - 1
    assert fed == [len(CONTEXT), 1, 1, 1]  # the prefill, then d_1..d_3 one at a time
    seq = [*CONTEXT, *draft.tokens]
    fed.clear()
    new = _speculate(drafter, store, "s/new", draft.cached_length, seq, params)
    assert fed == [1]  # d_4 alone
    assert store.refed_tokens == 0

    # The same round the old way: the prefix ends before the draft, so the last context
    # token and the whole draft are fed again.
    old_store = BranchStore()
    drafter.drive(propose(DraftCall(drafter, old_store, "s/old", Prefix(0, 0), CONTEXT, K, params)))
    fed.clear()
    old = _speculate(drafter, old_store, "s/old", len(CONTEXT) - 1, seq, params)
    assert fed == [K + 1]
    # Same branches either way (the rows a Draft kept are the ones a re-feed computes).
    assert [(b.accepted, b.next_token, b.tokens) for b in new.branches] == [
        (b.accepted, b.next_token, b.tokens) for b in old.branches
    ]
    assert new.cached_length == old.cached_length == len(seq)


def test_without_the_drafts_rows_the_draft_is_fed_again(drafter, fed):
    """The Draft's rows are gone (another Draft of the session was served from a branch,
    or the store dropped them): the cache rolls back and the draft is fed from the
    session's own tokens, with the same branches."""
    params = SamplingParams()
    store = BranchStore()
    draft = drafter.drive(
        propose(DraftCall(drafter, store, "s/lost", Prefix(0, 0), CONTEXT, K, params))
    )
    seq = [*CONTEXT, *draft.tokens]
    assert store.pop_rows("s/lost") is not None
    fed.clear()
    again = _speculate(drafter, store, "s/lost", draft.cached_length, seq, params)
    assert fed == [K + 1]  # the last context token, d_1..d_3 from the cache, d_4
    assert store.refed_tokens == K
    reference_store = BranchStore()
    drafter.drive(
        propose(DraftCall(drafter, reference_store, "s/ref", Prefix(0, 0), CONTEXT, K, params))
    )
    ref = _speculate(drafter, reference_store, "s/ref", len(CONTEXT) - 1, seq, params)
    assert [(b.accepted, b.next_token, b.tokens) for b in again.branches] == [
        (b.accepted, b.next_token, b.tokens) for b in ref.branches
    ]
