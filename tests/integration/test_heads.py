"""Head drafters through real processes on loopback (`specdec serve drafter --head`,
docs/concepts/heads.md): a head is a proposal like any other, so greedy output through
the gateway equals transformers' generate() on the target over several rounds and two
turns of a session, on the data plane and on gRPC, and sampled sequences follow the
target's distribution (with check_sequence_counts' negative control). The verifier's
features travel on both transports, every byte of them counted; a head that copies a
one-layer target has its drafts accepted; what is not built answers FAILED_PRECONDITION."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from specdec.gateway.fleet.dataplane import DataPlaneTransport
from specdec.gateway.fleet.transport import CallFailed, GrpcTransport, Method
from specdec.sdk import Client
from specdec.tools.redisproc import free_port
from specdec.tools.tinymodels import build_one_layer_target, build_test_head
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2
from tests.conftest import PROMPTS, start_up_error
from tests.integration.exact import second_turn_equals_generate
from tests.integration.test_dataplane import data_port, metric, prefix, stubs
from tests.integration.test_gateway import small_stack
from tests.integration.test_ssd import check_sequence_counts, exact_sequence_probs, sample_top2

pytestmark = pytest.mark.integration

N = 24
GREEDY = common_pb2.SamplingParams()
F32 = common_pb2.FEATURE_FORMAT_FLOAT32
LAST = common_pb2.FeatureRequest(layers=[2], format=F32)  # the tiny target has 3 layers
WIDTH = 64  # its hidden size


@pytest.fixture(scope="module")
def heads(test_models, tmp_path_factory):
    """A random head on the tiny target; a one-layer target and a head that copies it."""
    root = tmp_path_factory.mktemp("heads")
    target1 = build_one_layer_target(root / "target1")
    return {
        "random": build_test_head(test_models.target, root / "random"),
        "target1": target1,
        "exact": build_test_head(target1, root / "exact", exact=True),
        "noisy": build_test_head(target1, root / "noisy", exact=True, noise=0.05),
    }


@pytest.fixture(scope="module")
def head_stack(test_models, heads):
    """A head drafter and the target's verifier, both with metrics; gateways over them on
    the data plane (`gateway`) and on gRPC (`grpc`)."""
    ports = {"drafter": free_port(), "verifier": free_port()}
    with small_stack(
        test_models.target,
        test_models.target,
        "--head",
        str(heads["random"]),
        "--metrics-port",
        str(ports["drafter"]),
        verifier_flags=("--metrics-port", str(ports["verifier"])),
        gateway_flags=("--suffix-cache-scope", "off"),
        more_gateways={"grpc": ("--replica-transport", "grpc", "--suffix-cache-scope", "off")},
    ) as procs:
        yield {**procs, "metrics": ports}


@pytest.mark.parametrize("which", ["gateway", "grpc"])
def test_greedy_through_a_head_equals_generate(head_stack, tokenizer, reference, which):
    with Client(head_stack[which].address, timeout=120) as client:
        for text in PROMPTS[:4]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=N, k=3, ssd=False)
            assert list(got.tokens) == reference(ids, N), (which, text)
            assert got.stats.rounds > 3 and got.stats.draft_tokens > 0
            assert not got.stats.ssd
        second_turn_equals_generate(client, PROMPTS[4:6], f"heads-{which}", tokenizer, reference, N)


def test_greedy_through_a_head_with_ssd_equals_generate(head_stack, tokenizer, reference):
    """SSD with a head: the drafter pre-drafts the next round for the likely outcomes with
    its own features while the verifier works, and the output is the target's generate().
    Whether a branch arrives before its verdict is the machine's timing (a loaded machine
    makes them late); that a prepared branch serves the next Draft is
    tests/unit/test_heads.py's."""
    speculated = hits = 0
    with Client(head_stack["gateway"].address, timeout=120) as client:
        for text in PROMPTS[:4]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=N, k=3, ssd=True)
            assert list(got.tokens) == reference(ids, N), text
            assert got.stats.ssd
            speculated += got.stats.ssd_speculates
            hits += got.stats.ssd_hits
    assert speculated > 0
    print(f"SSD with a head: {hits} hits in {speculated} Speculates")


def test_greedy_through_a_heads_trees_equals_generate(head_stack, tokenizer, reference):
    """Trees drafted by the head (its alternatives as leaves, continued as branch rows):
    rounds verify trees, and the output is the target's generate() (the verifier returns
    the accepted path's features, in the head's cache order)."""
    tree_rounds = 0
    with Client(head_stack["gateway"].address, timeout=120) as client:
        for text in PROMPTS[:3]:
            ids = tokenizer(text).input_ids
            got = client.generate(
                token_ids=ids, max_new_tokens=N, k=3, tree_width=3, k_policy="fixed"
            )
            assert list(got.tokens) == reference(ids, N), text
            tree_rounds += got.stats.tree_rounds
    assert tree_rounds > 0


async def test_a_heads_tree_draft_grows_leaves_and_continues_them(head_stack, tokenizer):
    """A Draft to the head with tree_nodes and tree_depth: the chain of k, leaves that are
    siblings of draft tokens (none equal to the token beside it), and continued leaves'
    tokens, each the child of the node before it."""
    ids = tokenizer(PROMPTS[3]).input_ids
    got = await tree_draft(head_stack["drafter"], "heads/tree", ids, 3, 7, tree_depth=2)
    tokens, parents = list(got.draft_tokens), list(got.draft_parents)
    assert 3 < len(tokens) <= 10 and len(parents) == len(tokens)
    assert parents[:3] == [-1, 0, 1]
    leaves = [n for n in range(3, len(tokens)) if parents[n] < 2]
    continued = [n for n in range(3, len(tokens)) if parents[n] >= 3]
    assert leaves and continued and len(leaves) + len(continued) == len(tokens) - 3
    for node in leaves:
        sibling = parents[node] + 1  # the draft token the leaf stands beside
        assert tokens[node] != tokens[sibling]
    for node in continued:  # depth 2: a leaf's first token, then its second
        assert parents[node] in leaves or parents[parents[node]] in leaves


async def tree_draft(drafter, session_id: str, ids: list[int], k: int, nodes: int, **fields):
    """A greedy tree Draft (width 3) of ids to the drafter process, on gRPC: its response."""
    channel, stub = stubs(drafter, "drafter")
    request = drafter_pb2.DraftRequest(
        session_id=session_id, prefix=prefix(ids, 0), new_tokens=ids, num_draft_tokens=k,
        sampling=GREEDY, tree_nodes=nodes, tree_width=3, **fields,
    )  # fmt: skip
    try:
        return await GrpcTransport(stub).call(Method.DRAFT, request, 30)
    finally:
        await channel.close()


def test_the_features_flow_and_are_counted(head_stack, tokenizer):
    """Every position whose next token a verdict made known is sent once, 256 bytes a
    position (64 float32 values); the head fed them and its own predictions at the draft
    steps, never zeros: the first round drafts nothing, and its verdict brings the
    prompt's features to the first Draft."""
    vm, dm = head_stack["metrics"]["verifier"], head_stack["metrics"]["drafter"]
    positions = "specdec_drafter_head_feature_positions_total"

    def counters():
        return {
            "sent": metric(vm, "specdec_verifier_feature_bytes_total"),
            "received": metric(dm, "specdec_drafter_head_feature_bytes_total"),
            **{s: metric(dm, positions, f'source="{s}"') for s in ("target", "own", "missing")},
        }

    ids = tokenizer(PROMPTS[1]).input_ids
    before = counters()
    with Client(head_stack["gateway"].address, timeout=120) as client:
        got = client.generate(token_ids=ids, max_new_tokens=N, k=3)
    after = counters()
    delta = {name: after[name] - before[name] for name in before}
    # The verifier's cache ends holding the prompt and the output but its last token.
    assert delta["sent"] == 4 * WIDTH * (len(ids) + N - 1)
    assert got.stats.feature_bytes == delta["sent"]  # the request's own count
    # All but the last verdict's reached the drafter with the next Draft.
    assert 0 < delta["received"] < delta["sent"]
    assert delta["missing"] == 0
    assert delta["target"] >= len(ids) + got.stats.accepted_tokens
    # A Draft of k tokens feeds k - 1 of them with the head's own predictions.
    assert delta["own"] == sum(
        (k - 1) * rounds for k, rounds in enumerate(got.stats.rounds_by_k) if k
    )
    print(f"features: {delta['sent'] / got.stats.rounds:.0f} bytes a round over "
          f"{got.stats.rounds} rounds")  # fmt: skip


async def test_features_are_the_same_on_both_transports(head_stack, tokenizer, target_model):
    """A Verify asking for the last layer's features: the same answer through gRPC and the
    data plane, and the target's own hidden states (before its final norm)."""
    channel, stub = stubs(head_stack["verifier"], "verifier")
    transports = {
        "grpc": GrpcTransport(stub),
        "data": DataPlaneTransport("127.0.0.1", data_port(head_stack["verifier"])),
    }
    ids = tokenizer(PROMPTS[2]).input_ids
    answers = {}
    try:
        for name, transport in transports.items():
            request = verifier_pb2.VerifyRequest(
                session_id=f"heads/wire-{name}", prefix=prefix(ids, 0), new_tokens=ids,
                draft_tokens=[5, 6, 7], sampling=GREEDY, features=LAST,
            )  # fmt: skip
            answers[name] = await transport.call(Method.VERIFY, request, 30)
    finally:
        await transports["data"].close()
        await channel.close()
    a, b = answers["grpc"].features, answers["data"].features
    assert a == b
    accepted = answers["grpc"].accepted_count
    assert (a.start, a.positions, a.width, a.format) == (0, len(ids) + accepted, WIDTH, F32)
    rows = torch.frombuffer(bytearray(a.data), dtype=torch.float32).view(a.positions, WIDTH)
    seen = {}
    hook = target_model.model.layers[2].register_forward_hook(
        lambda _m, _a, out: seen.__setitem__("h", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.inference_mode():
            target_model(input_ids=torch.tensor([[*ids, *[5, 6, 7][:accepted]]]))
    finally:
        hook.remove()
    torch.testing.assert_close(rows, seen["h"][0], atol=1e-4, rtol=1e-4)


def test_sampling_through_a_head_follows_the_target(heads, tokenizer):
    """Temperature 1, top-k 2, k = 3 through a head drafter whose drafts the target
    accepts often but not always (the noisy copy of a one-layer target): every one of the
    16 possible 4-token sequences within 5 sigma of its exact probability, and the check's
    negative control."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(heads["target1"], dtype=torch.float32)
    ids = tokenizer(PROMPTS[0]).input_ids
    exact = exact_sequence_probs(target, ids, steps=4, top_k=2)
    assert len(exact) == 16 and math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)
    with small_stack(heads["target1"], heads["target1"], "--head", str(heads["noisy"])) as procs:
        results = sample_top2(procs["gateway"].address, ids, 1200, k=3)
    assert sum(r.stats.accepted_tokens for r in results) > 0
    check_sequence_counts([tuple(r.tokens) for r in results], exact)


def test_sampling_through_a_head_with_ssd_follows_the_target(heads, tokenizer):
    """As above with SSD: the prepared branches (drawn with the head's own features, from
    a stream of their own) keep the target's distribution, and the negative control."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(heads["target1"], dtype=torch.float32)
    ids = tokenizer(PROMPTS[0]).input_ids
    exact = exact_sequence_probs(target, ids, steps=4, top_k=2)
    with small_stack(heads["target1"], heads["target1"], "--head", str(heads["noisy"])) as procs:
        results = sample_top2(procs["gateway"].address, ids, 1200, k=2, ssd=True)
    assert sum(r.stats.ssd_speculates for r in results) > 0
    check_sequence_counts([tuple(r.tokens) for r in results], exact)


def test_sampling_through_a_heads_trees_follows_the_target(heads, tokenizer):
    """As above with trees (tree width 3, leaves continued as branch rows): the tree rule
    keeps the target's distribution over all 16 sequences, and the check's negative
    control."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(heads["target1"], dtype=torch.float32)
    ids = tokenizer(PROMPTS[0]).input_ids
    exact = exact_sequence_probs(target, ids, steps=4, top_k=2)
    with small_stack(heads["target1"], heads["target1"], "--head", str(heads["noisy"])) as procs:
        results = sample_top2(
            procs["gateway"].address, ids, 1200, k=3, tree_width=3, k_policy="fixed"
        )
    assert sum(r.stats.tree_rounds for r in results) > 0
    check_sequence_counts([tuple(r.tokens) for r in results], exact)


async def test_a_head_over_a_reduced_vocabulary(heads, tokenizer, test_models, reference):
    """--draft-vocab with --head: the head's output layer keeps the first 200 token ids
    (its step then costs less); a Draft's tokens, a tree's leaves too, stay within them,
    and the output is the target's generate(), as chains, trees and with SSD."""
    flags = ("--head", str(heads["random"]), "--draft-vocab", "200")
    with small_stack(test_models.target, test_models.target, *flags) as procs:
        with Client(procs["gateway"].address, timeout=120) as client:
            for text, options in zip(
                PROMPTS[:3],
                ({}, {"tree_width": 3, "k_policy": "fixed"}, {"ssd": True}),
                strict=True,
            ):
                ids = tokenizer(text).input_ids
                got = client.generate(token_ids=ids, max_new_tokens=N, k=3, **options)
                assert list(got.tokens) == reference(ids, N), (text, options)
                assert got.stats.draft_tokens > 0
        ids = tokenizer(PROMPTS[3]).input_ids
        drafted = await tree_draft(procs["drafter"], "heads/vocab", ids, 4, 4)
    assert len(drafted.draft_tokens) > 4
    kept = {*range(200), tokenizer.eos_token_id}  # the subset keeps EOS
    assert set(drafted.draft_tokens) <= kept, list(drafted.draft_tokens)


@pytest.mark.parametrize(("head", "low", "high"), [("exact", 0.95, 1.0), ("noisy", 0.2, 0.95)])
def test_a_head_that_copies_the_target_is_accepted(heads, tokenizer, head, low, high):
    """A one-layer target and a head whose layer is the target's and whose fc passes the
    token embedding through: its drafts are the target's tokens, accepted (nearly) all,
    and the output is the target's generate(). With noise on its layer and a feature half
    in its fc, some of its drafts are accepted and some not, and the output is the same."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(heads["target1"], dtype=torch.float32)
    with (
        small_stack(heads["target1"], heads["target1"], "--head", str(heads[head])) as procs,
        Client(procs["gateway"].address, timeout=120) as client,
    ):
        drafted = accepted = 0
        for text in PROMPTS[:3]:
            ids = tokenizer(text).input_ids
            with torch.inference_mode():
                want = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=N)
            got = client.generate(token_ids=ids, max_new_tokens=N, k=4)
            assert list(got.tokens) == want[0, len(ids) :].tolist(), text
            drafted += got.stats.draft_tokens
            accepted += got.stats.accepted_tokens
    assert drafted > 0 and low <= accepted / drafted <= high, (accepted, drafted)


async def test_what_is_not_built_says_so(head_stack, tokenizer):
    """The head drafter's Info names its features; features of another width or beyond the sequence
    INVALID_ARGUMENT; a Verify asking for a layer the target has not, or no format,
    INVALID_ARGUMENT."""
    d_channel, d_stub = stubs(head_stack["drafter"], "drafter")
    v_channel, v_stub = stubs(head_stack["verifier"], "verifier")
    drafter, verifier = GrpcTransport(d_stub), GrpcTransport(v_stub)
    ids = tokenizer(PROMPTS[3]).input_ids

    def draft(**fields):
        return drafter_pb2.DraftRequest(session_id="heads/refused", prefix=prefix(ids, 0),
                                        new_tokens=ids, num_draft_tokens=3, sampling=GREEDY,
                                        **fields)  # fmt: skip

    def features(width: int, start: int = 0, positions: int = 2):
        return common_pb2.Features(start=start, positions=positions, width=width, format=F32,
                                   data=bytes(4 * width * positions))  # fmt: skip

    refused = [
        (drafter, Method.DRAFT, draft(features=[features(32)]),
         grpc.StatusCode.INVALID_ARGUMENT, "features: width 32, the head reads 64"),
        (drafter, Method.DRAFT, draft(features=[features(WIDTH, start=len(ids) - 1)]),
         grpc.StatusCode.INVALID_ARGUMENT, "beyond the sequence"),
        (verifier, Method.VERIFY,
         verifier_pb2.VerifyRequest(session_id="heads/v", prefix=prefix(ids, 0), new_tokens=ids,
                                    sampling=GREEDY,
                                    features=common_pb2.FeatureRequest(layers=[3], format=F32)),
         grpc.StatusCode.INVALID_ARGUMENT, "outside the target's decoder layers [0, 3)"),
        (verifier, Method.VERIFY,
         verifier_pb2.VerifyRequest(session_id="heads/v", prefix=prefix(ids, 0), new_tokens=ids,
                                    sampling=GREEDY, features=common_pb2.FeatureRequest(layers=[2])),
         grpc.StatusCode.INVALID_ARGUMENT, "features.format 0 is not one of"),
    ]  # fmt: skip
    try:
        info = await d_stub.Info(common_pb2.InfoRequest(), timeout=30)
        assert info.features == LAST
        assert not (await v_stub.Info(common_pb2.InfoRequest(), timeout=30)).HasField("features")
        for transport, method, request, code, message in refused:
            with pytest.raises(CallFailed) as failed:
                await transport.call(method, request, 30)
            assert failed.value.code == code, failed.value.details
            assert message in failed.value.details
    finally:
        await d_channel.close()
        await v_channel.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--quantize", "int8"), "--head: --quantize is the draft model's"),
        (("--engine", "llama.cpp"), "--head: a head runs on the torch engines"),
        (("--compile",), "--head: --compile is not built for heads"),
    ],
)
def test_head_drafter_refuses_what_it_does_not_run(test_models, heads, flags, message):
    assert message in start_up_error(
        "drafter", test_models.target, "--head", str(heads["random"]), *flags
    )
