from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_MODE_CONTINUE: _ClassVar[SessionMode]
    SESSION_MODE_RESET: _ClassVar[SessionMode]

class SpeculationMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_METHOD_UNSPECIFIED: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_MODEL: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_NGRAM: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_SUFFIX: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_HYBRID: _ClassVar[SpeculationMethod]

class KPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    K_POLICY_UNSPECIFIED: _ClassVar[KPolicy]
    K_POLICY_FIXED: _ClassVar[KPolicy]
    K_POLICY_ADAPTIVE: _ClassVar[KPolicy]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
SESSION_MODE_CONTINUE: SessionMode
SESSION_MODE_RESET: SessionMode
SPECULATION_METHOD_UNSPECIFIED: SpeculationMethod
SPECULATION_METHOD_MODEL: SpeculationMethod
SPECULATION_METHOD_NGRAM: SpeculationMethod
SPECULATION_METHOD_SUFFIX: SpeculationMethod
SPECULATION_METHOD_HYBRID: SpeculationMethod
K_POLICY_UNSPECIFIED: KPolicy
K_POLICY_FIXED: KPolicy
K_POLICY_ADAPTIVE: KPolicy
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_new_tokens", "sampling", "stop", "session", "speculation", "ignore_eos", "min_tokens", "stop_token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "n", "structured_output", "prediction", "record")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: TokenIds
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    session: SessionOptions
    speculation: SpeculationParams
    ignore_eos: bool
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    n: int
    structured_output: StructuredOutput
    prediction: PredictedOutput
    record: bool
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., session: _Optional[_Union[SessionOptions, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., n: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prediction: _Optional[_Union[PredictedOutput, _Mapping]] = ..., record: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_object", "json_schema", "regex", "choice")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_object: StructuredJsonObject
    json_schema: str
    regex: str
    choice: StructuredChoice
    def __init__(self, json_object: _Optional[_Union[StructuredJsonObject, _Mapping]] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StructuredChoice, _Mapping]] = ...) -> None: ...

class StructuredJsonObject(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StructuredChoice(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class PredictedOutput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class SessionOptions(_message.Message):
    __slots__ = ("id", "mode", "ttl_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    mode: SessionMode
    ttl_seconds: int
    def __init__(self, id: _Optional[str] = ..., mode: _Optional[_Union[SessionMode, str]] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("num_draft_tokens", "ssd", "k_policy", "method", "tree_width")
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SSD_FIELD_NUMBER: _ClassVar[int]
    K_POLICY_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    num_draft_tokens: int
    ssd: bool
    k_policy: KPolicy
    method: SpeculationMethod
    tree_width: int
    def __init__(self, num_draft_tokens: _Optional[int] = ..., ssd: _Optional[bool] = ..., k_policy: _Optional[_Union[KPolicy, str]] = ..., method: _Optional[_Union[SpeculationMethod, str]] = ..., tree_width: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "history_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    history_tokens: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., history_tokens: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("time_to_first_token_ms", "total_ms")
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token_ms: float
    total_ms: float
    def __init__(self, time_to_first_token_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "accepted_per_position", "num_draft_tokens", "ssd", "ssd_hits", "ssd_misses", "cache_misses", "ssd_branches", "ssd_hidden_ms", "drafter_wait_ms", "ssd_bytes", "ssd_late", "ssd_speculates", "k_policy", "rounds_by_k", "mean_k", "policy_k0_rounds", "mean_fan_out", "ssd_paused_rounds", "mean_verifier_queue", "method", "by_source", "lookup_no_match_rounds", "tree_rounds", "tree_nodes", "tree_other_branch_rounds", "drafter_version", "recorded")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SSD_FIELD_NUMBER: _ClassVar[int]
    SSD_HITS_FIELD_NUMBER: _ClassVar[int]
    SSD_MISSES_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    SSD_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    SSD_HIDDEN_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_LATE_FIELD_NUMBER: _ClassVar[int]
    SSD_SPECULATES_FIELD_NUMBER: _ClassVar[int]
    K_POLICY_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_BY_K_FIELD_NUMBER: _ClassVar[int]
    MEAN_K_FIELD_NUMBER: _ClassVar[int]
    POLICY_K0_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_FAN_OUT_FIELD_NUMBER: _ClassVar[int]
    SSD_PAUSED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_VERIFIER_QUEUE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_NO_MATCH_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TREE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    TREE_OTHER_BRANCH_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    ssd: bool
    ssd_hits: int
    ssd_misses: int
    cache_misses: int
    ssd_branches: int
    ssd_hidden_ms: float
    drafter_wait_ms: float
    ssd_bytes: int
    ssd_late: int
    ssd_speculates: int
    k_policy: KPolicy
    rounds_by_k: _containers.RepeatedScalarFieldContainer[int]
    mean_k: float
    policy_k0_rounds: int
    mean_fan_out: float
    ssd_paused_rounds: int
    mean_verifier_queue: float
    method: SpeculationMethod
    by_source: _containers.RepeatedCompositeFieldContainer[DraftSourceStats]
    lookup_no_match_rounds: int
    tree_rounds: int
    tree_nodes: int
    tree_other_branch_rounds: int
    drafter_version: str
    recorded: bool
    def __init__(self, rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., ssd: _Optional[bool] = ..., ssd_hits: _Optional[int] = ..., ssd_misses: _Optional[int] = ..., cache_misses: _Optional[int] = ..., ssd_branches: _Optional[int] = ..., ssd_hidden_ms: _Optional[float] = ..., drafter_wait_ms: _Optional[float] = ..., ssd_bytes: _Optional[int] = ..., ssd_late: _Optional[int] = ..., ssd_speculates: _Optional[int] = ..., k_policy: _Optional[_Union[KPolicy, str]] = ..., rounds_by_k: _Optional[_Iterable[int]] = ..., mean_k: _Optional[float] = ..., policy_k0_rounds: _Optional[int] = ..., mean_fan_out: _Optional[float] = ..., ssd_paused_rounds: _Optional[int] = ..., mean_verifier_queue: _Optional[float] = ..., method: _Optional[_Union[SpeculationMethod, str]] = ..., by_source: _Optional[_Iterable[_Union[DraftSourceStats, _Mapping]]] = ..., lookup_no_match_rounds: _Optional[int] = ..., tree_rounds: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., tree_other_branch_rounds: _Optional[int] = ..., drafter_version: _Optional[str] = ..., recorded: _Optional[bool] = ...) -> None: ...

class DraftSourceStats(_message.Message):
    __slots__ = ("source", "drafts", "draft_tokens", "accepted_tokens")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    source: str
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    def __init__(self, source: _Optional[str] = ..., drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "timings", "stats", "session_id", "trace_id", "logprobs", "prompt_logprobs", "choices")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    stats: SpeculationStats
    session_id: str
    trace_id: str
    logprobs: _common_pb2.TokenLogprobs
    prompt_logprobs: _common_pb2.TokenLogprobs
    choices: _containers.RepeatedCompositeFieldContainer[GenerateChoice]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., session_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., choices: _Optional[_Iterable[_Union[GenerateChoice, _Mapping]]] = ...) -> None: ...

class GenerateChoice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "logprobs", "stats")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    logprobs: _common_pb2.TokenLogprobs
    stats: SpeculationStats
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "timings", "stats", "session_id", "trace_id", "logprobs", "prompt_logprobs", "index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    stats: SpeculationStats
    session_id: str
    trace_id: str
    logprobs: _common_pb2.TokenLogprobs
    prompt_logprobs: _common_pb2.TokenLogprobs
    index: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., session_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("model_id", "draft_model_id", "vocab_size", "max_context", "max_num_draft_tokens", "default_num_draft_tokens", "default_ssd", "max_new_tokens", "max_stop_strings", "max_stop_chars", "max_session_id_chars", "default_session_ttl_seconds", "max_session_ttl_seconds", "tokenizer_fingerprint", "eos_token_ids", "bos_token_id", "supported_request_fields", "max_stop_token_ids", "max_logit_bias", "max_top_logprobs", "max_choices", "structured_output_engine", "structured_output_kinds", "default_method", "lookup", "recording", "drafter_versions", "drafter_canary_version", "drafter_canary_percent", "sampling_defaults")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SSD_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_ID_CHARS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SESSION_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_REQUEST_FIELDS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHOICES_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_ENGINE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_KINDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_METHOD_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    RECORDING_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_CANARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_CANARY_PERCENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    draft_model_id: str
    vocab_size: int
    max_context: int
    max_num_draft_tokens: int
    default_num_draft_tokens: int
    default_ssd: bool
    max_new_tokens: int
    max_stop_strings: int
    max_stop_chars: int
    max_session_id_chars: int
    default_session_ttl_seconds: int
    max_session_ttl_seconds: int
    tokenizer_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    supported_request_fields: _containers.RepeatedScalarFieldContainer[str]
    max_stop_token_ids: int
    max_logit_bias: int
    max_top_logprobs: int
    max_choices: int
    structured_output_engine: str
    structured_output_kinds: _containers.RepeatedScalarFieldContainer[str]
    default_method: SpeculationMethod
    lookup: LookupInfo
    recording: bool
    drafter_versions: _containers.RepeatedScalarFieldContainer[str]
    drafter_canary_version: str
    drafter_canary_percent: float
    sampling_defaults: _common_pb2.SamplingParams
    def __init__(self, model_id: _Optional[str] = ..., draft_model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_num_draft_tokens: _Optional[int] = ..., default_num_draft_tokens: _Optional[int] = ..., default_ssd: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., max_stop_strings: _Optional[int] = ..., max_stop_chars: _Optional[int] = ..., max_session_id_chars: _Optional[int] = ..., default_session_ttl_seconds: _Optional[int] = ..., max_session_ttl_seconds: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., supported_request_fields: _Optional[_Iterable[str]] = ..., max_stop_token_ids: _Optional[int] = ..., max_logit_bias: _Optional[int] = ..., max_top_logprobs: _Optional[int] = ..., max_choices: _Optional[int] = ..., structured_output_engine: _Optional[str] = ..., structured_output_kinds: _Optional[_Iterable[str]] = ..., default_method: _Optional[_Union[SpeculationMethod, str]] = ..., lookup: _Optional[_Union[LookupInfo, _Mapping]] = ..., recording: _Optional[bool] = ..., drafter_versions: _Optional[_Iterable[str]] = ..., drafter_canary_version: _Optional[str] = ..., drafter_canary_percent: _Optional[float] = ..., sampling_defaults: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class LookupInfo(_message.Message):
    __slots__ = ("prompt_lookup_min", "prompt_lookup_max", "suffix_depth", "suffix_cache_tokens", "suffix_cache_scope", "tree_width", "max_tree_width")
    PROMPT_LOOKUP_MIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MAX_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    prompt_lookup_min: int
    prompt_lookup_max: int
    suffix_depth: int
    suffix_cache_tokens: int
    suffix_cache_scope: str
    tree_width: int
    max_tree_width: int
    def __init__(self, prompt_lookup_min: _Optional[int] = ..., prompt_lookup_max: _Optional[int] = ..., suffix_depth: _Optional[int] = ..., suffix_cache_tokens: _Optional[int] = ..., suffix_cache_scope: _Optional[str] = ..., tree_width: _Optional[int] = ..., max_tree_width: _Optional[int] = ...) -> None: ...
