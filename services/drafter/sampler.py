"""How the drafter draws a token: shared by plain drafting and SSD branches."""

from __future__ import annotations

import torch

from specdec.common.sampling import (
    EncodedProbs,
    SamplingParams,
    make_generator,
    round_trip,
    truncate_proposal,
    warp,
)

# Salt of the drafter's random stream (the verifier uses "verify").
DRAFT_SALT = "draft"


def sampler_for(params: SamplingParams, runtime) -> Sampler:
    """The Sampler of a drafter runtime, with its proposal cut (--draft-probs-*)."""
    cfg = runtime.config  # a DrafterConfig
    return Sampler(params, runtime.device, cfg.draft_probs_max_entries, cfg.draft_probs_tail)


class Sampler:
    """Draws draft tokens from logits rows: argmax under greedy, else a sample from the
    encoded-and-decoded warped distribution (what travels is what was sampled from)."""

    def __init__(
        self,
        params: SamplingParams,
        device: torch.device,
        max_entries: int = 0,
        tail: float = 0.0,
    ):
        self.params = params
        self.device = device
        # The proposal is cut to its top entries (truncate_proposal): 0 sends it whole.
        self.max_entries = max_entries
        self.tail = tail
        self.shared = (
            None
            if params.greedy or params.seed is not None
            else make_generator(None, DRAFT_SALT, 0, device)
        )

    def draw(self, logits: torch.Tensor, position: int) -> tuple[int, EncodedProbs | None]:
        """One token for sequence index `position` from logits [vocab]."""
        if self.params.greedy:
            return int(logits.argmax()), None
        proposal = truncate_proposal(warp(logits, self.params), self.max_entries, self.tail)
        enc, probs = round_trip(proposal)
        gen = self.shared or make_generator(self.params.seed, DRAFT_SALT, position, self.device)
        return int(torch.multinomial(probs, 1, generator=gen)), enc
