"""Sampling parameters as the replicas apply them: the request's Sampling
(specdec.sdk.request, defined once), every field set and validated; and the request limits
the gateway and the replicas both check."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

from specdec.common.controls import Controls
from specdec.common.errors import InvalidRequest
from specdec.sdk.request import GREEDY_BELOW, MAX_TOP_K, Sampling

__all__ = [
    "GREEDY_BELOW",
    "MAX_FAN_OUT",
    "MAX_TOP_K",
    "MAX_TOP_LOGPROBS",
    "MAX_TREE_WIDTH",
    "SamplingParams",
]

# Largest top_logprobs a request may ask for (OpenAI's chat limit; vLLM's default): the
# gateway's request limit and the verifier's (specdec.replica.logprobs).
MAX_TOP_LOGPROBS = 20
MAX_FAN_OUT = 64  # SSD branches per round (drafter and gateway settings, Speculate requests)
# Children of a token tree's node (SpeculationParams.tree_width, DraftRequest.tree_width).
MAX_TREE_WIDTH = 8


@dataclass(frozen=True)
class SamplingParams(Sampling):
    """A Sampling with every field set (unset: neutral, greedy) and checked: InvalidRequest
    naming the first field out of range ("sampling: top_p must be in (0, 1], got 2.0").
    Made by ``Sampling.resolve(defaults, SamplingParams)`` (the gateway's, from the typed
    request) or ``SamplingParams.from_proto(msg, defaults)`` (a replica's, from the wire).

    temperature: 0 (anything below GREEDY_BELOW) = greedy. top_p in (0, 1]. top_k: 0 = off.
    seed: None = fresh entropy. ``processors``: its logits processors (the penalties and
    logit_bias, specdec.common.controls; their ranges are checked with the vocabulary by
    check_sampling_controls).
    """

    processors: Controls = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, neutral in self.MODEL_FIELDS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, neutral)
        t, p, min_p = (
            cast(float, self.temperature),
            cast(float, self.top_p),
            cast(float, self.min_p),
        )
        k, seed = cast(int, self.top_k), self.seed
        bad = None
        if not (math.isfinite(t) and t >= 0):
            bad = ("temperature", f"must be a finite number >= 0, got {t}")
        elif not (math.isfinite(p) and 0.0 < p <= 1.0):
            bad = ("top_p", f"must be in (0, 1], got {p}")
        elif isinstance(k, bool) or not isinstance(k, int):
            bad = ("top_k", f"must be an integer, got {k!r}")
        elif not (math.isfinite(min_p) and 0 <= min_p <= 1):
            bad = ("min_p", f"must be in [0, 1], got {min_p}")
        elif seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            bad = ("seed", f"must be an integer, got {seed!r}")
        elif not 0 <= k <= MAX_TOP_K:
            bad = ("top_k", f"must be in [0, {MAX_TOP_K}] (0 = off), got {k}")
        elif seed is not None and not 0 <= seed < 1 << 64:
            bad = ("seed", f"must be in [0, 2**64), got {seed}")
        if bad is not None:
            raise InvalidRequest(f"sampling: {bad[0]} {bad[1]}", field=bad[0])
        processors = Controls(
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty or 0.0) or 1.0,
            logit_bias=tuple(
                sorted((int(t), float(b)) for t, b in (self.logit_bias or {}).items())
            ),
        )
        object.__setattr__(self, "processors", processors)
