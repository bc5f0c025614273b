from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "prefix", "new_tokens", "num_draft_tokens", "sampling", "output", "fork_from", "tree_nodes", "tree_width", "tree_depth")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FORK_FROM_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefix: _common_pb2.CachedPrefix
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    sampling: _common_pb2.SamplingParams
    output: _common_pb2.OutputControls
    fork_from: str
    tree_nodes: int
    tree_width: int
    tree_depth: int
    def __init__(self, session_id: _Optional[str] = ..., prefix: _Optional[_Union[_common_pb2.CachedPrefix, _Mapping]] = ..., new_tokens: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output: _Optional[_Union[_common_pb2.OutputControls, _Mapping]] = ..., fork_from: _Optional[str] = ..., tree_nodes: _Optional[int] = ..., tree_width: _Optional[int] = ..., tree_depth: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("draft_tokens", "draft_probs", "cached_length", "forward_ms", "prepared", "forward_cost", "draft_parents")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COST_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftDistribution]
    cached_length: int
    forward_ms: float
    prepared: bool
    forward_cost: _common_pb2.ForwardCost
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.DraftDistribution, _Mapping]]] = ..., cached_length: _Optional[int] = ..., forward_ms: _Optional[float] = ..., prepared: _Optional[bool] = ..., forward_cost: _Optional[_Union[_common_pb2.ForwardCost, _Mapping]] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("session_id", "prefix", "new_tokens", "draft_length", "num_draft_tokens", "sampling", "fan_out", "acceptance_rate", "output")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FAN_OUT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefix: _common_pb2.CachedPrefix
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_length: int
    num_draft_tokens: int
    sampling: _common_pb2.SamplingParams
    fan_out: int
    acceptance_rate: float
    output: _common_pb2.OutputControls
    def __init__(self, session_id: _Optional[str] = ..., prefix: _Optional[_Union[_common_pb2.CachedPrefix, _Mapping]] = ..., new_tokens: _Optional[_Iterable[int]] = ..., draft_length: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., fan_out: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., output: _Optional[_Union[_common_pb2.OutputControls, _Mapping]] = ...) -> None: ...

class SpeculatedBranch(_message.Message):
    __slots__ = ("accepted_count", "next_token", "draft_tokens")
    ACCEPTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted_count: int
    next_token: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, accepted_count: _Optional[int] = ..., next_token: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("branches", "cached_length", "forward_ms")
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    CACHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    branches: _containers.RepeatedCompositeFieldContainer[SpeculatedBranch]
    cached_length: int
    forward_ms: float
    def __init__(self, branches: _Optional[_Iterable[_Union[SpeculatedBranch, _Mapping]]] = ..., cached_length: _Optional[int] = ..., forward_ms: _Optional[float] = ...) -> None: ...
