"""Proto <-> domain conversions for the drafter and the verifier (the edges of the math)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.common.errors import InvalidRequest
from specdec.replica.engine import Prefix
from specdec.replica.masks import InvalidMask, decode_mask, stack_masks
from specdec.replica.sampling import EncodedProbs, InvalidDistribution, decode_probs
from specdec.v1 import common_pb2, verifier_pb2


def prefix_from_proto(msg: common_pb2.CachedPrefix) -> Prefix:
    return Prefix(length=int(msg.length), hash=int(msg.hash))


def encoded_to_proto(enc: EncodedProbs) -> common_pb2.DraftDistribution:
    if enc.is_sparse:
        assert enc.token_ids is not None and enc.probs is not None
        return common_pb2.DraftDistribution(
            sparse=common_pb2.SparseProbs(
                token_ids=enc.token_ids.tolist(), probs=enc.probs.tolist()
            )
        )
    assert enc.dense is not None
    return common_pb2.DraftDistribution(
        dense=common_pb2.DenseProbs(
            format=common_pb2.PROB_FORMAT_FLOAT16, data=enc.dense.numpy().tobytes()
        )
    )


def encoded_from_proto(msg: common_pb2.DraftDistribution) -> EncodedProbs:
    kind = msg.WhichOneof("probs")
    if kind == "sparse":
        return EncodedProbs(
            token_ids=torch.tensor(list(msg.sparse.token_ids), dtype=torch.int64),
            probs=torch.tensor(list(msg.sparse.probs), dtype=torch.float32),
        )
    if kind == "dense":
        fmt = msg.dense.format
        dtype = {
            common_pb2.PROB_FORMAT_FLOAT16: torch.float16,
            common_pb2.PROB_FORMAT_BFLOAT16: torch.bfloat16,
        }.get(fmt)
        if dtype is None:
            raise InvalidDistribution(f"dense distribution has unknown format {fmt}")
        if not msg.dense.data:
            raise InvalidDistribution("dense distribution has no data")
        if len(msg.dense.data) % 2:
            raise InvalidDistribution("dense distribution data has an odd number of bytes")
        return EncodedProbs(dense=torch.frombuffer(bytearray(msg.dense.data), dtype=dtype))
    raise InvalidDistribution("draft distribution is empty (neither sparse nor dense)")


def decode_draft_probs(
    msgs: Sequence[common_pb2.DraftDistribution], vocab_size: int
) -> torch.Tensor:
    """Draft distributions from the wire -> probs [k, vocab] fp32 (InvalidRequest if bad)."""
    try:
        rows = [decode_probs(encoded_from_proto(m), vocab_size) for m in msgs]
    except InvalidDistribution as e:
        raise InvalidRequest(f"draft_probs: {e}") from None
    return torch.stack(rows) if rows else torch.empty(0, vocab_size)


def decode_grammar_masks(
    msgs: Sequence[verifier_pb2.GrammarMask], rows: int, vocab_size: int
) -> torch.Tensor | None:
    """A Verify's grammar masks (verifier_pb2.GrammarMask [rows], or none) -> allowed
    [rows, vocab] bool, or None without a grammar (InvalidRequest if bad)."""
    if not msgs:
        return None
    if len(msgs) != rows:
        raise InvalidRequest(
            f"grammar_masks has {len(msgs)} masks for {rows} verified positions (draft + 1)"
        )
    try:
        masks = [decode_mask(m.allowed_bits, m.allowed_ids, vocab_size) for m in msgs]
    except InvalidMask as e:
        raise InvalidRequest(f"grammar_masks: {e}") from None
    return stack_masks(masks, vocab_size)
