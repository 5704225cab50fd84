from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_LENGTH: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ["open"]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    open: OpenSessionRequest
    def __init__(self, open: _Optional[_Union[OpenSessionRequest, _Mapping]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ["opened", "step"]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    opened: OpenSessionResponse
    step: StepResult
    def __init__(self, opened: _Optional[_Union[OpenSessionResponse, _Mapping]] = ..., step: _Optional[_Union[StepResult, _Mapping]] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ["code", "message", "current_position"]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_POSITION_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    current_position: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., current_position: _Optional[int] = ...) -> None: ...

class Logits(_message.Message):
    __slots__ = ["rows", "vocab_size", "float32"]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    FLOAT32_FIELD_NUMBER: _ClassVar[int]
    rows: int
    vocab_size: int
    float32: bytes
    def __init__(self, rows: _Optional[int] = ..., vocab_size: _Optional[int] = ..., float32: _Optional[bytes] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ["temperature", "top_k", "top_p", "seed"]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ["protocol_version", "model_id", "model_type", "vocab_size", "eos_ids", "max_context", "max_k", "layer_kinds", "rollback_mode", "has_tokenizer", "n_slots", "device", "dtype", "trims_drafts", "server_drafters"]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    LAYER_KINDS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_MODE_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    N_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRIMS_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SERVER_DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    model_id: str
    model_type: str
    vocab_size: int
    eos_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    max_k: int
    layer_kinds: _containers.RepeatedScalarFieldContainer[str]
    rollback_mode: str
    has_tokenizer: bool
    n_slots: int
    device: str
    dtype: str
    trims_drafts: bool
    server_drafters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[str] = ..., model_id: _Optional[str] = ..., model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., max_k: _Optional[int] = ..., layer_kinds: _Optional[_Iterable[str]] = ..., rollback_mode: _Optional[str] = ..., has_tokenizer: bool = ..., n_slots: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., trims_drafts: bool = ..., server_drafters: _Optional[_Iterable[str]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ["prompt_ids", "text", "sampling", "max_new_tokens", "request_id", "return_logits", "verify_all_drafts", "server_drafter", "server_draft_k"]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_ALL_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SERVER_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    SERVER_DRAFT_K_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    sampling: Sampling
    max_new_tokens: int
    request_id: str
    return_logits: bool
    verify_all_drafts: bool
    server_drafter: str
    server_draft_k: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., return_logits: bool = ..., verify_all_drafts: bool = ..., server_drafter: _Optional[str] = ..., server_draft_k: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ["session_id", "position", "first_token", "finish_reason", "prompt_ids", "logits"]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    first_token: int
    finish_reason: FinishReason
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    logits: Logits
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., first_token: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., logits: _Optional[_Union[Logits, _Mapping]] = ...) -> None: ...

class VerifyStep(_message.Message):
    __slots__ = ["session_id", "expected_position", "draft_ids", "draft_probs", "request_id", "return_logits"]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    expected_position: int
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: bytes
    request_id: str
    return_logits: bool
    def __init__(self, session_id: _Optional[str] = ..., expected_position: _Optional[int] = ..., draft_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[bytes] = ..., request_id: _Optional[str] = ..., return_logits: bool = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ["status", "session_id", "request_id", "accepted", "tokens", "position", "finish_reason", "logits", "verified_drafts", "proposed_drafts"]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    session_id: str
    request_id: str
    accepted: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    position: int
    finish_reason: FinishReason
    logits: Logits
    verified_drafts: int
    proposed_drafts: int
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ..., session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., accepted: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., position: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., logits: _Optional[_Union[Logits, _Mapping]] = ..., verified_drafts: _Optional[int] = ..., proposed_drafts: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ["steps"]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[VerifyStep]
    def __init__(self, steps: _Optional[_Iterable[_Union[VerifyStep, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ["results"]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ["session_id"]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ["closed"]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: bool = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class Histogram(_message.Message):
    __slots__ = ["upper_bounds", "counts", "sum", "count"]
    UPPER_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    upper_bounds: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    sum: float
    count: int
    def __init__(self, upper_bounds: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., sum: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ["engine_steps", "steps", "rows", "drafts", "draft_tokens", "accepted_tokens", "drafted_per_position", "accepted_per_position", "mean_acceptance_length", "rows_per_batch", "step_latency_ms", "open_sessions", "free_slots", "errors", "graph_captures", "trimmed_drafts", "engine_seconds"]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    STEP_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_CAPTURES_FIELD_NUMBER: _ClassVar[int]
    TRIMMED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine_steps: int
    steps: int
    rows: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    drafted_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    mean_acceptance_length: float
    rows_per_batch: Histogram
    step_latency_ms: Histogram
    open_sessions: int
    free_slots: int
    errors: int
    graph_captures: int
    trimmed_drafts: int
    engine_seconds: float
    def __init__(self, engine_steps: _Optional[int] = ..., steps: _Optional[int] = ..., rows: _Optional[int] = ..., drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., drafted_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., mean_acceptance_length: _Optional[float] = ..., rows_per_batch: _Optional[_Union[Histogram, _Mapping]] = ..., step_latency_ms: _Optional[_Union[Histogram, _Mapping]] = ..., open_sessions: _Optional[int] = ..., free_slots: _Optional[int] = ..., errors: _Optional[int] = ..., graph_captures: _Optional[int] = ..., trimmed_drafts: _Optional[int] = ..., engine_seconds: _Optional[float] = ...) -> None: ...
