"""GetServerInfo: the model behind the gateway and the limits a request must respect."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdec.common.controls import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from specdec.common.errors import NotReady
from specdec.common.params import MAX_TOP_LOGPROBS
from specdec.gateway import job
from specdec.gateway.round import grammar
from specdec.gateway.round.lookup import MAX_TREE_WIDTH
from specdec.sdk.request import Sampling
from specdec.v1 import gateway_pb2

if TYPE_CHECKING:
    from specdec.gateway.service import GatewayCore

# The optional request fields this gateway supports (GenerateRequest and SamplingParams
# names; the HTTP API uses the same names): GetServerInfo and /v1/models list them.
SUPPORTED_REQUEST_FIELDS = (
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "n",
    "prediction",
    "record",
)


def supported_request_fields(gateway: GatewayCore) -> list[str]:
    """The optional request fields this gateway serves: SUPPORTED_REQUEST_FIELDS, and
    structured_output when the grammar engine could read the model's tokenizer."""
    return [*SUPPORTED_REQUEST_FIELDS, *(["structured_output"] if gateway.grammars else [])]


def server_info(gateway: GatewayCore) -> gateway_pb2.GetServerInfoResponse:
    """What a client needs to build valid requests (NotReady until the replicas answered)."""
    limits, codec = gateway.limits, gateway.codec
    if limits is None or codec is None:
        raise NotReady("the gateway is still connecting to its replicas")
    fleet = gateway.fleet
    canary = gateway.config.drafter_canary
    verifier = next(r.info for r in fleet.verifiers.replicas if r.info is not None)
    drafter = next((r.info for r in fleet.drafters.replicas if r.info is not None), None)
    return gateway_pb2.GetServerInfoResponse(
        model_id=verifier.model_id,
        draft_model_id=drafter.model_id if drafter else "",
        vocab_size=limits.vocab_size,
        max_context=limits.max_context,
        max_num_draft_tokens=limits.max_k,
        default_num_draft_tokens=limits.default_k,
        default_ssd=limits.default_ssd,
        max_new_tokens=limits.max_new_tokens,
        max_stop_strings=job.MAX_STOP_STRINGS,
        max_stop_chars=job.MAX_STOP_CHARS,
        max_session_id_chars=job.MAX_SESSION_ID_CHARS,
        default_session_ttl_seconds=limits.default_ttl,
        max_session_ttl_seconds=limits.max_session_ttl,
        tokenizer_fingerprint=codec.fingerprint,
        eos_token_ids=sorted(gateway.eos_token_ids),
        bos_token_id=verifier.bos_token_id,
        supported_request_fields=supported_request_fields(gateway),
        max_stop_token_ids=MAX_STOP_TOKEN_IDS,
        max_logit_bias=MAX_LOGIT_BIAS,
        max_top_logprobs=MAX_TOP_LOGPROBS,
        max_choices=job.MAX_CHOICES,
        structured_output_engine=grammar.ENGINE if gateway.grammars else "",
        structured_output_kinds=grammar.KINDS if gateway.grammars else (),
        default_method=limits.default_method.proto,
        sampling_defaults=(limits.sampling_defaults or Sampling()).resolve().to_proto(),
        lookup=gateway_pb2.LookupInfo(
            prompt_lookup_min=gateway.config.prompt_lookup_min,
            prompt_lookup_max=gateway.config.prompt_lookup_max,
            suffix_depth=gateway.config.suffix_depth,
            suffix_cache_tokens=(
                gateway.config.suffix_cache_tokens if gateway.suffix_cache is not None else 0
            ),
            suffix_cache_scope=gateway.config.suffix_cache_scope,
            tree_width=limits.default_tree_width,
            max_tree_width=MAX_TREE_WIDTH,
        ),
        recording=gateway.recorder is not None,
        drafter_versions=sorted(
            {r.info.model_version for r in fleet.drafters.replicas if r.info is not None}
        ),
        drafter_canary_version=canary.version if canary else "",
        drafter_canary_percent=canary.percent if canary else 0.0,
    )
