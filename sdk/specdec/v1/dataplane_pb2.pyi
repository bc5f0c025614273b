from specdec.v1 import drafter_pb2 as _drafter_pb2
from specdec.v1 import verifier_pb2 as _verifier_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASON_UNSPECIFIED: _ClassVar[Reason]
    REASON_CACHE_MISS: _ClassVar[Reason]
    REASON_BUSY: _ClassVar[Reason]
    REASON_CAPACITY: _ClassVar[Reason]
    REASON_LOADING: _ClassVar[Reason]
    REASON_STOPPING: _ClassVar[Reason]
    REASON_KEEPALIVE_TIMEOUT: _ClassVar[Reason]
    REASON_DISCONNECTED: _ClassVar[Reason]
    REASON_VERSION_MISMATCH: _ClassVar[Reason]
    REASON_PROTOCOL_ERROR: _ClassVar[Reason]
REASON_UNSPECIFIED: Reason
REASON_CACHE_MISS: Reason
REASON_BUSY: Reason
REASON_CAPACITY: Reason
REASON_LOADING: Reason
REASON_STOPPING: Reason
REASON_KEEPALIVE_TIMEOUT: Reason
REASON_DISCONNECTED: Reason
REASON_VERSION_MISMATCH: Reason
REASON_PROTOCOL_ERROR: Reason

class DataCall(_message.Message):
    __slots__ = ("id", "traceparent", "draft", "speculate", "verify", "cancel", "ping")
    ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    id: int
    traceparent: str
    draft: _drafter_pb2.DraftRequest
    speculate: _drafter_pb2.SpeculateRequest
    verify: _verifier_pb2.VerifyRequest
    cancel: CancelCall
    ping: Ping
    def __init__(self, id: _Optional[int] = ..., traceparent: _Optional[str] = ..., draft: _Optional[_Union[_drafter_pb2.DraftRequest, _Mapping]] = ..., speculate: _Optional[_Union[_drafter_pb2.SpeculateRequest, _Mapping]] = ..., verify: _Optional[_Union[_verifier_pb2.VerifyRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelCall, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ...) -> None: ...

class CancelCall(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Ping(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    def __init__(self, nonce: _Optional[int] = ...) -> None: ...

class DataReply(_message.Message):
    __slots__ = ("id", "draft", "speculate", "verify", "error", "pong")
    ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    id: int
    draft: _drafter_pb2.DraftResponse
    speculate: _drafter_pb2.SpeculateResponse
    verify: _verifier_pb2.VerifyResponse
    error: CallError
    pong: Ping
    def __init__(self, id: _Optional[int] = ..., draft: _Optional[_Union[_drafter_pb2.DraftResponse, _Mapping]] = ..., speculate: _Optional[_Union[_drafter_pb2.SpeculateResponse, _Mapping]] = ..., verify: _Optional[_Union[_verifier_pb2.VerifyResponse, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ..., pong: _Optional[_Union[Ping, _Mapping]] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: Reason
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[_Union[Reason, str]] = ...) -> None: ...
