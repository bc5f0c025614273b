"""Grammar masks on the target's logits (structured output): torch only, no gRPC.

A structured generation's gateway sends, with each Verify, the tokens its grammar allows at
every verified position (specdec.gateway.round.grammar). The verifier turns them into one boolean
tensor and sets the forbidden logits to -inf before warping (temperature, top-k, top-p) and
before the greedy argmax, so the rule of DESIGN §2 runs on the constrained target
distribution at every position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["InvalidMask", "apply_masks", "decode_mask", "stack_masks"]


class InvalidMask(ValueError):
    """A grammar mask that cannot apply to this vocabulary."""


_BITS = torch.arange(8, dtype=torch.uint8)  # [8]


def decode_mask(bits: bytes, ids: Sequence[int], vocab_size: int) -> torch.Tensor | None:
    """One position's mask: bits (a bitset, token t at bit t % 8 of byte t / 8,
    ceil(vocab/8) bytes) or ids (the allowed ids); neither: None (every token allowed).
    Returns [vocab_size] bool, True where allowed. Raises InvalidMask."""
    if bits and ids:
        raise InvalidMask("a grammar mask sets both allowed_bits and allowed_ids")
    if bits:
        if len(bits) != (vocab_size + 7) // 8:
            raise InvalidMask(
                f"grammar mask of {len(bits)} bytes; the vocabulary of {vocab_size} needs "
                f"{(vocab_size + 7) // 8}"
            )
        packed = torch.frombuffer(bytearray(bits), dtype=torch.uint8)  # [vocab/8]
        allowed = ((packed[:, None] >> _BITS) & 1).bool().flatten()[:vocab_size]
    elif ids:
        index = torch.tensor(list(ids), dtype=torch.long)
        if int(index.min()) < 0 or int(index.max()) >= vocab_size:
            raise InvalidMask(f"grammar mask allows a token id outside [0, {vocab_size})")
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        allowed[index] = True
    else:
        return None
    if not allowed.any():
        raise InvalidMask("grammar mask allows no token")
    return allowed


def stack_masks(masks: Sequence[torch.Tensor | None], vocab_size: int) -> torch.Tensor:
    """Per-position masks (None: unconstrained) -> [n, vocab] bool."""
    everything = torch.ones(vocab_size, dtype=torch.bool)
    return torch.stack([everything if m is None else m for m in masks])


def apply_masks(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits [n, vocab] with the tokens allowed [n, vocab] (bool) kept and the rest -inf
    (a new tensor; logits unchanged). None: logits as they are."""
    if allowed is None:
        return logits
    assert allowed.shape == logits.shape, (
        f"masks {tuple(allowed.shape)} do not match logits {tuple(logits.shape)}"
    )
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
