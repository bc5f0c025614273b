"""DrafterService: a thin servicer over specdec.drafter.proposer."""

from __future__ import annotations

import argparse

from specdec.common.convert import encoded_to_proto, prefix_from_proto
from specdec.common.errors import InvalidRequest
from specdec.common.params import sampling_from_proto
from specdec.common.replica import ReplicaServicer, run_replica
from specdec.common.serving import rpc_errors
from specdec.drafter.proposer import propose
from specdec.v1 import drafter_pb2, drafter_pb2_grpc

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


class DrafterServicer(ReplicaServicer, drafter_pb2_grpc.DrafterServiceServicer):
    @rpc_errors
    async def Draft(self, request: drafter_pb2.DraftRequest, context) -> drafter_pb2.DraftResponse:
        rt = self.ready_runtime()
        k = request.num_draft_tokens
        if not 1 <= k <= rt.config.max_draft_tokens:
            raise InvalidRequest(
                f"num_draft_tokens must be in [1, {rt.config.max_draft_tokens}], got {k}"
            )
        params = sampling_from_proto(request.sampling)
        prefix = prefix_from_proto(request.prefix)
        new_tokens = list(request.new_tokens)
        self.check_extent(request.session_id, prefix, new_tokens, k)
        draft = await rt.run(propose, rt, request.session_id, prefix, new_tokens, k, params)
        return drafter_pb2.DraftResponse(
            draft_tokens=draft.tokens,
            draft_probs=[encoded_to_proto(e) for e in draft.probs],
            cached_length=draft.cached_length,
            forward_ms=draft.forward_ms,
        )


def main(args: argparse.Namespace) -> None:
    run_replica(
        "drafter",
        args,
        SERVICE_NAME,
        DrafterServicer,
        lambda servicer, server: drafter_pb2_grpc.add_DrafterServiceServicer_to_server(
            servicer, server
        ),
    )
