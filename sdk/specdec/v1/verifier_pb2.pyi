from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NextTokenKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NEXT_TOKEN_KIND_UNSPECIFIED: _ClassVar[NextTokenKind]
    NEXT_TOKEN_KIND_RECOVERED: _ClassVar[NextTokenKind]
    NEXT_TOKEN_KIND_BONUS: _ClassVar[NextTokenKind]
NEXT_TOKEN_KIND_UNSPECIFIED: NextTokenKind
NEXT_TOKEN_KIND_RECOVERED: NextTokenKind
NEXT_TOKEN_KIND_BONUS: NextTokenKind

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "prefix", "new_tokens", "draft_tokens", "draft_probs", "draft_parents", "sampling", "output", "logprobs", "top_logprobs", "prompt_logprobs", "fork_from", "grammar_masks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORK_FROM_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_MASKS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefix: _common_pb2.CachedPrefix
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftDistribution]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    output: _common_pb2.OutputControls
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    fork_from: str
    grammar_masks: _containers.RepeatedCompositeFieldContainer[GrammarMask]
    def __init__(self, session_id: _Optional[str] = ..., prefix: _Optional[_Union[_common_pb2.CachedPrefix, _Mapping]] = ..., new_tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.DraftDistribution, _Mapping]]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output: _Optional[_Union[_common_pb2.OutputControls, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., fork_from: _Optional[str] = ..., grammar_masks: _Optional[_Iterable[_Union[GrammarMask, _Mapping]]] = ...) -> None: ...

class GrammarMask(_message.Message):
    __slots__ = ("allowed_bits", "allowed_ids")
    ALLOWED_BITS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_IDS_FIELD_NUMBER: _ClassVar[int]
    allowed_bits: bytes
    allowed_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, allowed_bits: _Optional[bytes] = ..., allowed_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted_count", "next_token", "next_token_kind", "cached_length", "forward_ms", "queue_depth", "forward_cost", "accepted_path", "logprobs", "prompt_logprobs")
    ACCEPTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_KIND_FIELD_NUMBER: _ClassVar[int]
    CACHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COST_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PATH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    accepted_count: int
    next_token: int
    next_token_kind: NextTokenKind
    cached_length: int
    forward_ms: float
    queue_depth: int
    forward_cost: _common_pb2.ForwardCost
    accepted_path: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _common_pb2.TokenLogprobs
    prompt_logprobs: _common_pb2.TokenLogprobs
    def __init__(self, accepted_count: _Optional[int] = ..., next_token: _Optional[int] = ..., next_token_kind: _Optional[_Union[NextTokenKind, str]] = ..., cached_length: _Optional[int] = ..., forward_ms: _Optional[float] = ..., queue_depth: _Optional[int] = ..., forward_cost: _Optional[_Union[_common_pb2.ForwardCost, _Mapping]] = ..., accepted_path: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...
