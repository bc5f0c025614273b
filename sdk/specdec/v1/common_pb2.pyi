from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProbFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROB_FORMAT_UNSPECIFIED: _ClassVar[ProbFormat]
    PROB_FORMAT_FLOAT16: _ClassVar[ProbFormat]
    PROB_FORMAT_BFLOAT16: _ClassVar[ProbFormat]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_DRAFTER: _ClassVar[Role]
    ROLE_VERIFIER: _ClassVar[Role]
PROB_FORMAT_UNSPECIFIED: ProbFormat
PROB_FORMAT_FLOAT16: ProbFormat
PROB_FORMAT_BFLOAT16: ProbFormat
ROLE_UNSPECIFIED: Role
ROLE_DRAFTER: Role
ROLE_VERIFIER: Role

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "model_defaults", "min_p")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MODEL_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    model_defaults: bool
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., model_defaults: _Optional[bool] = ..., min_p: _Optional[float] = ...) -> None: ...

class OutputControls(_message.Message):
    __slots__ = ("output_start", "min_tokens", "min_tokens_ids")
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_IDS_FIELD_NUMBER: _ClassVar[int]
    output_start: int
    min_tokens: int
    min_tokens_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, output_start: _Optional[int] = ..., min_tokens: _Optional[int] = ..., min_tokens_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CachedPrefix(_message.Message):
    __slots__ = ("length", "hash")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    length: int
    hash: int
    def __init__(self, length: _Optional[int] = ..., hash: _Optional[int] = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("sparse", "dense")
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    sparse: SparseProbs
    dense: DenseProbs
    def __init__(self, sparse: _Optional[_Union[SparseProbs, _Mapping]] = ..., dense: _Optional[_Union[DenseProbs, _Mapping]] = ...) -> None: ...

class SparseProbs(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DenseProbs(_message.Message):
    __slots__ = ("format", "data")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    format: ProbFormat
    data: bytes
    def __init__(self, format: _Optional[_Union[ProbFormat, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("include_tokenizer",)
    INCLUDE_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    include_tokenizer: bool
    def __init__(self, include_tokenizer: _Optional[bool] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("role", "model_id", "vocab_size", "tokenizer_fingerprint", "max_context", "max_draft_tokens", "eos_token_ids", "dtype", "dtype_reason", "device", "max_cached_tokens", "cached_tokens", "cached_sessions", "replica_id", "tokenizer_json_zlib", "chat_template", "bos_token_id", "special_tokens", "data_port", "model_version", "engine", "tensor_parallel", "sampling_defaults", "compiled", "compile_seconds", "forward_cost")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_ZLIB_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    COMPILED_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COST_FIELD_NUMBER: _ClassVar[int]
    role: Role
    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_context: int
    max_draft_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    dtype_reason: str
    device: str
    max_cached_tokens: int
    cached_tokens: int
    cached_sessions: int
    replica_id: str
    tokenizer_json_zlib: bytes
    chat_template: str
    bos_token_id: int
    special_tokens: _containers.ScalarMap[str, str]
    data_port: int
    model_version: str
    engine: str
    tensor_parallel: int
    sampling_defaults: SamplingParams
    compiled: bool
    compile_seconds: float
    forward_cost: ForwardCost
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_context: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., dtype_reason: _Optional[str] = ..., device: _Optional[str] = ..., max_cached_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_sessions: _Optional[int] = ..., replica_id: _Optional[str] = ..., tokenizer_json_zlib: _Optional[bytes] = ..., chat_template: _Optional[str] = ..., bos_token_id: _Optional[int] = ..., special_tokens: _Optional[_Mapping[str, str]] = ..., data_port: _Optional[int] = ..., model_version: _Optional[str] = ..., engine: _Optional[str] = ..., tensor_parallel: _Optional[int] = ..., sampling_defaults: _Optional[_Union[SamplingParams, _Mapping]] = ..., compiled: _Optional[bool] = ..., compile_seconds: _Optional[float] = ..., forward_cost: _Optional[_Union[ForwardCost, _Mapping]] = ...) -> None: ...

class ForwardCost(_message.Message):
    __slots__ = ("buckets",)
    class Bucket(_message.Message):
        __slots__ = ("rows", "base_ms", "per_token_ms", "samples", "widest", "step_ms")
        ROWS_FIELD_NUMBER: _ClassVar[int]
        BASE_MS_FIELD_NUMBER: _ClassVar[int]
        PER_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
        SAMPLES_FIELD_NUMBER: _ClassVar[int]
        WIDEST_FIELD_NUMBER: _ClassVar[int]
        STEP_MS_FIELD_NUMBER: _ClassVar[int]
        rows: int
        base_ms: float
        per_token_ms: float
        samples: float
        widest: int
        step_ms: float
        def __init__(self, rows: _Optional[int] = ..., base_ms: _Optional[float] = ..., per_token_ms: _Optional[float] = ..., samples: _Optional[float] = ..., widest: _Optional[int] = ..., step_ms: _Optional[float] = ...) -> None: ...
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[ForwardCost.Bucket]
    def __init__(self, buckets: _Optional[_Iterable[_Union[ForwardCost.Bucket, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "num_top", "top_token_ids", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_top: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., num_top: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
