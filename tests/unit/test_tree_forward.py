"""A token tree's forward (ModelRuntime._forward_tree, and a tree row in a batched forward
on the dense and paged engines) and the accepted path's cache
(SessionStore.keep_path, specdec.replica.kvstore and paged) against plain chain forwards of each path, fp32."""

from __future__ import annotations

import pytest
import torch

from specdec.common.errors import InvalidRequest
from specdec.common.prefix import prefix_hash
from specdec.replica.batching import ForwardRequest
from specdec.replica.engine import Prefix
from specdec.replica.sampling import SamplingParams
from specdec.v1 import verifier_pb2
from specdec.verifier.scorer import VerifyCall, verify
from specdec.verifier.server import tree_parents
from tests.unit import test_paged, test_runtime

full_logits = test_runtime.full_logits
runtime_fixture = test_runtime.runtime  # the fixture "runtime", shared with that module
engines = test_paged.engines  # the dense and paged runtimes (blocks of 4)

PARENTS = [-1, 0, 1, -1, 3, 0, -1]  # three branches at the root, two under node 0
NODES = [40, 41, 42, 50, 51, 43, 60]
PROMPT = list(range(20, 36))


def path_to(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = PARENTS[node]
    return path[::-1]


def test_each_node_scored_as_its_path_alone(runtime_fixture):
    rt = runtime_fixture
    session, _ = rt.extend("t", Prefix(0, prefix_hash([])), PROMPT[:10], 30)
    new = PROMPT[10:]
    logits = rt.drive(rt.forward_steps(session, [*new, *NODES], keep=len(NODES) + 1, tree=PARENTS))
    torch.testing.assert_close(logits[0], full_logits(rt, PROMPT)[-1], atol=1e-4, rtol=1e-4)
    for node in range(len(NODES)):
        chain = [*PROMPT, *(NODES[i] for i in path_to(node))]
        torch.testing.assert_close(
            logits[node + 1], full_logits(rt, chain)[-1], atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize("target_path", [[3, 4], [0, 5], [0, 1, 2], [6], []])
def test_greedy_tree_keeps_the_accepted_path(runtime_fixture, target_path):
    """A tree whose nodes on target_path are the target's argmaxes (the rest are not):
    the verdict is that path, and the cache then continues exactly as the chain's."""
    rt = runtime_fixture
    session_id = f"g{target_path}"
    ref = full_logits(rt, PROMPT)[-1].argmax().item()
    nodes, parents, seq = list(NODES), list(PARENTS), list(PROMPT)
    # Rewrite the tree so the target's argmax continues along target_path only.
    for node in target_path:
        nodes[node] = ref
        seq.append(ref)
        ref = full_logits(rt, seq)[-1].argmax().item()
    for node in range(len(nodes)):  # every other node: a token the target does not pick
        if node not in target_path:
            parent = parents[node]
            on = parent == -1 or parent in target_path
            if on and nodes[node] in [nodes[n] for n in target_path]:
                nodes[node] = (nodes[node] + 1) % 100
    job = verify(
        VerifyCall(
            rt,
            session_id,
            Prefix(0, prefix_hash([])),
            PROMPT,
            nodes,
            None,
            SamplingParams(temperature=0.0),
            draft_parents=parents,
        )
    )
    verdict = rt.drive(job)
    expected = _greedy_walk(rt, nodes, parents)
    assert verdict.path == expected[0] == target_path and verdict.next_token == expected[1]
    accepted = [nodes[i] for i in verdict.path]
    session = rt.store._sessions[session_id]
    assert session.tokens == [*PROMPT, *accepted]
    # The kept cache continues as a fresh forward of the accepted sequence.
    more = rt.forward(session, [verdict.next_token, 7])
    torch.testing.assert_close(
        more,
        full_logits(rt, [*PROMPT, *accepted, verdict.next_token, 7])[-2:],
        atol=1e-4,
        rtol=1e-4,
    )


def _greedy_walk(rt, nodes, parents):
    """The longest argmax path by plain forwards."""
    seq, path, at = list(PROMPT), [], -1
    while True:
        best = full_logits(rt, seq)[-1].argmax().item()
        step = next((i for i, p in enumerate(parents) if p == at and nodes[i] == best), None)
        if step is None:
            return path, best
        path.append(step)
        seq.append(nodes[step])
        at = step


@pytest.mark.parametrize(
    "parents, k, message",
    [
        ([-1, 0], 3, "2 entries for 3 draft tokens"),
        ([-1, 1], 2, r"draft_parents\[1\] is 1"),
        ([0], 1, r"draft_parents\[0\] is 0"),
        ([-1, -2], 2, r"draft_parents\[1\] is -2"),
    ],
)
def test_bad_parents_are_invalid(parents, k, message):
    request = verifier_pb2.VerifyRequest(draft_tokens=[1] * k, draft_parents=parents)
    with pytest.raises(InvalidRequest, match=message):
        tree_parents(request, k)


def test_parents_of_a_tree_and_of_a_chain():
    assert tree_parents(verifier_pb2.VerifyRequest(draft_parents=[-1, 0, -1]), 3) == [-1, 0, -1]
    assert tree_parents(verifier_pb2.VerifyRequest(), 3) is None


@pytest.mark.parametrize("engine", ["dense", "paged"])
def test_tree_row_in_a_batch_and_its_path_kept(engines, engine):
    """A tree row batched with a chain row (the padded forward's 4D mask; the paged engine
    reads and writes blocks of 4): every node scored as its path alone, the chain row as
    a plain forward; then a tree verified on that engine keeps its accepted path, and the
    cache continues as the chain's."""
    rt = engines[engine]
    a = rt.store.acquire("batch/a", 0, 0, 20)
    b = rt.store.acquire("batch/b", 0, 0, 40)
    rt.forward(a, PROMPT[:5])
    rt.forward(b, PROMPT[:10])
    chain, tree = rt._run_batch(
        [
            ForwardRequest(a, PROMPT[5:8], 3, False),
            ForwardRequest(b, [*PROMPT[10:], *NODES], len(NODES) + 1, False, list(PARENTS)),
        ]
    )
    torch.testing.assert_close(chain, full_logits(rt, PROMPT[:8])[-3:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tree[0], full_logits(rt, PROMPT)[-1], atol=1e-4, rtol=1e-4)
    for node in range(len(NODES)):
        path = [*PROMPT, *(NODES[i] for i in path_to(node))]
        torch.testing.assert_close(tree[node + 1], full_logits(rt, path)[-1], atol=1e-4, rtol=1e-4)
    # A tree whose argmax path is [3, 4] on this engine: only that path's cache stays.
    nodes, seq = list(NODES), list(PROMPT)
    for node in (3, 4):
        nodes[node] = full_logits(rt, seq)[-1].argmax().item()
        seq.append(nodes[node])
    for node in (0, 6):  # the root's other children: not the argmax
        if nodes[node] == nodes[3]:
            nodes[node] = (nodes[node] + 1) % 100
    job = verify(VerifyCall(
        rt, "batch/v", Prefix(0, prefix_hash([])), PROMPT, nodes, None,
        SamplingParams(temperature=0.0), draft_parents=list(PARENTS),
    ))  # fmt: skip
    verdict = rt.drive(job)
    assert verdict.path[:2] == [3, 4]
    session = rt.store._sessions["batch/v"]
    kept = [nodes[i] for i in verdict.path]
    assert session.tokens == [*PROMPT, *kept]
    more = rt.forward(session, [verdict.next_token, 7])
    torch.testing.assert_close(
        more, full_logits(rt, [*PROMPT, *kept, verdict.next_token, 7])[-2:], atol=1e-4, rtol=1e-4
    )
    for name in ("batch/a", "batch/b", "batch/v"):
        rt.release(name)
