"""Logits processors that keep speculation exact: one implementation of each, shared by the
drafter and the verifier (DESIGN §8). Torch only: no gRPC, no protobuf.

A request's processors (specdec.common.controls.Controls) run on raw logits before
warping (temperature, top-k, top-p: specdec.replica.sampling.warp), in this order:

1. ``logit_bias``: a constant added to the logits of some token ids (OpenAI).
2. ``min_tokens``: the ids of ``min_tokens_ids`` (EOS, stop token ids) get -inf while
   fewer than ``min_tokens`` tokens have been generated (vLLM's MinTokensLogitsProcessor,
   transformers' MinNewTokensLengthLogitsProcessor).
3. ``repetition_penalty`` over the whole sequence, prompt included (transformers'
   RepetitionPenaltyLogitsProcessor, as vLLM): a seen token's logit is divided by the
   penalty when positive, multiplied when negative.
4. ``frequency_penalty``: minus the penalty times the token's count in this request's
   output (OpenAI, vLLM).
5. ``presence_penalty``: minus the penalty for every token present in the output.

The distribution at a sequence position depends on every token before it. The verifier
scores k draft tokens at once, so row i of its [k+1, vocab] logits is processed with the
counts of the sequence *including d_1..d_i* (`verify_logits`, vectorised: the draft's
one-hot rows are summed cumulatively). The drafter processes each drafting step with the
tokens it has drawn so far (`TokenCounts`, on the device), for plain drafts and SSD's
branches alike; that only raises acceptance, as the verifier's rule is exact for any
proposal the draft was really drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.common.controls import Controls

__all__ = ["TokenCounts", "apply", "draft_position_logits", "verify_logits"]


class TokenCounts:
    """Per-row token statistics of n sequences that the processors need, on a device.

    output: [n, vocab] fp32 counts of each token in the row's output (from output_start),
    only when a presence or frequency penalty is set; seen: [n, vocab] bool, whether the
    token occurs anywhere in the row's sequence, only with a repetition penalty. A row's
    sequences share `common` (the tokens every row starts with) and then differ by `tails`.
    """

    def __init__(
        self,
        controls: Controls,
        common: Sequence[int],
        tails: Sequence[Sequence[int]],
        vocab: int,
        device: torch.device | str,
    ):
        self.controls = controls
        self.vocab = vocab
        self.device = device
        rows = len(tails)
        self.output: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        start = controls.output_start
        skip = max(0, start - len(common))  # tail tokens before the output start
        if controls.counts_output:
            base = _bincount(common[start:], vocab, device)  # [vocab]
            self.output = base.expand(rows, vocab).clone()
            for r, tail in enumerate(tails):
                if len(tail) > skip:
                    self.output[r] += _bincount(tail[skip:], vocab, device)
        if controls.repetition_penalty != 1.0:
            base = _bincount(common, vocab, device) > 0
            self.seen = base.expand(rows, vocab).clone()
            for r, tail in enumerate(tails):
                if len(tail):
                    self.seen[r] |= _bincount(tail, vocab, device) > 0

    def append(self, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """One more token per row (tokens [n] int64 on the device, all of them output);
        keep [n] bool: only the rows where it is True take theirs (None: every row)."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        if keep is not None:
            rows, tokens = rows[keep], tokens[keep]
        if self.output is not None:
            self.output[rows, tokens] += 1.0
        if self.seen is not None:
            self.seen[rows, tokens] = True

    def clone(self) -> TokenCounts:
        """An independent copy (the same rows and counts)."""
        copy = object.__new__(TokenCounts)
        copy.__dict__.update(self.__dict__)
        copy.output = None if self.output is None else self.output.clone()
        copy.seen = None if self.seen is None else self.seen.clone()
        return copy

    def process(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The processed logits [n, vocab] fp32 of logits [n, vocab] for rows whose next token
        is at sequence index positions [n]."""
        return apply(self.controls, logits, positions, self.output, self.seen)


def apply(
    controls: Controls,
    logits: torch.Tensor,
    positions: torch.Tensor,
    output_counts: torch.Tensor | None,
    seen: torch.Tensor | None,
) -> torch.Tensor:
    """The processors on logits [n, vocab]: a new fp32 tensor [n, vocab].

    positions: [n] sequence index of the token each row predicts (for min_tokens).
    output_counts: [n, vocab] token counts of each row's output (needed with a presence or
    frequency penalty); seen: [n, vocab] bool, tokens present in each row's whole sequence
    (needed with a repetition penalty).
    """
    assert logits.dim() == 2, f"logits must be [n, vocab], got {tuple(logits.shape)}"
    out = logits.float().clone()
    vocab = out.shape[-1]
    if controls.logit_bias:
        ids = torch.tensor([t for t, _ in controls.logit_bias], device=out.device)
        bias = torch.tensor([b for _, b in controls.logit_bias], device=out.device)
        out[:, ids] += bias
    if controls.min_tokens and controls.min_tokens_ids:
        early = (positions.to(out.device) - controls.output_start) < controls.min_tokens  # [n]
        masked = torch.zeros(vocab, dtype=torch.bool, device=out.device)
        masked[list(controls.min_tokens_ids)] = True
        out = out.masked_fill(early[:, None] & masked[None, :], float("-inf"))
    if controls.repetition_penalty != 1.0:
        assert seen is not None, "a repetition penalty needs the seen tokens"
        rp = controls.repetition_penalty
        out = torch.where(seen, torch.where(out < 0, out * rp, out / rp), out)
    if controls.frequency_penalty:
        assert output_counts is not None, "a frequency penalty needs the output counts"
        out = out - controls.frequency_penalty * output_counts
    if controls.presence_penalty:
        assert output_counts is not None, "a presence penalty needs the output counts"
        out = out - controls.presence_penalty * (output_counts > 0).float()
    return out


def verify_logits(
    controls: Controls | None,
    sequence: Sequence[int],
    draft: Sequence[int],
    logits: torch.Tensor,
) -> torch.Tensor:
    """The target's processed logits at the k+1 positions of a Verify: [k+1, vocab] fp32.

    sequence: the session's tokens before the draft (length L); draft: d_1..d_k; logits
    [k+1, vocab]: row i is the raw distribution of the token at index L + i, after
    sequence + d_1..d_i (`draft_position_logits` for one sequence). Without processors the
    logits come back as they are. (Also the drafter's ranking of SSD outcomes, on its own
    rows.)
    """
    k = len(draft)
    assert logits.shape[0] == k + 1, f"logits must be [{k + 1}, vocab], got {tuple(logits.shape)}"
    if controls is None:
        return logits
    vocab, device = logits.shape[-1], logits.device
    counts = TokenCounts(controls, sequence, [()], vocab, device)  # 1 row: the prefix
    drafts = torch.tensor([list(draft)], dtype=torch.long, device=device).view(1, k)
    lengths = torch.tensor([len(sequence)], device=device)
    return draft_position_logits(counts, drafts, logits[None], lengths)[0]


def draft_position_logits(
    counts: TokenCounts, drafts: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Processed logits [n, k+1, vocab] fp32 at the draft positions of n sequences.

    counts: the statistics of each sequence before its draft (n rows); drafts [n, k];
    logits [n, k+1, vocab], row i of sequence b the raw distribution after its first
    lengths[b] tokens + d_1..d_i. Row i is processed with the counts of exactly that
    prefix: the sequence's counts plus the cumulative one-hot sum of d_1..d_i (the draft
    tokens are output: each sequence's output starts at or before its draft).
    """
    n, k = drafts.shape
    vocab, device = logits.shape[-1], logits.device
    assert logits.shape == (n, k + 1, vocab), f"logits must be [{n}, {k + 1}, vocab]"
    drafted = torch.zeros(n, k + 1, vocab, device=device)  # [n, k+1, vocab]
    if k:
        onehot = torch.nn.functional.one_hot(drafts.to(device), vocab).float()  # [n, k, vocab]
        drafted[:, 1:] = onehot.cumsum(1)
    output = seen = None
    if counts.output is not None:
        output = (counts.output[:, None] + drafted).reshape(n * (k + 1), vocab)
    if counts.seen is not None:
        seen = (counts.seen[:, None] | (drafted > 0)).reshape(n * (k + 1), vocab)
    positions = (lengths.to(device)[:, None] + torch.arange(k + 1, device=device)).reshape(-1)
    flat = apply(counts.controls, logits.reshape(n * (k + 1), vocab), positions, output, seen)
    return flat.reshape(n, k + 1, vocab)


def _bincount(tokens: Sequence[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """Counts [vocab] fp32 of tokens (ids in [0, vocab)) on device."""
    if not len(tokens):
        return torch.zeros(vocab, device=device)
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    assert int(ids.min()) >= 0, "token ids must be known (no UNKNOWN_TOKEN) and >= 0"
    return torch.bincount(ids, minlength=vocab)[:vocab].float().to(device)
