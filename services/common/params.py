"""Sampling parameters: one validated, torch-free type for the gateway and the replicas."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.common.errors import InvalidRequest
from specdec.v1 import common_pb2

# Largest accepted top_k; larger values behave like 0 (no filter) and are most likely a
# client bug, so they are refused rather than silently clamped.
MAX_TOP_K = 1 << 20

# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS): logits / 1e-40 overflows to
# inf, and such a distribution is a one-hot argmax to every digit fp32 can hold anyway.
GREEDY_BELOW = 1e-5

# Largest top_logprobs a request may ask for (OpenAI's chat limit; vLLM's default): the
# gateway's request limit and the verifier's (specdec.replica.logprobs).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters (the same on drafter and verifier).

    temperature: 0 (anything below GREEDY_BELOW) = greedy. top_p in (0, 1]. top_k: 0 = off. seed: None = fresh entropy.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Proto sampling -> SamplingParams (InvalidRequest when a value is out of range).

    top_p 0 reads as unset (1.0), as proto3 cannot tell 0 from absent.
    """
    try:
        return SamplingParams(
            temperature=float(msg.temperature),
            top_p=float(msg.top_p) if msg.top_p != 0 else 1.0,
            top_k=int(msg.top_k),
            seed=int(msg.seed) if msg.HasField("seed") else None,
        )
    except ValueError as e:
        raise InvalidRequest(f"sampling: {e}") from None
