"""The speculation math: warping, draft-distribution encoding, exact rejection sampling.

Torch only: no gRPC, no protobuf. Everything here is the rule of DESIGN §2, written so
that drafter and verifier share one implementation:

1. The drafter samples draft tokens from its *warped* distributions (``warp``).
2. The verifier warps the target's logits the same way and calls ``rejection_sample``:
   accept draft token i with probability ``min(1, target_probs[i, d_i] / draft_probs[i, d_i])``;
   at the first rejection sample the *recovered* token from ``norm(max(0, target - draft))``;
   if every draft token is accepted, sample the *bonus* token from the last target row.
3. Greedy decoding (temperature 0) is the limit case: accept while the draft token equals
   the target's argmax; the next token is the target's argmax where they first differ.
4. A token tree (``tree_verdict``): at each accepted node its children are tried in order,
   each against the residual the earlier siblings left (recursive rejection sampling);
   the first accepted child is descended into; when every child is rejected the next token
   is drawn from the last residual. Greedy: the child that is the target's argmax.
   docs/concepts/speculation.md has the proof sketch.

The draft distribution travels with the draft as an ``EncodedProbs`` (sparse ids + fp32
probabilities when warping left few non-zero entries, dense fp16 otherwise). The drafter
samples from ``decode(encode(probs))``, so the verifier sees exactly the distribution each
draft token was drawn from, rounding included.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.common.params import SamplingParams

__all__ = [
    "EncodedProbs",
    "InvalidDistribution",
    "SamplingParams",
    "as_sent",
    "decode_probs",
    "encode_probs",
    "encoded_rows",
    "greedy_verdict",
    "make_generator",
    "proposal_payload",
    "rejection_sample",
    "round_trip",
    "sample_from",
    "tree_children",
    "tree_verdict",
    "truncate_proposal",
    "warp",
    "wire_entries",
]


def make_generator(
    seed: int | None, salt: str, position: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    """A torch.Generator for one sampling step.

    With a seed, the stream depends only on (seed, salt, position): a replayed round (after
    a cache miss or a failover) draws the same numbers, and the drafter ("draft") and the
    verifier ("verify") draw independent streams. Without a seed, fresh OS entropy.
    """
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        digest = hashlib.blake2b(f"{seed}:{salt}:{position}".encode(), digest_size=8).digest()
        gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return gen


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits -> sampling probabilities after temperature, top-k, top-p, min-p (transformers'
    order).

    logits: [..., vocab] (any float dtype). Returns fp32 probabilities [..., vocab].
    Greedy (temperature 0) returns the one-hot distribution of the argmax.
    """
    logits = logits.float()
    # SamplingParams sets every field (its unset ones to the neutral value).
    assert params.temperature is not None and params.top_k is not None
    assert params.top_p is not None and params.min_p is not None
    if params.greedy:
        return torch.nn.functional.one_hot(
            logits.argmax(dim=-1), num_classes=logits.shape[-1]
        ).float()
    scores = logits / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        # As transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p,
        # always keeping the most likely token.
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - params.top_p)
        remove_sorted[..., -1] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    if params.min_p > 0.0:
        # As transformers' MinPLogitsWarper: drop tokens less likely than min_p times the
        # most likely one (which always stays, min_p being at most 1).
        probs = scores.softmax(dim=-1)
        least = params.min_p * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < least, float("-inf"))
    return scores.softmax(dim=-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. probs: [..., vocab] -> tokens [...] (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


@dataclass(frozen=True)
class EncodedProbs:
    """One draft distribution as it travels: sparse (ids + fp32 probs) or dense (fp16).

    Exactly one of (token_ids, probs) or dense is set.
    token_ids: [n] int32, probs: [n] fp32; dense: [vocab] fp16.
    """

    token_ids: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    dense: torch.Tensor | None = None

    @property
    def is_sparse(self) -> bool:
        return self.dense is None


# Bytes per entry: sparse costs an int32 id + an fp32 prob, dense an fp16 per vocab entry.
_SPARSE_ENTRY_BYTES = 8
_DENSE_ENTRY_BYTES = 2


def encode_probs(probs: torch.Tensor) -> EncodedProbs:
    """Encode one distribution probs: [vocab] in whichever form is smaller on the wire."""
    assert probs.dim() == 1, f"expected [vocab], got {tuple(probs.shape)}"
    probs = probs.detach().float().cpu()
    nonzero = torch.nonzero(probs > 0, as_tuple=False).flatten()
    if nonzero.numel() * _SPARSE_ENTRY_BYTES < probs.numel() * _DENSE_ENTRY_BYTES:
        return EncodedProbs(token_ids=nonzero.to(torch.int32), probs=probs[nonzero])
    return EncodedProbs(dense=probs.to(torch.float16))


class InvalidDistribution(ValueError):
    """A draft distribution that cannot be a probability distribution over the vocabulary."""


# A decoded distribution's mass must be 1 within this tolerance (fp16 rounding of a dense
# vector of ~150k entries stays far inside it); anything else is a malformed request.
_MASS_TOLERANCE = 1e-2


def decode_probs(enc: EncodedProbs, vocab_size: int) -> torch.Tensor:
    """EncodedProbs -> normalised fp32 probabilities [vocab_size] on the CPU.

    Raises InvalidDistribution for ids outside the vocabulary, duplicate ids, negative or
    non-finite entries, or a total mass that is not 1.
    """
    if enc.is_sparse:
        ids, values = enc.token_ids, enc.probs
        assert ids is not None and values is not None
        if ids.numel() != values.numel():
            raise InvalidDistribution(
                f"sparse distribution has {ids.numel()} ids but {values.numel()} probabilities"
            )
        if ids.numel() == 0:
            raise InvalidDistribution("sparse distribution is empty")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise InvalidDistribution(
                f"sparse distribution has a token id outside [0, {vocab_size})"
            )
        if torch.unique(ids).numel() != ids.numel():
            raise InvalidDistribution("sparse distribution repeats a token id")
        out = torch.zeros(vocab_size, dtype=torch.float32)
        out[ids.long()] = values.float()
    else:
        assert enc.dense is not None
        if enc.dense.numel() != vocab_size:
            raise InvalidDistribution(
                f"dense distribution has {enc.dense.numel()} entries, vocabulary has {vocab_size}"
            )
        out = enc.dense.float()
    if not torch.isfinite(out).all() or (out < 0).any():
        raise InvalidDistribution("distribution has negative or non-finite entries")
    mass = float(out.sum())
    if abs(mass - 1.0) > _MASS_TOLERANCE:
        raise InvalidDistribution(f"distribution sums to {mass:.6f}, expected 1")
    return out / mass


def truncate_proposal(probs: torch.Tensor, max_entries: int, tail: float) -> torch.Tensor:
    """The drafter's proposal cut to its top entries: probs [..., vocab] -> [..., vocab].

    Keeps the fewest most likely tokens that hold at least 1 - tail of the mass, at most
    max_entries of them (0: no cut), and renormalises. Speculative decoding is exact for
    any proposal the draft token is really drawn from, so the drafter draws from the cut
    distribution and sends it: the output distribution is unchanged, the acceptance rate
    drops by at most the mass cut, and the wire carries max_entries sparse entries
    (8 bytes each) instead of a dense fp16 row over the vocabulary. Device operations
    only: nothing waits for the device.
    """
    if max_entries <= 0 or max_entries >= probs.shape[-1]:
        return probs
    values, ids = probs.topk(max_entries, dim=-1)  # [..., m], descending
    cumulative = values.cumsum(-1)
    need = (cumulative < (1.0 - tail) * probs.sum(-1, keepdim=True)).sum(-1, keepdim=True) + 1
    kept = torch.arange(max_entries, device=probs.device) < need.clamp(1, max_entries)
    out = torch.zeros_like(probs).scatter(-1, ids, values * kept)
    return out / out.sum(-1, keepdim=True)


def wire_entries(vocab: int, max_entries: int, top_k: int) -> int:
    """How many entries of a proposal travel sparse (ids + fp32 probabilities, 8 bytes
    each), or 0 when it travels dense (fp16, 2 bytes per vocabulary entry): sparse when
    the most entries it can have, known before drawing (the cut --draft-probs-max-entries
    and the request's top_k), cost less than a dense row."""
    bound = min([n for n in (max_entries, top_k) if n > 0], default=vocab)
    return bound if bound * _SPARSE_ENTRY_BYTES < vocab * _DENSE_ENTRY_BYTES else 0


def as_sent(proposal: torch.Tensor, entries: int) -> torch.Tensor:
    """The proposal [..., vocab] as the wire carries it, which is what the drafter samples
    from: sparse, its top `entries` entries unchanged (fp32; entries beyond, only ever
    ties at the cut, are dropped); dense (entries 0), rounded to fp16."""
    if not entries:
        return proposal.half().float()
    values, ids = proposal.topk(entries, dim=-1)
    return torch.zeros_like(proposal).scatter(-1, ids, values)


def proposal_payload(proposals: torch.Tensor, entries: int) -> tuple[torch.Tensor, ...]:
    """What of proposals [n, vocab] (as `as_sent` left them) travels, still on their device:
    sparse, the top `entries` (fp32 values [n, m], int32 ids [n, m]); dense, the rows in
    fp16 ([n, vocab]). Copy it to the host with the job's other results in one transfer
    (specdec.replica.host.to_host), then `encoded_rows`."""
    if entries:
        values, ids = proposals.topk(entries, dim=-1)
        return values, ids.to(torch.int32)
    return (proposals.half(),)


def one_hot_encoded(token: int) -> EncodedProbs:
    """The proposal of a draft token that was chosen, not drawn (a tree's alternative)."""
    return EncodedProbs(
        token_ids=torch.tensor([token], dtype=torch.int32),
        probs=torch.tensor([1.0], dtype=torch.float32),
    )


def encoded_rows(payload: Sequence[torch.Tensor]) -> list[EncodedProbs]:
    """A `proposal_payload` on the host -> one EncodedProbs per row (sparse: its non-zero
    entries, most likely first; dense: fp16)."""
    if len(payload) == 1:
        return [EncodedProbs(dense=row) for row in payload[0]]
    values, ids = payload
    return [
        EncodedProbs(token_ids=row_ids[row_values > 0], probs=row_values[row_values > 0])
        for row_values, row_ids in zip(values, ids, strict=True)
    ]


def round_trip(probs: torch.Tensor) -> tuple[EncodedProbs, torch.Tensor]:
    """Encode probs [vocab] and decode it back: what the drafter samples from.

    Returns (encoded, decoded [vocab] fp32 on probs' device).
    """
    enc = encode_probs(probs)
    return enc, decode_probs(enc, probs.shape[-1]).to(probs.device)


def greedy_verdict(draft_tokens: Sequence[int], choices: Sequence[int]) -> tuple[int, int]:
    """The rule under greedy decoding, on the host: accept draft tokens [k] while each is
    the target's choice at its position (choices [k+1]: the target's argmax after each
    prefix), then the target's choice. Returns (accepted_count, next_token): what
    `rejection_sample` returns with greedy=True, for one sequence whose argmaxes the
    caller copied to the host in one transfer."""
    accepted = next((i for i, d in enumerate(draft_tokens) if d != choices[i]), len(draft_tokens))
    return accepted, choices[accepted]


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """A tree's children lists: [k + 1] where entry 0 holds the root's children (parent -1)
    and entry i + 1 node i's, each in node order (the order siblings are tried)."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        children[parent + 1].append(i)
    return children


def tree_verdict(
    draft_tokens: Sequence[int],
    parents: Sequence[int],
    target: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
    greedy: bool,
) -> tuple[list[int], int]:
    """The rule on a token tree, for one sequence.

    draft_tokens [k], parents [k] (-1: a child of the root, else an earlier node).
    target [k+1, vocab]: row 0 the target after the root, row i + 1 after node i; warped
    probabilities (when greedy, any scores whose argmax is the target's token).
    draft_probs [k, vocab]: the distribution each node was drawn from given its path and
    its earlier siblings (ignored when greedy).
    Returns (accepted path: node indices root to leaf, next token).

    Sampling: at the current node with target distribution p, each child c (token x,
    proposal q) in order is accepted with probability min(1, p(x) / q(x)); on rejection p
    becomes norm(max(0, p - q)) for the next child. The first accepted child becomes the
    current node (p: its own target row); when every child is rejected the next token is
    drawn from p, the residual. Exact for any proposals (module docstring, 4).
    """
    children = tree_children(parents)
    path: list[int] = []
    row = 0  # target row of the current node
    if greedy:
        choices = target.argmax(dim=-1).tolist()
        while True:
            step = next((c for c in children[row] if draft_tokens[c] == choices[row]), None)
            if step is None:
                return path, choices[row]
            path.append(step)
            row = step + 1
    assert draft_probs is not None, "sampling needs the draft distributions"
    while True:
        p = target[row]
        step = None
        for child in children[row]:
            x = draft_tokens[child]
            q = draft_probs[child]
            u = torch.rand((), generator=generator, device=p.device)
            # u < p/q without a division; q(x) = 0 cannot have been drawn: rejected.
            if bool((u * q[x] < p[x]) & (q[x] > 0)):
                step = child
                break
            p = _residual(p, q)
        if step is None:
            return path, int(sample_from(p, generator))
        path.append(step)
        row = step + 1


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); p itself where that has no mass (p == q, which rejects only
    through rounding, and then p is the correct distribution)."""
    residual = (p - q).clamp_min(0)
    mass = residual.sum()
    return residual / mass if float(mass) > 0 else p


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verification rule of DESIGN §2, batched.

    draft_tokens: [B, k] int64 (k may be 0).
    draft_probs:  [B, k, vocab] fp32, the distributions the draft tokens were sampled from
                  (ignored, may be None, when greedy).
    target_probs: [B, k+1, vocab] fp32 warped target distributions (when greedy, any scores
                  whose argmax is the target's token: logits or one-hot probabilities).
    Returns (accepted_count [B] int64 in 0..k, next_token [B] int64): the output continues
    with draft_tokens[b, :accepted_count[b]] and then next_token[b] (recovered when
    accepted_count < k, bonus otherwise).
    """
    assert draft_tokens.dim() == 2, f"draft_tokens must be [B, k], got {tuple(draft_tokens.shape)}"
    batch, k = draft_tokens.shape
    assert target_probs.shape[:2] == (batch, k + 1), (
        f"target_probs must be [{batch}, {k + 1}, vocab], got {tuple(target_probs.shape)}"
    )
    device = target_probs.device
    draft_tokens = draft_tokens.to(device)
    arange_b = torch.arange(batch, device=device)

    if greedy:
        target_argmax = target_probs.argmax(dim=-1)  # [B, k+1]
        mismatch = draft_tokens != target_argmax[:, :k]  # [B, k]
        accepted = _first_true_or(mismatch, k)  # [B]
        return accepted, target_argmax[arange_b, accepted]

    assert draft_probs is not None and draft_probs.shape == (batch, k, target_probs.shape[-1]), (
        "draft_probs must be [B, k, vocab] matching target_probs"
    )
    draft_probs = draft_probs.to(device)
    if k == 0:
        return (
            torch.zeros(batch, dtype=torch.long, device=device),
            sample_from(target_probs[:, 0], generator),
        )

    idx = draft_tokens.unsqueeze(-1)  # [B, k, 1]
    p_draft = target_probs[:, :k].gather(-1, idx).squeeze(-1)  # [B, k]
    q_draft = draft_probs.gather(-1, idx).squeeze(-1)  # [B, k]
    uniform = torch.rand(batch, k, generator=generator, device=device)  # [B, k]
    # u < p/q without a division. A draft token with q = 0 cannot have been drawn from q;
    # it is rejected, which keeps the output exact even for such a malformed draft.
    accept = (uniform * q_draft < p_draft) & (q_draft > 0)  # [B, k]
    accepted = _first_true_or(~accept, k)  # [B]

    rejected_rows = accepted < k
    # Residual norm(max(0, p - q)) at the rejected position; bonus row p_{k+1} otherwise.
    pos = accepted.clamp(max=k - 1)
    residual = (target_probs[arange_b, pos] - draft_probs[arange_b, pos]).clamp_min(0)  # [B, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
    # p == q (mass 0) makes rejection impossible in exact arithmetic; with rounding it can
    # still happen, and then p itself is the correct distribution.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs[arange_b, pos])
    next_dist = torch.where(rejected_rows.unsqueeze(-1), residual, target_probs[:, k])  # [B, V]
    return accepted, sample_from(next_dist, generator)


def _first_true_or(mask: torch.Tensor, default: int) -> torch.Tensor:
    """Index of the first True in each row of mask [B, n], or `default` where none is True."""
    batch, n = mask.shape
    if n == 0:
        return torch.full((batch,), default, dtype=torch.long, device=mask.device)
    positions = torch.arange(n, device=mask.device).expand(batch, n)
    big = torch.full_like(positions, default)
    return torch.where(mask, positions, big).min(dim=-1).values
