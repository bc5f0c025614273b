"""The target's log-probabilities of tokens (`logprobs`, `top_logprobs`, `echo`): torch only.

What vLLM reports by default: log_softmax of the logits after the request's logits
processors and before temperature, top-k and top-p. The verifier computes them from the
logits [rows, vocab] its Verify already has (one row per verified position), for the tokens
the round emits, so every reported value is the target's own: accepted drafts and the next
token alike come out of a Verify. A caller that processes the logits (penalties, bias,
masks) passes the processed ones.

Everything stays on the device: the results join the Verify's one copy to the host
(specdec.replica.host.to_host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.common.params import MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class LogprobsAsk:
    """What a Verify asks for: the emitted tokens' scores with `top` alternatives each, and
    with `prompt` also the scores of its new tokens after the first."""

    top: int = 0
    prompt: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top}")


@dataclass(frozen=True)
class LogprobRows:
    """Scores of one token per row: its log-probability and the row's `top` best."""

    chosen: torch.Tensor  # [rows] fp32
    top_ids: torch.Tensor  # [rows, top] int64, most likely first
    top_values: torch.Tensor  # [rows, top] fp32

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.chosen, self.top_ids, self.top_values

    def head(self, rows: int) -> LogprobRows:
        return LogprobRows(self.chosen[:rows], self.top_ids[:rows], self.top_values[:rows])


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> LogprobRows:
    """The log-probability of tokens[i] under logits[i], and the `top` most likely tokens
    of each row with theirs.

    logits: [rows, vocab] (any float dtype; scored in fp32). tokens: [rows] int64 on the
    same device. Nothing is copied to the host.
    """
    assert logits.dim() == 2 and tokens.shape == logits.shape[:1], (
        f"logits [rows, vocab] and tokens [rows], got {tuple(logits.shape)} and "
        f"{tuple(tokens.shape)}"
    )
    lp = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    chosen = lp.gather(-1, tokens.view(-1, 1)).squeeze(-1)  # [rows]
    if top:
        values, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)  # sorted, most likely first
    else:
        values = lp.new_empty((lp.shape[0], 0))
        ids = tokens.new_empty((lp.shape[0], 0))
    return LogprobRows(chosen, ids, values)


def emitted_tokens(
    drafts: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor
) -> torch.Tensor:
    """The tokens a round emits, padded to k+1 rows, without leaving the device: drafts
    [k] then, at row `accepted`, next_token (rows after it repeat drafts and are dropped
    once the count is on the host). accepted, next_token: [1] int64."""
    tokens = torch.cat([drafts, next_token])  # [k+1]
    return tokens.scatter(0, accepted, next_token)
