from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Spec(_message.Message):
    __slots__ = ("model", "revision", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_tokens", "kind")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    kind: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_tokens: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("hash_scheme", "protocol_version", "spec", "namespace", "spec_digest")
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SPEC_DIGEST_FIELD_NUMBER: _ClassVar[int]
    hash_scheme: str
    protocol_version: str
    spec: Spec
    namespace: bytes
    spec_digest: bytes
    def __init__(self, hash_scheme: _Optional[str] = ..., protocol_version: _Optional[str] = ..., spec: _Optional[_Union[Spec, _Mapping]] = ..., namespace: _Optional[bytes] = ..., spec_digest: _Optional[bytes] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("node_id", "hash_scheme", "protocol_version", "arena_path", "arena_bytes", "lease_ttl_ms", "max_batch_blocks", "block_bytes", "arena_socket", "data_ticket", "data_ticket_key", "data_ticket_ttl_ms", "arena_segment_bytes", "local_socket", "local_key_id", "local_key", "arena_page_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ARENA_SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LOCAL_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_KEY_FIELD_NUMBER: _ClassVar[int]
    ARENA_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    hash_scheme: str
    protocol_version: str
    arena_path: str
    arena_bytes: int
    lease_ttl_ms: int
    max_batch_blocks: int
    block_bytes: int
    arena_socket: str
    data_ticket: bytes
    data_ticket_key: bytes
    data_ticket_ttl_ms: int
    arena_segment_bytes: int
    local_socket: str
    local_key_id: bytes
    local_key: bytes
    arena_page_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., hash_scheme: _Optional[str] = ..., protocol_version: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., max_batch_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., arena_socket: _Optional[str] = ..., data_ticket: _Optional[bytes] = ..., data_ticket_key: _Optional[bytes] = ..., data_ticket_ttl_ms: _Optional[int] = ..., arena_segment_bytes: _Optional[int] = ..., local_socket: _Optional[str] = ..., local_key_id: _Optional[bytes] = ..., local_key: _Optional[bytes] = ..., arena_page_bytes: _Optional[int] = ...) -> None: ...

class HashesRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "release_lease_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    hashes: bytes
    release_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., hashes: _Optional[bytes] = ..., release_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("hits",)
    HITS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    def __init__(self, hits: _Optional[int] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("lease_id", "offsets", "checksums", "block_bytes", "expires_in_ms", "segment_generations")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    expires_in_ms: int
    segment_generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., expires_in_ms: _Optional[int] = ..., segment_generations: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("expired",)
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    expired: int
    def __init__(self, expired: _Optional[int] = ...) -> None: ...

class PutStartReply(_message.Message):
    __slots__ = ("put_id", "indices", "offsets", "already_present", "in_flight", "block_bytes", "segment_generations")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    put_id: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    already_present: _containers.RepeatedScalarFieldContainer[int]
    in_flight: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    segment_generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, put_id: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., already_present: _Optional[_Iterable[int]] = ..., in_flight: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., segment_generations: _Optional[_Iterable[int]] = ...) -> None: ...

class PutCommitRequest(_message.Message):
    __slots__ = ("put_id", "checksums")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    put_id: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, put_id: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class PutCommitReply(_message.Message):
    __slots__ = ("committed", "checksum_failed")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    checksum_failed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, committed: _Optional[int] = ..., checksum_failed: _Optional[_Iterable[int]] = ...) -> None: ...

class PutAbortRequest(_message.Message):
    __slots__ = ("put_id",)
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    put_id: int
    def __init__(self, put_id: _Optional[int] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class ReportCorruptReply(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "hard", "ttl_ms", "unpin")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    HARD_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    hashes: bytes
    hard: bool
    ttl_ms: int
    unpin: bool
    def __init__(self, namespace: _Optional[bytes] = ..., hashes: _Optional[bytes] = ..., hard: _Optional[bool] = ..., ttl_ms: _Optional[int] = ..., unpin: _Optional[bool] = ...) -> None: ...

class PinReply(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: int
    def __init__(self, changed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespace", "namespaces_after", "namespaces_limit")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_AFTER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    namespaces_after: bytes
    namespaces_limit: int
    def __init__(self, namespace: _Optional[bytes] = ..., namespaces_after: _Optional[bytes] = ..., namespaces_limit: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("what", "namespace", "hashes", "token_ids", "limit")
    WHAT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    what: str
    namespace: bytes
    hashes: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    limit: int
    def __init__(self, what: _Optional[str] = ..., namespace: _Optional[bytes] = ..., hashes: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., limit: _Optional[int] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("from_seq", "namespace", "all_namespaces")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    namespace: bytes
    all_namespaces: bool
    def __init__(self, from_seq: _Optional[int] = ..., namespace: _Optional[bytes] = ..., all_namespaces: _Optional[bool] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("node_id", "seq", "kind", "hashes", "tier", "namespace", "block_tokens")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    seq: int
    kind: str
    hashes: bytes
    tier: str
    namespace: bytes
    block_tokens: int
    def __init__(self, node_id: _Optional[str] = ..., seq: _Optional[int] = ..., kind: _Optional[str] = ..., hashes: _Optional[bytes] = ..., tier: _Optional[str] = ..., namespace: _Optional[bytes] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("namespace", "all_namespaces")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    all_namespaces: bool
    def __init__(self, namespace: _Optional[bytes] = ..., all_namespaces: _Optional[bool] = ...) -> None: ...

class SnapshotReply(_message.Message):
    __slots__ = ("node_id", "last_seq", "hashes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    last_seq: int
    hashes: bytes
    def __init__(self, node_id: _Optional[str] = ..., last_seq: _Optional[int] = ..., hashes: _Optional[bytes] = ...) -> None: ...
