"""The drafter's configuration: a replica's settings plus SSD (speculative speculative
decoding) fan-out, read once at start-up."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar

from specdec.common.config import (
    MAX_FAN_OUT,
    ConfigError,
    ReplicaConfig,
    add_setting,
    non_negative,
    one_of,
    parse_value,
    positive,
)
from specdec.drafter.quantize import QUANTIZE_MODES, check_quantize

# How Speculate ranks verification outcomes (--ssd-outcomes; specdec.drafter.speculate).
CONFIDENCE = "confidence"  # d_i accepted with the drafter's own probability of it
GEOMETRIC = "geometric"  # one acceptance rate: the request's, else --ssd-acceptance-prior
OUTCOME_MODELS = (CONFIDENCE, GEOMETRIC)


@dataclass(frozen=True)
class DrafterConfig(ReplicaConfig):
    ssd_fan_out: int = 6  # branches prepared per round unless the request says
    ssd_max_per_outcome: int = 3  # at most this many next tokens per accepted count
    ssd_outcomes: str = CONFIDENCE  # how Speculate ranks outcomes (OUTCOME_MODELS)
    ssd_acceptance_prior: float = 0.7  # geometric: the rate until the request sends its own
    # Bound on the batched branch cache of one Speculate (branches x their KV tokens);
    # 0: unbounded. Fan-out shrinks to fit it, down to no branch (an SSD miss).
    ssd_max_branch_tokens: int = 65536
    # Sampling: the proposal is cut to its top entries holding 1 - tail of the mass, at
    # most this many (0: sent whole, dense fp16 over the vocabulary). Exact either way.
    draft_probs_max_entries: int = 2048
    draft_probs_tail: float = 1e-4
    # Reduced draft vocabulary (specdec.drafter.vocab): the output layer over N tokens, the
    # first N of draft_vocab_file's ranking or the N smallest ids. 0 and "": the whole one.
    draft_vocab: int = 0
    draft_vocab_file: str = ""
    # Weight quantization of the draft model (specdec.drafter.quantize): "none" or "int8".
    quantize: str = "none"

    ROLE: ClassVar[str] = "drafter"

    @classmethod
    def add_role_arguments(cls, parser: argparse.ArgumentParser) -> None:
        add_setting(parser, "--ssd-fan-out", "SSD: branches prepared per round", 6)
        add_setting(parser, "--ssd-max-per-outcome", "SSD: next tokens tried per accepted count", 3)
        add_setting(
            parser,
            "--ssd-outcomes",
            "SSD: how outcomes are ranked: confidence (the drafter's probability of each "
            "draft token) or geometric (one acceptance rate)",
            "confidence",
        )
        add_setting(
            parser,
            "--ssd-acceptance-prior",
            "SSD, --ssd-outcomes geometric: acceptance rate that ranks outcomes before a "
            "request has its own",
            0.7,
        )
        add_setting(
            parser,
            "--ssd-max-branch-tokens",
            "SSD: bound on one Speculate's branch caches, in KV tokens over all branches "
            "(0: unbounded)",
            65536,
        )
        add_setting(
            parser,
            "--draft-probs-max-entries",
            "sampling: most entries of a draft token's distribution (0: the whole vocabulary)",
            2048,
        )
        add_setting(
            parser,
            "--draft-probs-tail",
            "sampling: probability mass a draft distribution may leave out (within the cap)",
            1e-4,
        )
        add_setting(
            parser,
            "--draft-vocab",
            "the drafter's output layer over this many tokens only: the smallest ids (BPE merge "
            "order), or the first of --draft-vocab-file; EOS always kept (0: the whole "
            "vocabulary, or all of the file)",
            0,
        )
        add_setting(
            parser,
            "--draft-vocab-file",
            "a saved draft vocabulary: token ids, whitespace-separated, most frequent first, "
            "'#' comments",
            "",
        )
        add_setting(
            parser,
            "--quantize",
            f"weights of the draft model, one of {', '.join(QUANTIZE_MODES)} "
            "(int8: int8 matmuls with float32 activations; needs --dtype float32)",
            "none",
        )

    @classmethod
    def role_settings(cls, args: argparse.Namespace) -> dict[str, Any]:
        settings = cls._settings(args)
        if settings["quantize"] != "none" and (
            settings["draft_vocab"] or settings["draft_vocab_file"]
        ):
            raise ConfigError(
                "--draft-vocab / --draft-vocab-file with --quantize is not built yet: the "
                "reduced head slices the rows of a float output layer, and int8 packs it"
            )
        if settings["quantize"] != "none" and str(args.pack_weights) == "true":
            raise ConfigError(
                "--pack-weights true with --quantize: int8 layers have their own kernels; "
                "pack float weights, or quantize them, not both"
            )
        return settings

    @classmethod
    def _settings(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {
            "ssd_fan_out": parse_value(args, "--ssd-fan-out", int, _fan_out),
            "ssd_max_per_outcome": parse_value(args, "--ssd-max-per-outcome", int, positive),
            "ssd_outcomes": parse_value(
                args,
                "--ssd-outcomes",
                str,
                one_of(OUTCOME_MODELS),
            ),
            "ssd_acceptance_prior": parse_value(
                args,
                "--ssd-acceptance-prior",
                float,
                lambda v: None if 0 < v < 1 else "must be in (0, 1)",
            ),
            "ssd_max_branch_tokens": parse_value(
                args, "--ssd-max-branch-tokens", int, non_negative
            ),
            "draft_probs_max_entries": parse_value(
                args, "--draft-probs-max-entries", int, non_negative
            ),
            "draft_probs_tail": parse_value(
                args,
                "--draft-probs-tail",
                float,
                lambda v: None if 0 <= v < 1 else "must be in [0, 1)",
            ),
            "draft_vocab": parse_value(args, "--draft-vocab", int, non_negative),
            "draft_vocab_file": _vocab_file(args.draft_vocab_file or ""),
            "quantize": parse_value(
                args,
                "--quantize",
                str,
                lambda v: check_quantize(v, str(args.dtype), str(args.device)),
            ),
        }


def _vocab_file(path: str) -> str:
    """The ranking file, read once here so a bad one fails before the model loads."""
    if path:
        from specdec.drafter.vocab import read_ranking

        read_ranking(path)
    return path


def _fan_out(value: int) -> str | None:
    return None if 1 <= value <= MAX_FAN_OUT else f"must be in [1, {MAX_FAN_OUT}]"
