from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "prefix", "new_tokens", "num_draft_tokens", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefix: _common_pb2.CachedPrefix
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    sampling: _common_pb2.SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., prefix: _Optional[_Union[_common_pb2.CachedPrefix, _Mapping]] = ..., new_tokens: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("draft_tokens", "draft_probs", "cached_length", "forward_ms")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftDistribution]
    cached_length: int
    forward_ms: float
    def __init__(self, draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.DraftDistribution, _Mapping]]] = ..., cached_length: _Optional[int] = ..., forward_ms: _Optional[float] = ...) -> None: ...
