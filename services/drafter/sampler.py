"""How the drafter draws a token: shared by plain drafting and SSD branches."""

from __future__ import annotations

import torch

from specdec.common.sampling import EncodedProbs, SamplingParams, make_generator, round_trip, warp

# Salt of the drafter's random stream (the verifier uses "verify").
DRAFT_SALT = "draft"


class Sampler:
    """Draws draft tokens from logits rows: argmax under greedy, else a sample from the
    encoded-and-decoded warped distribution (what travels is what was sampled from)."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.device = device
        self.shared = (
            None
            if params.greedy or params.seed is not None
            else make_generator(None, DRAFT_SALT, 0, device)
        )

    def draw(self, logits: torch.Tensor, position: int) -> tuple[int, EncodedProbs | None]:
        """One token for sequence index `position` from logits [vocab]."""
        if self.params.greedy:
            return int(logits.argmax()), None
        enc, probs = round_trip(warp(logits, self.params))
        gen = self.shared or make_generator(self.params.seed, DRAFT_SALT, position, self.device)
        return int(torch.multinomial(probs, 1, generator=gen)), enc
