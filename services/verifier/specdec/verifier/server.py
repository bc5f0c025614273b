"""VerifierService: a thin servicer over specdec.verifier.scorer.

Verify is a request -> validated model call (`verify_call`) and a result -> response
function: the gRPC method and the data plane (specdec.replica.dataplane) both answer
through them."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import grpc

from specdec.common.controls import controls_from_proto
from specdec.common.errors import InvalidRequest, Unimplemented
from specdec.common.params import MAX_TOP_LOGPROBS, SamplingParams
from specdec.common.serving import rpc_errors
from specdec.replica.convert import decode_draft_probs, decode_grammar_masks, prefix_from_proto
from specdec.replica.features import encode_features
from specdec.replica.logprobs import LogprobRows, LogprobsAsk
from specdec.replica.metrics import observed_rpc
from specdec.replica.replica import ModelCall, ReplicaServicer, check_fork, run_replica
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.verifier.config import VerifierConfig
from specdec.verifier.scorer import VerifyCall, VerifyResult

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


class VerifierServicer(ReplicaServicer, verifier_pb2_grpc.VerifierServiceServicer):
    def model_calls(self) -> dict[str, Callable[[Any], ModelCall[Any]]]:
        return {"Verify": self.verify_call}

    @observed_rpc(SERVICE_NAME)
    @rpc_errors
    async def Verify(
        self, request: verifier_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.VerifyResponse:
        return await self.answer(self.verify_call(request))

    def verify_call(
        self, request: verifier_pb2.VerifyRequest
    ) -> ModelCall[verifier_pb2.VerifyResponse]:
        """A Verify request, validated, as the model call that answers it."""
        rt = self.ready_runtime()
        draft_tokens = list(request.draft_tokens)
        k = len(draft_tokens)
        if k > rt.config.max_draft_tokens:
            raise InvalidRequest(
                f"draft of {k} tokens exceeds max_draft_tokens {rt.config.max_draft_tokens}"
            )
        rt.validate_tokens("draft_tokens", draft_tokens)
        params = SamplingParams.from_proto(request.sampling)
        prefix = prefix_from_proto(request.prefix)
        new_tokens = list(request.new_tokens)
        self.check_extent(request.session_id, prefix, new_tokens, k)
        draft_probs = None
        if request.draft_probs or not params.greedy:
            if len(request.draft_probs) != k:
                raise InvalidRequest(
                    f"draft_probs has {len(request.draft_probs)} distributions for {k} draft "
                    "tokens (sampling needs one per draft token)"
                )
            draft_probs = decode_draft_probs(request.draft_probs, rt.vocab_size)  # [k, vocab]
        controls = controls_from_proto(
            params.processors, request.output, rt.vocab_size, prefix.length + len(new_tokens)
        )
        masks = decode_grammar_masks(request.grammar_masks, k + 1, rt.vocab_size)  # [k+1, vocab]
        ask = logprobs_ask(request)
        parents = tree_parents(request, k)
        if parents is not None and rt.config.tensor_parallel > 1:
            raise Unimplemented(
                "token trees (draft_parents) are not built for --tensor-parallel > 1 yet; "
                "send chains (tree_width 1)"
            )
        if parents is not None and (controls is not None or masks is not None or ask):
            raise InvalidRequest(
                "a draft tree (draft_parents) with logits processors that read the sequence, "
                "grammar masks or logprobs is not supported yet; send a chain"
            )
        check_fork(request.fork_from)
        features = rt.feature_ask(request.features) if request.HasField("features") else None
        queue_depth = rt.pending  # the load this call waits behind (itself not counted yet)
        call = VerifyCall(
            runtime=rt,
            session_id=request.session_id,
            prefix=prefix,
            new_tokens=new_tokens,
            draft_tokens=draft_tokens,
            draft_probs=draft_probs,
            params=params,
            controls=controls,
            logprobs=ask,
            fork_from=request.fork_from,
            grammar_masks=masks,
            draft_parents=parents,
            features=features,
        )
        respond = functools.partial(
            self._verify_response,
            k,
            queue_depth,
            new_tokens,
            draft_tokens,
            request.logprobs,
            features.format if features is not None else 0,
        )
        return ModelCall(call, respond)

    def _verify_response(
        self,
        k: int,
        queue_depth: int,
        new_tokens: list[int],
        draft_tokens: list[int],
        logprobs: bool,
        features_format: int,
        verdict: VerifyResult,
    ) -> verifier_pb2.VerifyResponse:
        self.runtime.obs.verified(k, verdict.accepted)
        response = verifier_pb2.VerifyResponse(
            accepted_count=verdict.accepted,
            next_token=verdict.next_token,
            next_token_kind=(
                verifier_pb2.NEXT_TOKEN_KIND_BONUS
                if verdict.bonus
                else verifier_pb2.NEXT_TOKEN_KIND_RECOVERED
            ),
            cached_length=verdict.cached_length,
            forward_ms=verdict.forward_ms,
            queue_depth=queue_depth,
            forward_cost=self.forward_cost(),
        )
        if verdict.path is not None:
            response.accepted_path.extend(verdict.path)
        if logprobs and verdict.logprobs is not None:
            emitted = [*draft_tokens[: verdict.accepted], verdict.next_token]
            response.logprobs.CopyFrom(logprobs_to_proto(emitted, verdict.logprobs))
        if verdict.prompt_logprobs is not None:
            response.prompt_logprobs.CopyFrom(
                logprobs_to_proto(new_tokens, verdict.prompt_logprobs)
            )
        if verdict.features is not None:
            response.features.CopyFrom(
                encode_features(verdict.features, verdict.features_start, features_format)
            )
            self.runtime.obs.features_sent(len(response.features.data))
        return response


def tree_parents(request: verifier_pb2.VerifyRequest, k: int) -> list[int] | None:
    """A Verify's draft tree (draft_parents), validated; None for a chain."""
    parents = list(request.draft_parents)
    if not parents:
        return None
    if len(parents) != k:
        raise InvalidRequest(f"draft_parents has {len(parents)} entries for {k} draft tokens")
    bad = next((i for i, p in enumerate(parents) if not -1 <= p < i), None)
    if bad is not None:
        raise InvalidRequest(
            f"draft_parents[{bad}] is {parents[bad]}: a node's parent is -1 (the last new "
            "token) or an earlier node"
        )
    return parents


def logprobs_ask(request: verifier_pb2.VerifyRequest) -> LogprobsAsk | None:
    """What a Verify asks to be scored (None: nothing), validated."""
    if not (request.logprobs or request.prompt_logprobs):
        if request.top_logprobs:
            raise InvalidRequest("top_logprobs needs logprobs or prompt_logprobs")
        return None
    if request.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}"
        )
    return LogprobsAsk(top=request.top_logprobs, prompt=request.prompt_logprobs)


def logprobs_to_proto(tokens: list[int], rows: LogprobRows) -> common_pb2.TokenLogprobs:
    """Scores on the host as a TokenLogprobs of `tokens` (the scores cover the last rows)."""
    return common_pb2.TokenLogprobs(
        token_ids=tokens,
        logprobs=rows.chosen.tolist(),
        num_top=rows.top_ids.shape[-1],
        top_token_ids=rows.top_ids.reshape(-1).tolist(),
        top_logprobs=rows.top_values.reshape(-1).tolist(),
    )


def main(args: argparse.Namespace) -> None:
    run_replica(
        VerifierConfig,
        args,
        SERVICE_NAME,
        VerifierServicer,
        lambda servicer, server: verifier_pb2_grpc.add_VerifierServiceServicer_to_server(
            servicer, server
        ),
    )
