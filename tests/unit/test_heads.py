"""Draft heads on the target's features, in-process (docs/concepts/heads.md): the
verifier's features (specdec.replica.features, the scorer) against the target's own hidden
states read with a hook, on both torch engines, chunked, sampled, on a tree and in each
wire format; the head's per-session bookkeeping (HeadState); the head drafter's engine
(specdec.drafter.head): a head that copies a one-layer target drafts the target's own
tokens, and a random head's drafts depend on the features it is given."""

from __future__ import annotations

import re
import weakref

import pytest
import torch
from prometheus_client import REGISTRY

from specdec.common.errors import FailedPrecondition, InvalidRequest, Unimplemented
from specdec.common.prefix import prefix_hash
from specdec.common.settings import ConfigError
from specdec.drafter.config import DrafterConfig
from specdec.drafter.head import (
    HeadDraftCall,
    HeadRuntime,
    HeadSpeculateCall,
    HeadState,
    read_head,
)
from specdec.drafter.speculate import BranchStore
from specdec.replica.batching import BranchGroup, BranchStep
from specdec.replica.engine import Prefix
from specdec.replica.features import (
    FeatureAsk,
    FeatureSink,
    ask_from_proto,
    decode_features,
    encode_features,
    sent_rows,
)
from specdec.replica.llamacpp import LlamaCppRuntime
from specdec.replica.runtime import ModelRuntime
from specdec.replica.sampling import SamplingParams
from specdec.tools.tinymodels import build_one_layer_target, build_test_head
from specdec.v1 import common_pb2
from specdec.verifier.config import VerifierConfig
from specdec.verifier.scorer import VerifyCall

F32, BF16 = common_pb2.FEATURE_FORMAT_FLOAT32, common_pb2.FEATURE_FORMAT_BFLOAT16
GREEDY = SamplingParams(temperature=0.0)


def p(tokens, n) -> Prefix:
    return Prefix(n, prefix_hash(tokens[:n]))


def hidden_states(model, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The target's decoder layers' outputs at every position, concatenated [n, width]:
    a plain transformers forward with hooks (the reference, not the runtime's code)."""
    got: dict[int, torch.Tensor] = {}
    handles = [
        model.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: got.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in layers
    ]
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.cat([got[i][0] for i in layers], dim=-1)


@pytest.fixture(scope="module", params=["dense", "paged"])
def verifier(request, test_models):
    rt = ModelRuntime(
        VerifierConfig(
            role="verifier",
            model=str(test_models.target),
            engine=request.param,
            prefill_chunk=8,  # the prompts below take several chunks
        )
    )
    rt.load()
    yield rt
    rt.shutdown()


def run(rt, call):
    return rt.drive(call.job())


def test_a_verdict_returns_the_features_of_the_positions_it_made_known(
    verifier, target_model, tokenizer, reference
):
    """New tokens (a prompt of several prefill chunks), then a draft whose first 3 tokens
    are the target's: the features of the prompt and the 3 accepted tokens, equal to the
    target's last decoder layer's output there (before the final norm); the next round's
    start where that one ended."""
    ids = tokenizer("def fibonacci(n):\n    if n < 2:\n        return n").input_ids
    good = reference(ids, 6)
    draft = [*good[:3], (good[3] + 1) % verifier.vocab_size]
    ask = FeatureAsk((2,), F32)
    verdict = run(verifier, VerifyCall(verifier, "f/1", p(ids, 0), ids, draft, None, GREEDY,
                                       features=ask))  # fmt: skip
    assert verdict.accepted == 3 and verdict.next_token == good[3]
    assert verdict.features_start == 0
    assert verdict.features.shape == (len(ids) + 3, 64)
    want = hidden_states(target_model, [*ids, *good[:3]], (2,))
    torch.testing.assert_close(verdict.features, want, atol=1e-4, rtol=1e-4)
    # The target's final norm and output layer over a feature give its next token.
    head = target_model.lm_head(target_model.model.norm(verdict.features[-1]))
    assert int(head.argmax()) == good[3]
    # The next round: features from its prefix (the cached length) on.
    seq = [*ids, *good[:4]]
    verdict = run(verifier, VerifyCall(verifier, "f/1", p(seq, len(seq) - 1), seq[-1:],
                                       good[4:6], None, GREEDY, features=ask))  # fmt: skip
    assert verdict.features_start == len(seq) - 1
    assert verdict.features.shape == (1 + verdict.accepted, 64)
    want = hidden_states(target_model, [*seq, *good[4 : 4 + verdict.accepted]], (2,))
    torch.testing.assert_close(verdict.features, want[len(seq) - 1 :], atol=1e-4, rtol=1e-4)
    verifier.release("f/1")


def test_several_layers_sampled_and_in_bfloat16(verifier, target_model, tokenizer):
    """Layers 0 and 2, concatenated in the order asked, under sampling; bfloat16 on the
    wire is the same values rounded."""
    ids = tokenizer("The quick brown fox").input_ids
    draft = [5, 6]
    probs = torch.full((2, verifier.vocab_size), 1.0 / verifier.vocab_size)
    sampling = SamplingParams(temperature=1.0, seed=3)
    for fmt, tol in ((F32, 1e-4), (BF16, 2e-2)):
        call = VerifyCall(verifier, "f/2", p(ids, 0), ids, draft, probs, sampling,
                          features=FeatureAsk((2, 0), fmt))  # fmt: skip
        verdict = run(verifier, call)
        n = len(ids) + verdict.accepted
        assert verdict.features.shape == (n, 128)
        assert verdict.features.dtype == (torch.float32 if fmt == F32 else torch.bfloat16)
        want = hidden_states(target_model, [*ids, *draft[: verdict.accepted]], (2, 0))
        torch.testing.assert_close(verdict.features.float(), want, atol=tol, rtol=tol)
    verifier.release("f/2")


def test_a_tree_returns_the_accepted_paths_features(verifier, target_model, tokenizer, reference):
    """A token tree whose second branch is the target's: the new tokens' features, then the
    accepted path's nodes', as the sequence now holds them."""
    ids = tokenizer("import numpy as np\n").input_ids
    good = reference(ids, 3)
    wrong = (good[0] + 1) % verifier.vocab_size
    tree = [wrong, good[0], good[1], good[2]]  # root wrong; root good -> good -> good
    parents = [-1, -1, 1, 2]
    call = VerifyCall(verifier, "f/3", p(ids, 0), ids, tree, None, GREEDY,
                      draft_parents=parents, features=FeatureAsk((2,), F32))  # fmt: skip
    verdict = run(verifier, call)
    assert verdict.path == [1, 2, 3]
    want = hidden_states(target_model, [*ids, *good], (2,))
    torch.testing.assert_close(verdict.features, want, atol=1e-4, rtol=1e-4)
    verifier.release("f/3")


def test_a_verify_that_does_not_ask_returns_none(verifier, tokenizer):
    ids = tokenizer("SELECT name FROM users WHERE").input_ids
    verdict = run(verifier, VerifyCall(verifier, "f/4", p(ids, 0), ids, [5], None, GREEDY))
    assert verdict.features is None
    verifier.release("f/4")


@pytest.mark.parametrize(
    ("layers", "fmt", "message"),
    [
        ([3], F32, "features.layers holds 3, outside the target's decoder layers [0, 3)"),
        ([], F32, "features.layers is empty"),
        ([1, 1], F32, "names a layer twice"),
        ([2], 0, "features.format 0 is not one of"),
        ([2], 9, "features.format 9 is not one of"),
    ],
)
def test_bad_feature_requests_are_refused(layers, fmt, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        ask_from_proto(common_pb2.FeatureRequest(layers=layers, format=fmt), 3)


def test_engines_that_cannot_read_hidden_states_say_so(test_models):
    msg = common_pb2.FeatureRequest(layers=[0], format=F32)
    with pytest.raises(FailedPrecondition, match=r"not available with --engine llama\.cpp"):
        LlamaCppRuntime.feature_ask(object(), msg)  # type: ignore[arg-type]
    tp = ModelRuntime(
        VerifierConfig(role="verifier", model=str(test_models.target), tensor_parallel=2)
    )  # a rank 0 of two, unloaded
    with pytest.raises(Unimplemented, match="--tensor-parallel"):
        tp.feature_ask(msg)


def test_the_wire_format_round_trips_and_is_bounded():
    rows = torch.randn(5, 8)
    msg = encode_features(rows, 17, F32)
    assert (msg.start, msg.positions, msg.width, len(msg.data)) == (17, 5, 8, 160)
    torch.testing.assert_close(decode_features(msg, 8, F32), rows)
    half = encode_features(rows.to(torch.bfloat16), 0, BF16)
    assert len(half.data) == 80
    with pytest.raises(InvalidRequest, match="width 8, the head reads 4"):
        decode_features(msg, 4, F32)
    with pytest.raises(InvalidRequest, match="format"):
        decode_features(msg, 8, BF16)
    msg.data = msg.data[:-4]
    with pytest.raises(InvalidRequest, match="156 bytes of data for 5 rows"):
        decode_features(msg, 8, F32)
    # 32 MiB at most: 4 KB rows (1024 float32 values), 8192 of them.
    assert sent_rows(10_000, 1024, F32) == 8192 and sent_rows(10, 1024, F32) == 10


# -- the head's bookkeeping ------------------------------------------------------------------


def test_head_state_feeds_target_features_and_refreshes_stale_positions():
    state = HeadState(session=weakref.ref(HeadState))
    # A first Draft of 4 tokens without features: position 0 reads zeros by convention,
    # 1..3 are missing (stale).
    rows, missing = state.inputs(0, 4, 2, torch.float32)
    assert missing == 3 and state.stale == [1, 2, 3] and not rows.any()
    state.fed_own(4)  # then a draft step at 4
    assert state.stale == [1, 2, 3, 4]
    assert state.rollback_point(5) == 5  # nothing to refresh yet
    state.receive(0, torch.arange(10.0).view(5, 2))  # positions 0..4 arrive
    assert state.rollback_point(5) == 1  # the first stale position whose feature came
    rows, missing = state.inputs(1, 5, 2, torch.float32)
    assert missing == 0 and state.stale == []
    torch.testing.assert_close(rows, torch.arange(10.0).view(5, 2))  # f(j - 1) at j
    state.prune(6)
    assert state.known == {}  # every one was read, and no stale position is left
    state.receive(5, torch.ones(3, 2))  # 5..7: read by positions not fed yet, kept
    state.prune(6)
    assert list(state.known) == [5, 6, 7]
    # A feature for a position the session no longer holds is dropped.
    state.forget_after(6)
    assert list(state.known) == [5]


def test_head_state_keeps_unfixable_positions_stale():
    """A missing feature that never arrives leaves its position stale; a later one that
    arrives is refreshed from its own position."""
    state = HeadState(session=weakref.ref(HeadState))
    state.inputs(0, 6, 1, torch.float32)
    assert state.stale == [1, 2, 3, 4, 5]
    state.receive(3, torch.ones(2, 1))  # positions 3, 4
    assert state.rollback_point(6) == 4
    rows, missing = state.inputs(4, 2, 1, torch.float32)
    assert missing == 0 and rows.tolist() == [[1.0], [1.0]]
    assert state.stale == [1, 2, 3]  # their features never came


# -- the head drafter's engine ---------------------------------------------------------------


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    target = build_one_layer_target(root / "target1")
    return {
        "target": target,
        "exact": build_test_head(target, root / "exact", exact=True),
        "random": build_test_head(target, root / "random", seed=1),
    }


def head_runtime(head, target, **settings) -> HeadRuntime:
    rt = HeadRuntime(DrafterConfig(role="drafter", model=str(target), head=str(head), **settings))
    rt.load()
    return rt


def draft(rt, session, seq, cached, k, features=(), branches=None):
    call = HeadDraftCall(
        runtime=rt,
        branches=BranchStore() if branches is None else branches,
        session_id=session,
        prefix=p(seq, cached),
        new_tokens=seq[cached:],
        k=k,
        params=GREEDY,
        features=features,
    )
    return rt.drive(call.job())


@pytest.mark.parametrize("engine", ["dense", "paged"])
def test_a_head_that_copies_a_one_layer_target_drafts_its_tokens(one_layer, tokenizer, engine):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(one_layer["target"], dtype=torch.float32)
    rt = head_runtime(one_layer["exact"], one_layer["target"], engine=engine)
    try:
        assert rt.head_features == FeatureAsk((0,), F32)
        ids = tokenizer("for i in range(10):\n    print(").input_ids
        with torch.inference_mode():
            want = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6)
        want = want[0, len(ids) :].tolist()
        got = draft(rt, "h/exact", ids, 0, 6)
        assert got.tokens == want
        assert got.cached_length == len(ids) + 5
    finally:
        rt.shutdown()


@pytest.mark.parametrize("engine", ["dense", "paged"])
def test_a_heads_branch_rows_are_fed_their_inputs(one_layer, engine):
    """A head's branch rows (a tree's continued leaves): row (v, t, f) gives the logits
    and the output feature that feeding t with input f after the session's first v tokens
    gives on a session of its own, and so does its next step, fed that output. Two rows
    of different lengths in one step; the session's cache is not changed."""
    rt = head_runtime(one_layer["random"], one_layer["target"], engine=engine)
    try:
        seq, width = list(range(5, 17)), rt.width
        feats = torch.randn(len(seq), width, generator=torch.Generator().manual_seed(0))
        first = torch.randn(2, width, generator=torch.Generator().manual_seed(1))
        session = rt.ready_store.acquire("hb/base", 0, 0, len(seq))
        rt.drive(rt.forward_steps(session, seq, keep=1, inputs=feats))
        group = BranchGroup(session, [7, 10])
        steps = [[40, 41], [42, 43]]  # each step's token per row
        logits, outputs, inputs = [], [], first
        for tokens in steps:
            sink = FeatureSink((0,))
            logits.append(rt.drive(_one(BranchStep(group, tokens, features=sink, inputs=inputs))))
            inputs = sink.tensor()  # [rows, width]: what each row's next token is fed
            outputs.append(inputs)
        assert len(session.tokens) == len(seq)
        for row, v in enumerate(group.visible):
            alone = rt.ready_store.acquire(f"hb/{row}", 0, 0, v + len(steps))
            rt.drive(rt.forward_steps(alone, seq[:v], keep=1, inputs=feats[:v]))
            fed = [first[row : row + 1], outputs[0][row : row + 1]]
            for step, tokens in enumerate(steps):
                sink = FeatureSink((0,))
                want = rt.drive(
                    rt.forward_steps(alone, [tokens[row]], keep=1, features=sink, inputs=fed[step])
                )
                torch.testing.assert_close(logits[step][row], want[-1], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(
                    outputs[step][row], sink.tensor()[-1], atol=1e-4, rtol=1e-4
                )
    finally:
        rt.shutdown()


@pytest.mark.parametrize("after_a_draft", [True, False])
def test_a_heads_ssd_branches_continue_each_outcome(one_layer, tokenizer, after_a_draft):
    """SSD on a head that copies a one-layer target (its drafts are the target's whatever
    the features): after this replica's Draft (its rows and feeds kept) or without one
    (the draft fed again), every prepared branch (a, t) is the target's greedy
    continuation of x + d_1..d_a + t, and a Draft for one of those sequences is served
    from its branch without a forward."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(one_layer["target"], dtype=torch.float32)
    rt = head_runtime(one_layer["exact"], one_layer["target"], engine="dense")
    try:
        ids, k, branch_k = tokenizer("def add(a, b):\n    return").input_ids, 3, 3
        store = BranchStore()
        if after_a_draft:
            first = draft(rt, "hs/s", ids, 0, k, branches=store)
            d = first.tokens
            prefix, new = p([*ids, *d[: k - 1]], len(ids) + k - 1), [d[-1]]
        else:
            d = [tokenizer(" a").input_ids[0], tokenizer(" +").input_ids[0], 5]
            prefix, new = p(ids, 0), [*ids, *d]
        call = HeadSpeculateCall(
            runtime=rt, store=store, session_id="hs/s", prefix=prefix, new_tokens=new, k=k,
            branch_k=branch_k, params=GREEDY, fan_out=4, alpha=0.7, max_per_outcome=2,
        )  # fmt: skip
        result = rt.drive(call.job())
        assert len(result.branches) == 4
        for b in result.branches:
            context = [*ids, *d[: b.accepted], b.next_token]
            with torch.inference_mode():
                want = target.generate(torch.tensor([context]), do_sample=False,
                                       max_new_tokens=branch_k)  # fmt: skip
            assert b.tokens == want[0, len(context) :].tolist(), (b.accepted, b.next_token)
        b = result.branches[0]
        seq = [*ids, *d[: b.accepted], b.next_token]
        cached = len(ids) + k  # the Speculate fed the whole draft
        served = draft(rt, "hs/s", seq, min(cached, len(seq) - 1), branch_k, branches=store)
        assert served.prepared and served.tokens == b.tokens
    finally:
        rt.shutdown()


def _one(request):
    """A job of one forward: its logits."""
    return (yield request)


def test_a_random_heads_drafts_depend_on_the_features(one_layer, tokenizer):
    """The same Draft with the target's features, and with other values in their place:
    different drafts (the head reads them); with the same features twice, the same."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(one_layer["target"], dtype=torch.float32)
    rt = head_runtime(one_layer["random"], one_layer["target"], engine="dense")
    try:
        ids = tokenizer("Once upon a time, in a land far away,").input_ids
        true = hidden_states(target, ids, (0,))
        runs = {}
        for name, rows in (("true", true), ("again", true), ("other", true.flip(0) * 3)):
            runs[name] = draft(rt, f"h/{name}", ids, 0, 4, ((0, rows),)).tokens
        assert runs["true"] == runs["again"]
        assert runs["true"] != runs["other"]
        fed = REGISTRY.get_sample_value(
            "specdec_drafter_head_feature_positions_total", {"source": "target"}
        )
        assert fed is not None and fed >= 3 * len(ids)
    finally:
        rt.shutdown()


def test_a_head_folder_that_is_not_one_is_refused(tmp_path, one_layer):
    with pytest.raises(ConfigError, match="is not a head folder"):
        read_head(str(tmp_path))
    with pytest.raises(ConfigError, match="no 'specdec_head' object"):
        read_head(str(one_layer["target"]))


def test_a_model_drafter_takes_no_features(test_models):
    from specdec.drafter.runtime import DrafterRuntime
    from specdec.drafter.server import DrafterServicer
    from specdec.v1 import drafter_pb2

    rt = DrafterRuntime(DrafterConfig(role="drafter", model=str(test_models.draft_small)))
    rt.load()
    try:
        request = drafter_pb2.DraftRequest(
            session_id="m/1",
            new_tokens=[5, 6],
            num_draft_tokens=2,
            features=[common_pb2.Features(start=0, positions=0, width=64, format=F32)],
        )
        with pytest.raises(FailedPrecondition, match="takes none"):
            DrafterServicer(rt).draft_call(request)
    finally:
        rt.shutdown()
