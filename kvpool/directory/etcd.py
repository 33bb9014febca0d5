"""etcd through its v3 JSON gateway (plain HTTP on the client URL, stdlib only): leases,
put/get/delete, a create-if-absent transaction, and the two patterns built on them.

- ``LeaderElection``: the directory instances race to create one key bound to a lease;
  the winner is the leader and keeps its lease alive; a standby retries until the key
  disappears (leader died: its lease expired) and takes over.
- ``Membership``: each node keeps ``<prefix>/nodes/<id>`` alive under its own lease; the
  directory treats a node whose key is gone as dead.

Synchronous and small on purpose: the callers run it from supervisor threads. Every
failure to reach etcd is ``Unavailable`` naming the endpoints, so the caller can keep
serving and say what it cannot do (elect, admit, notice deaths).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from kvpool.core.errors import InvalidArgument, Unavailable

log = logging.getLogger("kvpool.etcd")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _prefix_end(prefix: bytes) -> bytes:
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


class EtcdClient:
    """A minimal etcd v3 client over the JSON gateway of one or more endpoints."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise InvalidArgument("no etcd endpoint given", hint="e.g. --etcd 127.0.0.1:2379")
        self.endpoints = [e if e.startswith("http") else f"http://{e}" for e in endpoints]
        self.timeout_s = timeout_s
        self._preferred = 0
        self._lock = threading.Lock()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        errors: list[str] = []
        for i in range(len(self.endpoints)):
            index = (self._preferred + i) % len(self.endpoints)
            url = self.endpoints[index] + path
            request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    self._preferred = index
                    result: dict[str, Any] = json.loads(reply.read() or b"{}")
                    return result
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode("utf-8", "replace")
                raise EtcdError(f"etcd {path} failed: {exc.code} {detail}") from exc
            except (urllib.error.URLError, OSError, TimeoutError) as exc:
                errors.append(f"{url}: {exc}")
        raise Unavailable(
            f"etcd is not reachable ({'; '.join(errors)})",
            hint="start etcd or check --etcd; the cluster cannot elect or notice node deaths meanwhile",
        )

    # -- leases --------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        return int(self._post("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def keepalive(self, lease_id: int) -> int:
        """Refresh a lease; returns its TTL in seconds, 0 if it has expired."""
        result = self._post("/v3/lease/keepalive", {"ID": lease_id}).get("result", {})
        return int(result.get("TTL", 0))

    def revoke(self, lease_id: int) -> None:
        try:
            self._post("/v3/lease/revoke", {"ID": lease_id})
        except EtcdError:
            pass  # already gone

    # -- keys ----------------------------------------------------------------------------
    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        self._post("/v3/kv/put", body)

    def get(self, key: bytes) -> bytes | None:
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def get_prefix(self, prefix: bytes) -> dict[bytes, bytes]:
        reply = self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})
        return {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in reply.get("kvs", [])}

    def delete(self, key: bytes) -> None:
        self._post("/v3/kv/deleterange", {"key": _b64(key)})

    def create_if_absent(self, key: bytes, value: bytes, lease: int) -> bool:
        """Atomically create ``key`` unless it exists; True if this call created it."""
        body = {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease}}],
        }
        return bool(self._post("/v3/kv/txn", body).get("succeeded", False))

    def delete_if_value(self, key: bytes, value: bytes) -> bool:
        body = {
            "compare": [{"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value)}],
            "success": [{"request_delete_range": {"key": _b64(key)}}],
        }
        return bool(self._post("/v3/kv/txn", body).get("succeeded", False))


class EtcdError(Unavailable):
    """etcd answered with an error status."""


def leader_key(cluster: str) -> bytes:
    return f"/kvpool/{cluster}/directory/leader".encode()


def nodes_prefix(cluster: str) -> bytes:
    return f"/kvpool/{cluster}/nodes/".encode()


class LeaderElection:
    """One directory instance's side of the election. Call ``tick`` every ttl/3 seconds."""

    def __init__(self, etcd: EtcdClient, cluster: str, address: str, ttl_s: int = 3) -> None:
        self.etcd = etcd
        self.key = leader_key(cluster)
        self.address = address
        self.ttl_s = ttl_s
        self._lease = 0
        self.is_leader = False
        self.leader_address = ""
        self.etcd_ok = True

    def tick(self) -> bool:
        """Keep or try to take leadership; returns whether this instance leads now. If etcd
        is unreachable a leader keeps leading (nobody else can be elected meanwhile)."""
        try:
            if self.is_leader:
                if self.etcd.keepalive(self._lease) > 0:
                    self.etcd_ok = True
                    return True
                log.warning("directory %s lost its leader lease: stepping down", self.address)
                self.is_leader = False
            if not self._lease or self.etcd.keepalive(self._lease) <= 0:
                self._lease = self.etcd.grant(self.ttl_s)
            if self.etcd.create_if_absent(self.key, self.address.encode(), self._lease):
                self.is_leader = True
                self.leader_address = self.address
                log.info("directory %s is now the leader", self.address)
            else:
                current = self.etcd.get(self.key)
                self.leader_address = current.decode() if current else ""
            self.etcd_ok = True
        except Unavailable as err:
            if self.etcd_ok:
                log.warning("directory %s: %s", self.address, err)
            self.etcd_ok = False
        return self.is_leader

    def resign(self) -> None:
        if self.is_leader:
            try:
                self.etcd.delete_if_value(self.key, self.address.encode())
                self.etcd.revoke(self._lease)
            except Unavailable:
                pass
        self.is_leader = False


def find_leader(etcd: EtcdClient, cluster: str) -> str:
    value = etcd.get(leader_key(cluster))
    if not value:
        raise Unavailable(
            f"no directory leader is registered in etcd for cluster {cluster!r}",
            hint="start 'kvpool directory --etcd ...'",
        )
    return value.decode()


class Membership:
    """A node's liveness key under its own etcd lease. Call ``tick`` every ttl/3 seconds."""

    def __init__(self, etcd: EtcdClient, cluster: str, node_id: str, info: dict[str, Any], ttl_s: int = 3) -> None:
        self.etcd = etcd
        self.key = nodes_prefix(cluster) + node_id.encode()
        self.value = json.dumps(info).encode()
        self.ttl_s = ttl_s
        self._lease = 0
        self.etcd_ok = True

    def tick(self) -> None:
        try:
            if self._lease and self.etcd.keepalive(self._lease) > 0:
                self.etcd_ok = True
                return
            self._lease = self.etcd.grant(self.ttl_s)
            self.etcd.put(self.key, self.value, self._lease)
            self.etcd_ok = True
        except Unavailable as err:
            if self.etcd_ok:
                log.warning("node liveness: %s", err)
            self.etcd_ok = False

    def leave(self) -> None:
        try:
            if self._lease:
                self.etcd.revoke(self._lease)
        except Unavailable:
            pass


def live_nodes(etcd: EtcdClient, cluster: str) -> set[str]:
    prefix = nodes_prefix(cluster)
    return {key[len(prefix) :].decode() for key in etcd.get_prefix(prefix)}
