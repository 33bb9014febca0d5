"""The directory's durable state in RocksDB (rocksdict): what ``DirectoryState.flush``
writes and a restarted directory loads (docs/cluster.md)."""

from __future__ import annotations

import json
from typing import Any

from kvpool.core.errors import InvalidArgument
from kvpool.directory.index import NodeRecord


class DirectoryDB:
    """RocksDB (rocksdict) under ``path``: node registry, each node's last known blocks,
    namespaces and the epoch counter. Written by ``DirectoryState.flush``.

    A node is two rows, ``node/<id>`` (JSON, with its last applied seq) and ``keys/<id>`` (its
    blocks), always written (and deleted) together in one RocksDB write batch: a crash can
    never pair a new seq with an old key list (the node's stream would then continue with no
    resync and the directory would offer blocks the node removed). A key list that cannot
    be read (a row of an older format, or damaged) reads as ``None``: the directory drops
    that node's blocks and asks it to resync.
    """

    # KVK3: the key list says its key length (the service's keys are namespace || hash, 32
    # bytes) and is written in one batch with its node row; KVK1 (16-byte hashes without their
    # namespace) and KVK2 (two puts, paired by write stamps) rows read as unknown: resync
    _KEYS_MAGIC = b"KVK3"

    def __init__(self, path: str) -> None:
        from rocksdict import Rdict

        self.path = path
        self._db: Any = Rdict(path)

    def _bump(self, counter: bytes) -> int:
        value = int(self._db.get(counter, b"0")) + 1
        self._db[counter] = str(value).encode()
        return value

    def next_epoch(self) -> int:
        return self._bump(b"meta/epoch")

    @staticmethod
    def _batch() -> Any:
        from rocksdict import WriteBatch

        return WriteBatch()

    def put_node(self, public: dict[str, object], keys: dict[bytes, int]) -> None:
        node_id = str(public["node_id"]).encode()
        key_len = len(next(iter(keys), b"\0" * 32))
        if any(len(k) != key_len for k in keys) or not 0 < key_len < 256:
            raise InvalidArgument(f"node {node_id!r}: block keys of mixed or unsupported lengths")
        batch = self._batch()
        batch.put(b"node/" + node_id, json.dumps(public).encode())
        batch.put(b"keys/" + node_id, self._KEYS_MAGIC + bytes([key_len]) + b"".join(keys) + bytes(keys.values()))
        self._db.write(batch)

    def delete_node(self, node_id: str) -> None:
        batch = self._batch()
        for prefix in (b"node/", b"keys/"):
            batch.delete(prefix + node_id.encode())
        self._db.write(batch)

    def put_namespaces(self, namespaces: dict[bytes, bytes]) -> None:
        self._db[b"meta/namespaces"] = b"".join(ns + digest for ns, digest in namespaces.items())

    def namespaces(self) -> list[tuple[bytes, bytes]]:
        raw = self._db.get(b"meta/namespaces", b"")
        return [(raw[i : i + 16], raw[i + 16 : i + 32]) for i in range(0, len(raw), 32)]

    def nodes(self) -> list[tuple[NodeRecord, dict[bytes, int] | None]]:
        """Every stored node with its blocks (hash -> tier code); ``None`` for the blocks of a
        node whose key list is missing or unreadable."""
        out: list[tuple[NodeRecord, dict[bytes, int] | None]] = []
        for key, value in self._db.items(from_key=b"node/"):
            if not key.startswith(b"node/"):
                break
            public = json.loads(value)
            record = NodeRecord(**{k: public[k] for k in public if k in NodeRecord.__dataclass_fields__})
            out.append((record, self._keys(key[5:])))
        return out

    def _keys(self, node_id: bytes) -> dict[bytes, int] | None:
        raw = self._db.get(b"keys/" + node_id, b"")
        head = len(self._KEYS_MAGIC)
        if not raw.startswith(self._KEYS_MAGIC) or len(raw) <= head:
            return None
        key_len, body = raw[head], raw[head + 1 :]
        if not key_len or len(body) % (key_len + 1):
            return None
        n = len(body) // (key_len + 1)
        return {body[i * key_len : (i + 1) * key_len]: body[n * key_len + i] for i in range(n)}

    def close(self) -> None:
        self._db.close()
