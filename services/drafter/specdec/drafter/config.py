"""The drafter's configuration: a replica's settings plus SSD (speculative speculative
decoding) fan-out, read once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from specdec.common.params import MAX_FAN_OUT
from specdec.common.settings import ConfigError, invalid, non_negative, one_of, positive, setting
from specdec.drafter.quantize import QUANTIZE_MODES, check_quantize
from specdec.replica.config import LLAMA_CPP, ReplicaConfig

# How Speculate ranks verification outcomes (--ssd-outcomes; specdec.drafter.speculate).
CONFIDENCE = "confidence"  # d_i accepted with the drafter's own probability of it
GEOMETRIC = "geometric"  # one acceptance rate: the request's, else --ssd-acceptance-prior
OUTCOME_MODELS = (CONFIDENCE, GEOMETRIC)


def _vocab_file(path: str) -> str:
    """The ranking file, read once here so a bad one fails before the model loads."""
    if path:
        from specdec.drafter.vocab import read_ranking

        read_ranking(path)
    return path


def _fan_out(value: int) -> str | None:
    return None if 1 <= value <= MAX_FAN_OUT else f"must be in [1, {MAX_FAN_OUT}]"


@dataclass(frozen=True)
class DrafterConfig(ReplicaConfig):
    """A replica's settings plus the drafter's own (flags after the replica's)."""

    ssd_fan_out: int = setting(6, "SSD: branches prepared per round", check=_fan_out)
    ssd_max_per_outcome: int = setting(
        3, "SSD: next tokens tried per accepted count", check=positive
    )
    ssd_outcomes: str = setting(
        CONFIDENCE,
        "SSD: how outcomes are ranked: confidence (the drafter's probability of each "
        "draft token) or geometric (one acceptance rate)",
        check=one_of(OUTCOME_MODELS),
    )
    ssd_acceptance_prior: float = setting(
        0.7,
        "SSD, --ssd-outcomes geometric: acceptance rate that ranks outcomes before a "
        "request has its own",
        check=lambda v: None if 0 < v < 1 else "must be in (0, 1)",
    )
    # Fan-out shrinks to fit this bound, down to no branch (an SSD miss).
    ssd_max_branch_tokens: int = setting(
        65536,
        "SSD: bound on one Speculate's branch caches, in KV tokens over all branches "
        "(0: unbounded)",
        check=non_negative,
    )
    # Sampling: the proposal is cut to its top entries holding 1 - tail of the mass, at
    # most this many (0: sent whole, dense fp16 over the vocabulary). Exact either way.
    draft_probs_max_entries: int = setting(
        2048,
        "sampling: most entries of a draft token's distribution (0: the whole vocabulary)",
        check=non_negative,
    )
    draft_probs_tail: float = setting(
        1e-4,
        "sampling: probability mass a draft distribution may leave out (within the cap)",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)",
    )
    # Reduced draft vocabulary (specdec.drafter.vocab).
    draft_vocab: int = setting(
        0,
        "the drafter's output layer over this many tokens only: the smallest ids (BPE merge "
        "order), or the first of --draft-vocab-file; EOS always kept (0: the whole "
        "vocabulary, or all of the file)",
        check=non_negative,
    )
    draft_vocab_file: str = setting(
        "",
        "a saved draft vocabulary: token ids, whitespace-separated, most frequent first, "
        "'#' comments",
        convert=_vocab_file,
    )
    # Weight quantization of the draft model (specdec.drafter.quantize).
    quantize: str = setting(
        "none",
        f"weights of the draft model, one of {', '.join(QUANTIZE_MODES)} "
        "(int8: int8 matmuls with float32 activations; needs --dtype float32)",
        check=one_of(QUANTIZE_MODES),
    )

    # A head drafter (specdec.drafter.head): drafts from the target's features.
    head: str = setting(
        "",
        "a head folder (docs/concepts/heads.md): draft with one decoder layer over the "
        "target's features, which the gateway passes from the verifier; --model is then "
        "the target's folder (its tokenizer, and its embedding and output matrices where "
        "the head folder holds none); chains, trees and SSD, over --draft-vocab's tokens "
        "if given (empty: draft with --model itself)",
    )

    ROLE: ClassVar[str] = "drafter"

    @classmethod
    def check_role_settings(cls, values: dict[str, Any]) -> None:
        if values["head"]:
            check_head(values)
        quantize = values["quantize"]
        if values["engine"] == LLAMA_CPP and (
            quantize != "none" or values["draft_vocab"] or values["draft_vocab_file"]
        ):
            raise ConfigError(
                f"--quantize and --draft-vocab change a torch model; --engine {LLAMA_CPP} runs "
                "the GGUF as shipped (quantize it with llama.cpp's own tools instead)"
            )
        problem = check_quantize(quantize, values["dtype"], values["device"])
        if problem:
            raise invalid("--quantize", problem, quantize)
        if quantize != "none" and (values["draft_vocab"] or values["draft_vocab_file"]):
            raise ConfigError(
                "--draft-vocab / --draft-vocab-file with --quantize is not built yet: the "
                "reduced head slices the rows of a float output layer, and int8 packs it"
            )
        if quantize != "none" and values["pack_weights"] == "true":
            raise ConfigError(
                "--pack-weights true with --quantize: int8 layers have their own kernels; "
                "pack float weights, or quantize them, not both"
            )


def check_head(values: dict[str, Any]) -> None:
    """ConfigError for the settings a head drafter (--head) does not run with."""
    where = "--head"
    refusals = [
        (
            values["engine"] == LLAMA_CPP,
            f"a head runs on the torch engines, not --engine {LLAMA_CPP}",
        ),
        (values["quantize"] != "none", "--quantize is the draft model's; leave it none"),
        (values["compile"], "--compile is not built for heads; leave it off"),
        (values["pack_weights"] == "true", "--pack-weights true is not built for heads"),
        (values["dtype"] == "fastest", "--dtype fastest is not built for heads; name the dtype"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{where}: {why}")
