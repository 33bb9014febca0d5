from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Slo(_message.Message):
    __slots__ = ("ttft_ms", "tpot_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    tpot_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("token_ids", "hashes", "input_tokens", "output_tokens", "slo", "request_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    hashes: bytes
    input_tokens: int
    output_tokens: int
    slo: Slo
    request_id: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., hashes: _Optional[bytes] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ..., request_id: _Optional[int] = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("rejected", "reason", "prefill_kind", "prefill_instance", "decode_instance", "expected_hit_blocks", "expected_hit_tokens", "expected_ttft_ms", "expected_tpot_ms", "decision_us")
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_KIND_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    DECISION_US_FIELD_NUMBER: _ClassVar[int]
    rejected: bool
    reason: str
    prefill_kind: str
    prefill_instance: str
    decode_instance: str
    expected_hit_blocks: int
    expected_hit_tokens: int
    expected_ttft_ms: float
    expected_tpot_ms: float
    decision_us: float
    def __init__(self, rejected: _Optional[bool] = ..., reason: _Optional[str] = ..., prefill_kind: _Optional[str] = ..., prefill_instance: _Optional[str] = ..., decode_instance: _Optional[str] = ..., expected_hit_blocks: _Optional[int] = ..., expected_hit_tokens: _Optional[int] = ..., expected_ttft_ms: _Optional[float] = ..., expected_tpot_ms: _Optional[float] = ..., decision_us: _Optional[float] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("instance", "queue_ms", "outstanding_requests", "outstanding_tokens", "active_requests", "context_tokens")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    instance: str
    queue_ms: float
    outstanding_requests: int
    outstanding_tokens: int
    active_requests: int
    context_tokens: int
    def __init__(self, instance: _Optional[str] = ..., queue_ms: _Optional[float] = ..., outstanding_requests: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., active_requests: _Optional[int] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("policy", "instances", "indexed_blocks", "events_applied", "resyncs", "last_seq", "decisions", "rejections")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    instances: _containers.RepeatedScalarFieldContainer[str]
    indexed_blocks: int
    events_applied: int
    resyncs: int
    last_seq: int
    decisions: int
    rejections: int
    def __init__(self, policy: _Optional[str] = ..., instances: _Optional[_Iterable[str]] = ..., indexed_blocks: _Optional[int] = ..., events_applied: _Optional[int] = ..., resyncs: _Optional[int] = ..., last_seq: _Optional[int] = ..., decisions: _Optional[int] = ..., rejections: _Optional[int] = ...) -> None: ...
