"""How the drafter draws a token: shared by plain drafting and SSD branches.

Everything stays on the model's device: a drawn token is a device tensor that the next
forward takes as its input, and the distributions drawn from are kept as device rows.
The job that drew them copies tokens and distributions to the host once, at its end
(`payload`, specdec.replica.host.to_host, specdec.replica.sampling.encoded_rows), so no draw
makes the host wait for the device.
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.drafter.config import DrafterConfig
from specdec.replica.engine import Engine
from specdec.replica.processors import TokenCounts
from specdec.replica.sampling import (
    SamplingParams,
    as_sent,
    make_generator,
    proposal_payload,
    truncate_proposal,
    warp,
    wire_entries,
)

# Salt of the drafter's random stream (the verifier uses "verify").
DRAFT_SALT = "draft"


# Salt of a tree's continuations (specdec.drafter.proposer): their draws must not reuse a
# seeded draft token's at the same position, on which the tree's shape depends.
TREE_SALT = "draft-tree"


def sampler_for(
    params: SamplingParams,
    runtime: Engine[Any],
    counts: TokenCounts | None = None,
    salt: str = DRAFT_SALT,
) -> Sampler:
    """The Sampler of a drafter runtime, with its proposal cut (--draft-probs-*) and the
    request's logits processors over its rows (counts; None: none)."""
    cfg = runtime.config
    assert isinstance(cfg, DrafterConfig)  # a drafter's runtime has its config
    return Sampler(
        params, runtime.device, cfg.draft_probs_max_entries, cfg.draft_probs_tail, counts, salt
    )


class Sampler:
    """Draws draft tokens from logits rows: argmax under greedy, else a sample from the
    warped distribution, cut to its top entries and rounded as it travels (what the
    verifier receives is what the token was drawn from). With the request's logits
    processors (`counts`: the rows' token statistics), each row is processed first and
    the drawn tokens are counted for the next step."""

    def __init__(
        self,
        params: SamplingParams,
        device: torch.device,
        max_entries: int = 0,
        tail: float = 0.0,
        counts: TokenCounts | None = None,
        salt: str = DRAFT_SALT,
    ):
        self.params = params
        self.salt = salt
        self.counts = counts
        self.device = device
        # The proposal is cut to its top entries (truncate_proposal): 0 sends it whole.
        self.max_entries = max_entries
        self.tail = tail
        self.shared = (
            None
            if params.greedy or params.seed is not None
            else make_generator(None, salt, 0, device)
        )

    def draw(
        self, logits: torch.Tensor, positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row of logits [n, vocab], row i for sequence index positions[i]:
        (tokens [n] int64, the distributions they were drawn from [n, vocab] fp32, None
        under greedy), both on the device."""
        if self.counts is not None:
            logits = self.counts.process(logits, torch.tensor(positions, device=logits.device))
        token, proposal = self._draw(logits, positions)
        if self.counts is not None:
            self.counts.append(token)
        return token, proposal

    def _draw(
        self, logits: torch.Tensor, positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.params.greedy:
            return logits.argmax(dim=-1), None
        cut = truncate_proposal(warp(logits, self.params), self.max_entries, self.tail)
        proposal = as_sent(cut, self.entries(logits.shape[-1]))  # [n, vocab]
        if self.shared is not None:
            return torch.multinomial(proposal, 1, generator=self.shared)[:, 0], proposal
        rows = [  # a seeded stream per position: a replayed round draws the same tokens
            torch.multinomial(
                row, 1, generator=make_generator(self.params.seed, self.salt, p, self.device)
            )
            for row, p in zip(proposal, positions, strict=True)
        ]
        return torch.cat(rows), proposal

    def entries(self, vocab: int) -> int:
        """Entries of a distribution on the wire (0: dense), see sampling.wire_entries."""
        assert self.params.top_k is not None  # SamplingParams sets every field
        return wire_entries(vocab, self.max_entries, self.params.top_k)

    def payload(self, proposals: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The distributions drawn from ([n, vocab] rows on the device; none under greedy)
        as they travel, still on the device: copy it to the host with the job's tokens
        (specdec.replica.host.to_host), then `encoded_rows`."""
        if not proposals:
            return ()
        rows = torch.cat(proposals)
        return proposal_payload(rows, self.entries(rows.shape[-1]))
