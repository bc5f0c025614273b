"""Sampling parameters as the replicas apply them: the request's Sampling
(specdec.sdk.request, defined once), every field set and validated; and the request limits
the gateway and the replicas both check."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.common.errors import InvalidRequest
from specdec.sdk.request import GREEDY_BELOW, MAX_TOP_K, Sampling
from specdec.v1 import common_pb2

__all__ = [
    "GREEDY_BELOW",
    "MAX_FAN_OUT",
    "MAX_TOP_K",
    "MAX_TOP_LOGPROBS",
    "MAX_TREE_WIDTH",
    "SamplingParams",
    "resolved_sampling",
    "sampling_from_proto",
]

# Largest top_logprobs a request may ask for (OpenAI's chat limit; vLLM's default): the
# gateway's request limit and the verifier's (specdec.replica.logprobs).
MAX_TOP_LOGPROBS = 20
MAX_FAN_OUT = 64  # SSD branches per round (drafter and gateway settings, Speculate requests)
# Children of a token tree's node (SpeculationParams.tree_width, DraftRequest.tree_width).
MAX_TREE_WIDTH = 8


@dataclass(frozen=True)
class SamplingParams(Sampling):
    """A Sampling with every field set (unset: neutral, greedy) and checked (ValueError).

    temperature: 0 (anything below GREEDY_BELOW) = greedy. top_p in (0, 1]. top_k: 0 = off.
    seed: None = fresh entropy.
    """

    def __post_init__(self) -> None:
        for name, neutral in self.MODEL_FIELDS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, neutral)
        self.check()


def resolved_sampling(sampling: Sampling, defaults: Sampling | None = None) -> SamplingParams:
    """`sampling` with its unset fields from `defaults` (else neutral), checked
    (InvalidRequest naming the field)."""
    fields = sampling.resolve(defaults).__dict__
    try:
        return SamplingParams(**fields)
    except InvalidRequest as e:
        raise InvalidRequest(f"sampling: {e.details}", field=e.field) from None


def sampling_from_proto(
    msg: common_pb2.SamplingParams | None, defaults: Sampling | None = None
) -> SamplingParams:
    """Proto sampling -> SamplingParams (InvalidRequest when a value is out of range).

    Unset fields: see Sampling.from_proto; with model_defaults they take `defaults`.
    """
    return resolved_sampling(Sampling.from_proto(msg), defaults)
