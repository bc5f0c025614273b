"""The request's logits processors as parameters: one validated, torch-free type for the
gateway and the replicas (the math itself: specdec.replica.processors).

A request's processors come from two messages: SamplingParams (presence, frequency and
repetition penalties, logit_bias: what the client asked) and OutputControls (where the
request's output starts in the session's sequence, and the min_tokens mask: what the
gateway works out for each Draft, Speculate and Verify).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from specdec.common.errors import InvalidRequest
from specdec.v1 import common_pb2

# OpenAI's ranges and its cap on logit_bias entries.
PENALTY_RANGE = 2.0  # presence_penalty, frequency_penalty in [-2, 2]
LOGIT_BIAS_RANGE = 100.0  # biases in [-100, 100]
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 256
# min_tokens_ids: the stop token ids and a model's few EOS ids.
MAX_MIN_TOKENS_IDS = MAX_STOP_TOKEN_IDS + 64


@dataclass(frozen=True)
class Controls:
    """The logits processors of one request (what specdec.replica.processors applies).

    Order: logit_bias, the min_tokens mask, repetition, frequency, presence penalties.
    presence / frequency count the tokens from sequence index output_start on;
    repetition counts the whole sequence. min_tokens_ids are masked at sequence index
    i while i - output_start < min_tokens.
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    output_start: int = 0
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()  # ascending, distinct

    @property
    def active(self) -> bool:
        """Whether any processor changes the logits (else they are used as they are)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or (self.min_tokens and self.min_tokens_ids)
        )

    @property
    def counts_output(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


def check_sampling_controls(controls: Controls, vocab_size: int) -> None:
    """InvalidRequest naming the first processor field of a request's sampling (its
    SamplingParams.processors) out of range (its `field`)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(controls, name)
        if not (math.isfinite(value) and -PENALTY_RANGE <= value <= PENALTY_RANGE):
            raise InvalidRequest(
                f"sampling: {name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], "
                f"got {value:g}",
                field=name,
            )
    rp = controls.repetition_penalty  # 0 (unset) reads as 1
    if not (math.isfinite(rp) and rp >= 0):
        raise InvalidRequest(
            f"sampling: repetition_penalty must be a finite number > 0 (0: unset), got {rp:g}",
            field="repetition_penalty",
        )
    bias = controls.logit_bias
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"sampling: logit_bias holds {len(bias)} entries, at most {MAX_LOGIT_BIAS}",
            field="logit_bias",
        )
    for token, value in bias:
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"sampling: logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
                field="logit_bias",
            )
        if not (math.isfinite(value) and -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE):
            raise InvalidRequest(
                f"sampling: logit_bias of token {token} must be in "
                f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {value:g}",
                field="logit_bias",
            )


def controls_from_proto(
    processors: Controls,
    output: common_pb2.OutputControls,
    vocab_size: int,
    sequence_length: int,
) -> Controls | None:
    """A replica call's processors (None when none changes the logits), or InvalidRequest:
    the sampling's (its SamplingParams.processors) checked, with the call's output controls.

    sequence_length: tokens of the session's sequence before the first position the call
    samples (the draft's start; output_start may not lie beyond it).
    """
    check_sampling_controls(processors, vocab_size)
    if output.output_start > sequence_length:
        raise InvalidRequest(
            f"output.output_start {output.output_start} lies beyond the sequence before "
            f"the draft ({sequence_length} tokens)"
        )
    ids = list(output.min_tokens_ids)
    if len(ids) > MAX_MIN_TOKENS_IDS:
        raise InvalidRequest(
            f"output.min_tokens_ids holds {len(ids)} ids, at most {MAX_MIN_TOKENS_IDS}"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(
            f"output.min_tokens_ids holds {bad[0]}, outside the vocabulary [0, {vocab_size})"
        )
    controls = with_output(processors, output)
    return controls if controls.active else None


def processes_logits(processors: Controls, output: common_pb2.OutputControls | None) -> bool:
    """Whether a request's processors change the logits (the replicas then read the
    sequence before each position: a token tree cannot be verified with them yet)."""
    return with_output(processors, output or common_pb2.OutputControls()).active


def with_output(processors: Controls, output: common_pb2.OutputControls) -> Controls:
    """The sampling's processors with a call's output controls."""
    return dataclasses.replace(
        processors,
        output_start=int(output.output_start),
        min_tokens=int(output.min_tokens),
        min_tokens_ids=tuple(sorted(set(output.min_tokens_ids))),
    )
