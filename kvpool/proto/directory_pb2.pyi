from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NamespaceSpec(_message.Message):
    __slots__ = ("namespace", "spec_digest", "spec_json")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SPEC_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    spec_digest: bytes
    spec_json: str
    def __init__(self, namespace: _Optional[bytes] = ..., spec_digest: _Optional[bytes] = ..., spec_json: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "control_address", "data_address", "transport", "host", "capacity_bytes", "used_bytes", "alive", "transport_metadata")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    control_address: str
    data_address: str
    transport: str
    host: str
    capacity_bytes: int
    used_bytes: int
    alive: bool
    transport_metadata: bytes
    def __init__(self, node_id: _Optional[str] = ..., control_address: _Optional[str] = ..., data_address: _Optional[str] = ..., transport: _Optional[str] = ..., host: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., alive: _Optional[bool] = ..., transport_metadata: _Optional[bytes] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node", "hash_scheme", "namespaces", "incarnation", "last_seq", "tiers", "keys")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    hash_scheme: str
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceSpec]
    incarnation: int
    last_seq: int
    tiers: bytes
    keys: bytes
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., hash_scheme: _Optional[str] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceSpec, _Mapping]]] = ..., incarnation: _Optional[int] = ..., last_seq: _Optional[int] = ..., tiers: _Optional[bytes] = ..., keys: _Optional[bytes] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("epoch", "leader")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    leader: str
    def __init__(self, epoch: _Optional[int] = ..., leader: _Optional[str] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("seq", "kind", "hashes", "tier", "namespace")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: str
    hashes: bytes
    tier: str
    namespace: bytes
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[str] = ..., hashes: _Optional[bytes] = ..., tier: _Optional[str] = ..., namespace: _Optional[bytes] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "used_bytes", "capacity_bytes", "events", "namespaces")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    used_bytes: int
    capacity_bytes: int
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceSpec]
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceSpec, _Mapping]]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("resync", "acked_seq")
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    resync: bool
    acked_seq: int
    def __init__(self, resync: _Optional[bool] = ..., acked_seq: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "lease_ms", "client_node", "for_read")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NODE_FIELD_NUMBER: _ClassVar[int]
    FOR_READ_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    hashes: bytes
    lease_ms: int
    client_node: str
    for_read: bool
    def __init__(self, namespace: _Optional[bytes] = ..., hashes: _Optional[bytes] = ..., lease_ms: _Optional[int] = ..., client_node: _Optional[str] = ..., for_read: _Optional[bool] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("hits", "nodes", "holder_masks", "tiers", "lease_id")
    HITS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    HOLDER_MASKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    hits: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    holder_masks: _containers.RepeatedScalarFieldContainer[int]
    tiers: bytes
    lease_id: int
    def __init__(self, hits: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., holder_masks: _Optional[_Iterable[int]] = ..., tiers: _Optional[bytes] = ..., lease_id: _Optional[int] = ...) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("namespace", "blocks", "block_bytes", "client_node", "replicas")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    blocks: int
    block_bytes: int
    client_node: str
    replicas: int
    def __init__(self, namespace: _Optional[bytes] = ..., blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., client_node: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class PlaceReply(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class LeaseRelease(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("namespace", "hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    hashes: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., hashes: _Optional[bytes] = ...) -> None: ...

class RemoveReply(_message.Message):
    __slots__ = ("removed", "deferred")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    deferred: int
    def __init__(self, removed: _Optional[int] = ..., deferred: _Optional[int] = ...) -> None: ...

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
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class LeaderRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaderReply(_message.Message):
    __slots__ = ("leader", "is_leader")
    LEADER_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    leader: str
    is_leader: bool
    def __init__(self, leader: _Optional[str] = ..., is_leader: _Optional[bool] = ...) -> None: ...

class NodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodesReply(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...
