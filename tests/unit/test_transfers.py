"""Copies from the device to the host in a round's model calls (issue 20, item 3).

On a GPU every read of a tensor's values on the host (`.item()`, `.tolist()`, `.cpu()`,
`int(t)`, ...) waits for everything queued on the device: the host stops feeding it.
Each call of the round therefore copies its results once, at its end
(specdec.replica.host.to_host): a Verify one copy, a Draft one (its k tokens and, when
sampling, their distributions), a Speculate two (its ranking of outcomes, then its
branches). `TransferCounter` stands in for a device: it counts to_host's copies and every
other read of tensor values on the host, on tensors to_host did not return. The models
are the stand-ins of specdec.tools.bench.standin_model (no sync of their own), loaded
through the real from_pretrained path. A counter, not a clock: adding a per-step or
per-round `.item()` to the hot path fails here whatever the machine."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specdec.common.params import SamplingParams
from specdec.common.prefix import PrefixChain
from specdec.drafter.config import DrafterConfig
from specdec.drafter.proposer import DraftCall, propose
from specdec.drafter.runtime import DrafterRuntime
from specdec.drafter.speculate import BranchStore, SpeculateCall, speculate
from specdec.replica import host
from specdec.replica.batching import BranchStep
from specdec.replica.engine import Prefix
from specdec.replica.logprobs import LogprobsAsk
from specdec.replica.runtime import ModelRuntime
from specdec.replica.sampling import decode_probs
from specdec.tools.bench.standin import build_standins
from specdec.verifier.config import VerifierConfig
from specdec.verifier.scorer import VerifyCall, verify

# Reads of a tensor's values on the host: each waits for the device.
SYNCS = {
    "item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__",
    "__complex__", "nonzero",
}  # fmt: skip


class TransferCounter(TorchFunctionMode):
    """Counts device-to-host transfers: to_host's copies, and host reads of any tensor
    to_host did not return (`to(cpu)` included)."""

    def __init__(self):
        super().__init__()
        self.copies = 0
        self.reads: list[str] = []
        self._host: set[int] = set()  # ids of to_host's results, kept alive below
        self._keep: list[torch.Tensor] = []

    def _copied(self, tensors):
        self.copies += 1
        self._keep += tensors
        self._host.update(id(t) for t in tensors)

    def __enter__(self):
        host.observer = self._copied
        return super().__enter__()

    def __exit__(self, *exc):
        host.observer = None
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        this = args[0] if args and isinstance(args[0], torch.Tensor) else None
        # .to("cpu") written out; .to(device) is a copy onto the model's device (the CPU
        # here, so the two cannot be told apart by the device alone).
        to_cpu = name == "to" and "cpu" in (*args[1:], *kwargs.values())
        if this is not None and (name in SYNCS or to_cpu) and id(this) not in self._host:
            self.reads.append(name)
        return func(*args, **kwargs)

    @property
    def transfers(self) -> int:
        return self.copies + len(self.reads)


GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, seed=7)
PROMPT = [5, 17, 42, 8, 99, 23]


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory):
    models = build_standins(tmp_path_factory.mktemp("standins"), 0.0, 0.0, acceptance=0.75)
    common = dict(trust_remote_code=True, threads=1)
    drafter = DrafterRuntime(DrafterConfig(role="drafter", model=str(models.draft), **common))
    verifier = ModelRuntime(VerifierConfig(role="verifier", model=str(models.target), **common))
    for rt in (drafter, verifier):
        rt.load()
        rt.shutdown()  # driven here, not on the model thread
    return drafter, verifier


def counted(run):
    with TransferCounter() as counter:
        result = run()
    return result, counter


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_verify_copies_once(runtimes, params, k):
    drafter, verifier = runtimes
    session = f"v/{k}/{params.greedy}"
    draft = (
        propose(DraftCall(drafter, BranchStore(), session, Prefix(0, 0), PROMPT, k, params))
        if k
        else None
    )
    drafted = drafter.drive(draft) if k else None
    tokens = drafted.tokens if k else []
    probs = None
    if not params.greedy:  # what the verifier's servicer decodes (empty for k = 0)
        rows = [decode_probs(e, verifier.vocab_size) for e in drafted.probs] if k else []
        probs = torch.stack(rows) if rows else torch.empty(0, verifier.vocab_size)
    job = verify(VerifyCall(verifier, session, Prefix(0, 0), PROMPT, tokens, probs, params))
    verdict, counter = counted(lambda: verifier.drive(job))
    assert 0 <= verdict.accepted <= k
    assert counter.transfers == 1, counter.reads
    # Scores (logprobs, top_logprobs, the prompt's) travel in the same copy.
    ask = LogprobsAsk(top=3, prompt=True)
    job = verify(
        VerifyCall(
            verifier, session + "/lp", Prefix(0, 0), PROMPT, tokens, probs, params, logprobs=ask
        )
    )
    scored, counter = counted(lambda: verifier.drive(job))
    assert scored.logprobs.chosen.shape == (scored.accepted + 1,)
    assert scored.prompt_logprobs.top_ids.shape == (len(PROMPT) - 1, 3)
    assert counter.transfers == 1, counter.reads


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_draft_copies_once_whatever_k(runtimes, params, k):
    drafter, _ = runtimes
    session = f"d/{k}/{params.greedy}"
    job = propose(DraftCall(drafter, BranchStore(), session, Prefix(0, 0), PROMPT, k, params))
    draft, counter = counted(lambda: drafter.drive(job))
    assert len(draft.tokens) == k and len(draft.probs) == (0 if params.greedy else k)
    assert counter.transfers == 1, counter.reads
    # The device tokens it fed are known on the host once the Draft has ended.
    cached = drafter.store.tokens(session)
    assert cached == [*PROMPT, *draft.tokens[: k - 1]]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_speculate_copies_twice(runtimes, params):
    """Its ranking of outcomes, then its branches: two copies, whatever the fan-out and
    the branches' length."""
    drafter, _ = runtimes
    session, store, k = f"s/{params.greedy}", BranchStore(), 4
    draft = drafter.drive(
        propose(DraftCall(drafter, store, session, Prefix(0, 0), PROMPT, k, params))
    )
    seq = [*PROMPT, *draft.tokens]
    n = draft.cached_length
    prefix = Prefix(n, PrefixChain().hash(seq, n))
    job = speculate(
        SpeculateCall(drafter, store, session, prefix, seq[n:], k, 4, params, 6, 0.7, 3)
    )
    result, counter = counted(lambda: drafter.drive(job))
    assert len(result.branches) == 6 and all(len(b.tokens) == 4 for b in result.branches)
    assert counter.transfers == 2, counter.reads


def test_batched_draft_steps_take_device_tokens(runtimes):
    """Two sessions' Drafts stepped in lock-step through batched forwards (what the model
    thread's scheduler does): still one copy each, and the same drafts as alone."""
    drafter, _ = runtimes
    alone = [
        drafter.drive(
            propose(DraftCall(drafter, BranchStore(), f"b/alone/{i}", Prefix(0, 0), p, 4, GREEDY))
        )
        for i, p in enumerate((PROMPT, PROMPT[:4]))
    ]
    jobs = [
        propose(DraftCall(drafter, BranchStore(), f"b/batch/{i}", Prefix(0, 0), p, 4, GREEDY))
        for i, p in enumerate((PROMPT, PROMPT[:4]))
    ]
    with TransferCounter() as counter:
        requests = [next(j) for j in jobs]
        results: list = [None, None]
        while any(r is not None for r in requests):
            live = [i for i, r in enumerate(requests) if r is not None]
            logits = drafter._forward_batch([requests[i] for i in live])
            for i, out in zip(live, logits, strict=True):
                try:
                    requests[i] = jobs[i].send(out)
                except StopIteration as stop:
                    requests[i], results[i] = None, stop.value
    assert [r.tokens for r in results] == [a.tokens for a in alone]
    assert counter.transfers == 2, counter.reads  # one per Draft
    assert not isinstance(requests, BranchStep)


def test_packed_copy_is_bit_exact():
    """to_host's one copy from a device packs every result's bytes into one buffer and
    unpacks them on the host (each 8-byte aligned): dtypes, shapes and values survive,
    odd sizes and 0-d tensors included. On a CPU-only machine to_host never packs, so the
    packing is run here with a plain copy in place of the transfer."""
    tensors = [
        torch.tensor([1.5, -2.25, 3.0]),
        torch.tensor([[3, 4, 5]], dtype=torch.int32),
        torch.tensor(7),
        torch.tensor([True, False, True]),
        torch.tensor([0.1, 65504.0], dtype=torch.float16),
        torch.arange(12, dtype=torch.int64).reshape(3, 4)[:, 1:],  # not contiguous
    ]
    copies = []
    out = host.packed_copy(tensors, lambda buffer: copies.append(buffer) or buffer.clone())
    assert len(copies) == 1  # one transfer
    for got, want in zip(out, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
