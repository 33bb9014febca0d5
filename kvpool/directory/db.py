"""The directory's durable state in RocksDB (rocksdict): what ``DirectoryState.flush``
writes and a restarted directory loads (docs/cluster.md)."""

from __future__ import annotations

import itertools
import json
import struct
from typing import TYPE_CHECKING, Any

from kvpool.core.errors import InvalidArgument

if TYPE_CHECKING:
    from kvpool.directory.state import NodeRecord


class DirectoryDB:
    """RocksDB (rocksdict) under ``path``: node registry, each node's last known blocks,
    namespaces and the epoch counter. Written by ``DirectoryState.flush``.

    A node is two rows, ``node/<id>`` (JSON, with its last applied seq) and ``keys/<id>`` (its
    blocks), written by two puts: a crash between them must not pair a new seq with an old
    key list (the node's stream would then continue with no resync and the directory would
    offer blocks the node removed). So every ``put_node`` stamps both rows with the same
    write stamp, unique over the database's life (the open count and a per-open write
    counter); ``nodes`` returns ``None`` as the key list of a node whose stamps differ, and
    the directory drops that node's blocks and asks it to resync.
    """

    # KVK2: the key list says its key length (the service's keys are namespace || hash, 32
    # bytes); a KVK1 row (16-byte hashes without their namespace) reads as unknown: resync
    _KEYS_MAGIC = b"KVK2"
    _STAMP_BYTES = 16

    def __init__(self, path: str) -> None:
        from rocksdict import Rdict

        self.path = path
        self._db: Any = Rdict(path)
        self._open_no = self._bump(b"meta/opens")  # first part of every write stamp
        self._writes = itertools.count(1)

    def _bump(self, counter: bytes) -> int:
        value = int(self._db.get(counter, b"0")) + 1
        self._db[counter] = str(value).encode()
        return value

    def next_epoch(self) -> int:
        return self._bump(b"meta/epoch")

    def put_node(self, public: dict[str, object], keys: dict[bytes, int]) -> None:
        node_id = str(public["node_id"]).encode()
        stamp = struct.pack(">QQ", self._open_no, next(self._writes))
        self._db[b"node/" + node_id] = json.dumps({**public, "keys_stamp": stamp.hex()}).encode()
        key_len = len(next(iter(keys), b"\0" * 32))
        if any(len(k) != key_len for k in keys) or not 0 < key_len < 256:
            raise InvalidArgument(f"node {node_id!r}: block keys of mixed or unsupported lengths")
        body = bytes([key_len]) + b"".join(keys) + bytes(keys.values())
        self._db[b"keys/" + node_id] = self._KEYS_MAGIC + stamp + body

    def delete_node(self, node_id: str) -> None:
        for prefix in (b"node/", b"keys/"):
            try:
                del self._db[prefix + node_id.encode()]
            except KeyError:
                pass

    def put_namespaces(self, namespaces: dict[bytes, bytes]) -> None:
        self._db[b"meta/namespaces"] = b"".join(ns + digest for ns, digest in namespaces.items())

    def namespaces(self) -> list[tuple[bytes, bytes]]:
        raw = self._db.get(b"meta/namespaces", b"")
        return [(raw[i : i + 16], raw[i + 16 : i + 32]) for i in range(0, len(raw), 32)]

    def nodes(self) -> list[tuple[NodeRecord, dict[bytes, int] | None]]:
        """Every stored node with its blocks (hash -> tier code); ``None`` for the blocks of a
        node whose key list is missing or does not carry its row's write stamp."""
        from kvpool.directory.state import NodeRecord  # the state module imports this one

        out: list[tuple[NodeRecord, dict[bytes, int] | None]] = []
        for key, value in self._db.items(from_key=b"node/"):
            if not key.startswith(b"node/"):
                break
            public = json.loads(value)
            record = NodeRecord(**{k: public[k] for k in public if k in NodeRecord.__dataclass_fields__})
            out.append((record, self._keys(key[5:], str(public.get("keys_stamp", "")))))
        return out

    def _keys(self, node_id: bytes, stamp_hex: str) -> dict[bytes, int] | None:
        raw = self._db.get(b"keys/" + node_id, b"")
        head = len(self._KEYS_MAGIC) + self._STAMP_BYTES
        if not raw.startswith(self._KEYS_MAGIC) or raw[len(self._KEYS_MAGIC) : head].hex() != stamp_hex:
            return None  # torn write, or a row from before stamps: unknown
        if len(raw) <= head:
            return None
        key_len, body = raw[head], raw[head + 1 :]
        if not key_len or len(body) % (key_len + 1):
            return None
        n = len(body) // (key_len + 1)
        return {body[i * key_len : (i + 1) * key_len]: body[n * key_len + i] for i in range(n)}

    def close(self) -> None:
        self._db.close()
