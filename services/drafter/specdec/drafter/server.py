"""DrafterService: a thin servicer over specdec.drafter.proposer.

Each method is a request -> validated model call (`draft_call`, `speculate_call`) and a
result -> response function: the gRPC methods and the data plane
(specdec.replica.dataplane) both answer through them."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import grpc
import torch

from specdec.common.controls import Controls, controls_from_proto
from specdec.common.errors import FailedPrecondition, InvalidRequest
from specdec.common.params import MAX_FAN_OUT, MAX_TREE_WIDTH, SamplingParams
from specdec.common.serving import rpc_errors
from specdec.drafter import proposer
from specdec.drafter.config import DrafterConfig
from specdec.drafter.head import HeadDraftCall, HeadRuntime, HeadSpeculateCall
from specdec.drafter.proposer import DraftCall
from specdec.drafter.runtime import DrafterRuntime
from specdec.drafter.speculate import BranchStore, SpeculateCall, SpeculateResult
from specdec.replica.convert import encoded_to_proto, prefix_from_proto
from specdec.replica.engine import Engine
from specdec.replica.features import decode_features
from specdec.replica.metrics import observed_rpc
from specdec.replica.replica import ModelCall, ReplicaServicer, check_fork, run_replica
from specdec.v1 import drafter_pb2, drafter_pb2_grpc

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


class DrafterServicer(ReplicaServicer, drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, runtime: Engine[Any]):
        super().__init__(runtime)
        self.branches = BranchStore()  # SSD: prepared next-round drafts (model thread only)

    def versioned(self) -> tuple[str, str]:
        """A head drafter reports its head's version (specdec distill --head), not the
        target's it reads its tokenizer from."""
        cfg = self.runtime.config
        if isinstance(cfg, DrafterConfig) and cfg.head:
            return cfg.head, "--head"
        return super().versioned()

    def release(self, session_id: str) -> bool:
        self.branches.forget(session_id)
        return super().release(session_id)

    def _k(self, k: int, field: str = "num_draft_tokens") -> int:
        """A draft length k from the request's `field`, within [1, --max-draft-tokens]."""
        limit = self.ready_runtime().config.max_draft_tokens
        if not 1 <= k <= limit:
            raise InvalidRequest(f"{field} must be in [1, {limit}], got {k}")
        return k

    def model_calls(self) -> dict[str, Callable[[Any], ModelCall[Any]]]:
        return {"Draft": self.draft_call, "Speculate": self.speculate_call}

    @observed_rpc(SERVICE_NAME)
    @rpc_errors
    async def Draft(
        self, request: drafter_pb2.DraftRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DraftResponse:
        return await self.answer(self.draft_call(request))

    @observed_rpc(SERVICE_NAME)
    @rpc_errors
    async def Speculate(
        self, request: drafter_pb2.SpeculateRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.SpeculateResponse:
        return await self.answer(self.speculate_call(request))

    def draft_call(self, request: drafter_pb2.DraftRequest) -> ModelCall[drafter_pb2.DraftResponse]:
        """A Draft request, validated, as the model call that answers it."""
        rt = self.ready_runtime()
        k = self._k(request.num_draft_tokens)
        params = SamplingParams.from_proto(request.sampling)
        prefix = prefix_from_proto(request.prefix)
        new_tokens = list(request.new_tokens)
        self.check_extent(request.session_id, prefix, new_tokens, k)
        controls = controls_from_proto(
            params.processors, request.output, rt.vocab_size, prefix.length + len(new_tokens)
        )
        check_fork(request.fork_from)
        tree_nodes, tree_width, tree_depth = self._tree(request, controls)
        fields: dict[str, Any] = dict(
            runtime=rt,
            branches=self.branches,
            session_id=request.session_id,
            prefix=prefix,
            new_tokens=new_tokens,
            k=k,
            params=params,
            controls=controls,
            fork_from=request.fork_from,
            tree_nodes=tree_nodes,
            tree_width=tree_width,
            tree_depth=tree_depth,
        )
        if isinstance(rt, HeadRuntime):
            features = self._head_features(rt, request, prefix.length + len(new_tokens))
            return ModelCall(HeadDraftCall(**fields, features=features), self._draft_response)
        if request.features:
            raise FailedPrecondition(
                "features are a head drafter's input (serve drafter --head); this drafter "
                "drafts with its own model and takes none"
            )
        call = DraftCall(**fields)
        return ModelCall(call, self._draft_response)

    @staticmethod
    def _head_features(
        rt: HeadRuntime, request: drafter_pb2.DraftRequest, length: int
    ) -> tuple[tuple[int, torch.Tensor], ...]:
        """The target's features a Draft carries to a head drafter, decoded and checked
        (the head's width and format, within the request's sequence of `length` tokens):
        (start position, rows [positions, width]) each."""
        ask = rt.head_features
        assert ask is not None  # a loaded head
        features = []
        for msg in request.features:
            rows = decode_features(msg, rt.width, ask.format)
            if msg.start + msg.positions > length:
                raise InvalidRequest(
                    f"features cover positions {msg.start}..{msg.start + msg.positions - 1}, "
                    f"beyond the sequence of {length} tokens (prefix + new_tokens)"
                )
            features.append((int(msg.start), rows))
            rt.obs.features_received(len(msg.data))
        return tuple(features)

    def _tree(
        self, request: drafter_pb2.DraftRequest, controls: Controls | None
    ) -> tuple[int, int, int]:
        """A Draft's (tree_nodes, tree_width, tree_depth), validated; (0, 1, 0): a chain."""
        nodes, width, depth = request.tree_nodes, request.tree_width, request.tree_depth
        if nodes == 0:
            if depth:
                raise InvalidRequest(f"tree_depth needs tree_nodes, got tree_depth {depth}")
            return 0, 1, 0
        limit = self.ready_runtime().config.max_draft_tokens
        if nodes > limit:
            raise InvalidRequest(f"tree_nodes must be in [0, {limit}], got {nodes}")
        if not 2 <= width <= MAX_TREE_WIDTH:
            raise InvalidRequest(
                f"tree_width must be in [2, {MAX_TREE_WIDTH}] with tree_nodes, got {width}"
            )
        if depth and nodes < 1 + depth:
            raise InvalidRequest(
                f"tree_nodes must be at least 1 + tree_depth (a leaf and its continuation), "
                f"got tree_nodes {nodes}, tree_depth {depth}"
            )
        if controls is not None:
            raise InvalidRequest(
                "a draft tree (tree_nodes) with logits processors that read the sequence "
                "is not built; send a chain"
            )
        return nodes, width, depth

    def _draft_response(self, draft: proposer.DraftResult) -> drafter_pb2.DraftResponse:
        if draft.prepared:
            self.runtime.obs.ssd_served()
        return drafter_pb2.DraftResponse(
            draft_tokens=draft.tokens,
            draft_probs=[encoded_to_proto(e) for e in draft.probs],
            cached_length=draft.cached_length,
            forward_ms=draft.forward_ms,
            prepared=draft.prepared,
            forward_cost=self.forward_cost(),
            draft_parents=draft.parents,
        )

    def speculate_call(
        self, request: drafter_pb2.SpeculateRequest
    ) -> ModelCall[drafter_pb2.SpeculateResponse]:
        """A Speculate request, validated, as the model call that answers it."""
        rt = self.ready_runtime()
        cfg = rt.config
        assert isinstance(cfg, DrafterConfig)  # a drafter serves a DrafterConfig
        branch_k = self._k(request.num_draft_tokens)  # the prepared drafts' length
        k = self._k(request.draft_length, "draft_length")  # the draft under verification
        new_tokens = list(request.new_tokens)
        prefix = prefix_from_proto(request.prefix)
        if prefix.length + len(new_tokens) < k + 1:
            raise InvalidRequest(
                f"the sequence must hold the draft and the token before it: at least "
                f"{k + 1} tokens, got {prefix.length + len(new_tokens)}"
            )
        fan_out = request.fan_out or cfg.ssd_fan_out
        if fan_out > MAX_FAN_OUT:
            raise InvalidRequest(f"fan_out must be at most {MAX_FAN_OUT}, got {fan_out}")
        alpha = cfg.ssd_acceptance_prior
        if request.HasField("acceptance_rate"):
            alpha = request.acceptance_rate
            if not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
                raise InvalidRequest(f"acceptance_rate must be in [0, 1], got {alpha}")
        params = SamplingParams.from_proto(request.sampling)
        # A branch adds its next token and branch_k drafts after the sequence.
        self.check_extent(request.session_id, prefix, new_tokens, branch_k + 1)
        controls = controls_from_proto(  # the sequence before the draft under verification
            params.processors, request.output, rt.vocab_size, prefix.length + len(new_tokens) - k
        )
        kind = HeadSpeculateCall if isinstance(rt, HeadRuntime) else SpeculateCall
        call = kind(
            runtime=rt,
            store=self.branches,
            session_id=request.session_id,
            prefix=prefix,
            new_tokens=new_tokens,
            k=k,
            branch_k=branch_k,
            params=params,
            fan_out=fan_out,
            alpha=alpha,
            max_per_outcome=cfg.ssd_max_per_outcome,
            max_branch_tokens=cfg.ssd_max_branch_tokens,
            controls=controls,
            outcomes=cfg.ssd_outcomes,
        )
        return ModelCall(call, self._speculate_response)

    def _speculate_response(self, result: SpeculateResult) -> drafter_pb2.SpeculateResponse:
        self.runtime.obs.ssd_prepared(len(result.branches))
        return drafter_pb2.SpeculateResponse(
            branches=[
                drafter_pb2.SpeculatedBranch(
                    accepted_count=b.accepted, next_token=b.next_token, draft_tokens=b.tokens
                )
                for b in result.branches
            ],
            cached_length=result.cached_length,
            forward_ms=result.forward_ms,
        )


def main(args: argparse.Namespace) -> None:
    run_replica(
        DrafterConfig,
        args,
        SERVICE_NAME,
        DrafterServicer,
        lambda servicer, server: drafter_pb2_grpc.add_DrafterServiceServicer_to_server(
            servicer, server
        ),
        runtime_type=drafter_runtime,
    )


def drafter_runtime(config: DrafterConfig) -> DrafterRuntime | HeadRuntime:
    """The drafter's engine: a head's (--head), else the draft model's."""
    return HeadRuntime(config) if config.head else DrafterRuntime(config)
