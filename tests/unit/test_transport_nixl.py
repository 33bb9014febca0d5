"""The NIXL data plane against a real PoolNode arena, in-process: whole blocks and layer ranges
in one batched READ, misses and corruption, the lease held until NIXL_DONE, AUTH before any
address or metadata, a deadline that cancels, metadata from the directory or the peer, and
plain TCP for peers that do not speak NIXL."""

# ruff: noqa: F811  (the fixtures imported from transport_helpers are parameters here)
from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transport_helpers import BB, NS_DIGEST, SPEC, blocks, keys, node, server, transport  # noqa: F401

from kvpool.client.tickets import StaticTickets
from kvpool.core.auth import parse_credentials, token_sha256
from kvpool.core.keys import block_key
from kvpool.core.tickets import DataTicket, TicketIssuer, new_secret
from kvpool.daemon.cluster_local import eventually
from kvpool.daemon.cluster_node import NodeBlockStore
from kvpool.daemon.node import PoolNode
from kvpool.transport import wire
from kvpool.transport.base import ReadItem
from kvpool.transport.factory import make_data_server, make_transport, nixl_available
from kvpool.transport.tcp_server import TcpDataServer

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(bool(nixl_available()), reason=f"nixl unusable: {nixl_available()}")]

if not nixl_available():
    from kvpool.transport import nixl, nixl_agent
    from kvpool.transport.nixl import NixlDataServer, NixlTransport


@pytest.fixture
def nserver(node: PoolNode) -> Iterator[NixlDataServer]:
    srv = make_data_server("nixl", NodeBlockStore(node), "127.0.0.1:0")
    assert isinstance(srv, NixlDataServer)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def reader() -> Iterator[NixlTransport]:
    t = make_transport("nixl", timeout_s=3.0)
    assert isinstance(t, NixlTransport)
    yield t
    t.close()


def test_blocks_and_layer_ranges_arrive_verified_in_one_batched_read(
    nserver: NixlDataServer,
    reader: NixlTransport,
    node: PoolNode,
) -> None:
    ks, data = keys(12), blocks(12, 1)
    assert reader.write(nserver.address, NS_DIGEST, ks, data).stored == 12  # writes go over TCP
    for _ in range(2):  # the second read reuses the connection and its agent
        out = np.zeros_like(data)
        assert reader.read(nserver.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out)).ok == 12
        np.testing.assert_array_equal(out, data)
    assert reader.counters["nixl_reads"] == 2 and reader.counters["metadata_from_peer"] == 1
    assert reader.counters["direct_reads"] == 2  # no RDMA here: straight into out's rows
    offset, length = SPEC.layer_range_bytes(1, 2)
    part = np.zeros((12, length), dtype=np.uint8)
    assert reader.read(nserver.address, NS_DIGEST, [ReadItem(k, offset, length) for k in ks], list(part)).ok == 12
    np.testing.assert_array_equal(part, data[:, offset : offset + length])
    assert eventually(lambda: node.store.summary()["leases_active"] == 0)  # NIXL_DONE released every lease


@pytest.mark.parametrize("direct", [True, False])
def test_a_prefix_the_node_lacks_and_a_rotten_block_are_misses(
    nserver: NixlDataServer,
    node: PoolNode,
    caplog: pytest.LogCaptureFixture,
    direct: bool,
) -> None:
    """``ok`` stops at the rotten block. A direct READ has landed it (and what follows) in the
    rows past ``ok``, which the caller recomputes anyway, as with TCP; a staged one never copies it."""
    reader = NixlTransport(timeout_s=3.0, direct=direct)
    ks, data = keys(4, 50), blocks(4, 2)
    reader.write(nserver.address, NS_DIGEST, ks, data)
    longer = keys(6, 50)
    out = np.zeros((6, BB), dtype=np.uint8)
    assert reader.read(nserver.address, NS_DIGEST, [ReadItem(k) for k in longer], list(out)).ok == 4
    entry = node.store.entry(block_key(NS_DIGEST, ks[2]))
    assert entry is not None
    node.arena.view[entry.offset + 5] ^= 0x40  # rot after commit: the pulled bytes fail their checksum
    out = np.zeros((4, BB), dtype=np.uint8)
    with caplog.at_level(logging.WARNING, logger="kvpool.transport"):
        got = reader.read(nserver.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out))
    assert (got.ok, got.corrupt_index) == (2, 2)
    np.testing.assert_array_equal(out[:2], data[:2])
    assert out[2:].any() == direct
    assert nserver.address in caplog.text
    assert reader.read(nserver.address, NS_DIGEST, [ReadItem(ks[0])], [out[0]]).ok == 1  # still in sync
    assert eventually(lambda: node.store.summary()["leases_active"] == 0)
    reader.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    picks=st.lists(
        st.tuples(st.integers(0, 7), st.integers(0, SPEC.num_layers - 1), st.integers(1, SPEC.num_layers)),
        min_size=1,
        max_size=24,
    )
)
def test_any_batch_of_layer_ranges_reads_exactly_those_bytes(
    nserver: NixlDataServer,
    reader: NixlTransport,
    picks: list[tuple[int, int, int]],
) -> None:
    """Invariant: whatever mix of blocks and layer ranges one batched READ names (repeats too),
    each destination holds exactly that slice of that block."""
    ks, data = keys(8, 100), blocks(8, 3)
    reader.write(nserver.address, NS_DIGEST, ks, data)
    items, dst, want = [], [], []
    for block, first, count in picks:
        count = min(count, SPEC.num_layers - first)
        offset, length = SPEC.layer_range_bytes(first, count)
        items.append(ReadItem(ks[block], offset, length))
        dst.append(np.zeros(length, dtype=np.uint8))
        want.append(data[block, offset : offset + length])
    assert reader.read(nserver.address, NS_DIGEST, items, dst).ok == len(items)
    for got, expected in zip(dst, want):
        np.testing.assert_array_equal(got, expected)


def test_rows_in_many_pieces_are_read_staged_and_a_few_pieces_direct(
    nserver: NixlDataServer, reader: NixlTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nixl, "MAX_DIRECT_SPANS", 3)
    ks, data = keys(6, 900), blocks(6, 11)
    reader.write(nserver.address, NS_DIGEST, ks, data)
    every_other = np.zeros((12, BB), dtype=np.uint8)  # 6 rows, 6 pieces: more than 3
    assert reader.read(nserver.address, NS_DIGEST, [ReadItem(k) for k in ks], list(every_other[::2])).ok == 6
    two_arrays = [np.zeros((3, BB), dtype=np.uint8), np.zeros((3, BB), dtype=np.uint8)]  # 2 pieces
    rows = [*two_arrays[0], *two_arrays[1]]
    assert reader.read(nserver.address, NS_DIGEST, [ReadItem(k) for k in ks], rows).ok == 6
    np.testing.assert_array_equal(every_other[::2], data)
    np.testing.assert_array_equal(np.concatenate(two_arrays), data)
    assert (reader.counters["staged_reads"], reader.counters["direct_reads"]) == (1, 1)


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 64)), min_size=1, max_size=12))
def test_row_spans_cover_exactly_the_rows_in_order(picks: list[tuple[int, int]]) -> None:
    """Invariant: the spans are the rows' bytes, in order, adjacent rows merged, no gap bridged."""
    buffer = np.zeros(8 * 64 + 64, dtype=np.uint8)
    rows = [buffer[start * 64 : start * 64 + length] for start, length in picks]
    spans = nixl.row_spans(rows, max_spans=len(rows))
    assert spans is not None
    covered = [(int(r.ctypes.data), int(r.nbytes)) for r in rows]
    flat = [a + i for a, n in covered for i in range(n)]
    assert [a + i for a, n in spans for i in range(n)] == flat
    assert all(a1 + n1 != a2 for (a1, n1), (a2, _) in itertools.pairwise(spans))  # merged wherever adjacent
    assert nixl.row_spans([buffer[::2]]) is None  # not contiguous: staged


def test_a_read_larger_than_a_window_is_split_into_several_requests(
    nserver: NixlDataServer, reader: NixlTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nixl, "WINDOW_BYTES", 3 * BB)  # bounds the staging buffer a read needs
    ks, data = keys(10, 200), blocks(10, 4)
    reader.write(nserver.address, NS_DIGEST, ks, data)
    out = np.zeros_like(data)
    assert reader.read(nserver.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out)).ok == 10
    np.testing.assert_array_equal(out, data)
    assert reader.counters["nixl_reads"] == 4  # 3 + 3 + 3 + 1 blocks


def test_metadata_published_by_the_directory_is_used_and_a_stale_one_replaced(
    nserver: NixlDataServer, reader: NixlTransport, tmp_path: Path
) -> None:
    ks, data = keys(2, 300), blocks(2, 5)
    reader.learn_peer(nserver.address, nserver.transport_metadata)  # what NodeInfo carries
    reader.write(nserver.address, NS_DIGEST, ks, data)
    out = np.zeros_like(data)
    assert reader.read(nserver.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out)).ok == 2
    assert (reader.counters["metadata_from_directory"], reader.counters["metadata_from_peer"]) == (1, 0)
    # another node's metadata offered for this address (the node restarted): named agent differs,
    # so the reader asks the node itself on the authenticated connection
    from transport_helpers import make_node

    (tmp_path / "other").mkdir()
    other_node = make_node(tmp_path / "other")
    other = NixlDataServer(NodeBlockStore(other_node), "127.0.0.1:0")
    other.start()
    try:
        fresh = make_transport("nixl", timeout_s=3.0)
        assert isinstance(fresh, NixlTransport)
        fresh.learn_peer(nserver.address, other.transport_metadata)
        assert fresh.read(nserver.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out)).ok == 2
        np.testing.assert_array_equal(out, data)
        assert fresh.counters["metadata_from_peer"] == 1
        fresh.close()
    finally:
        other.stop()
        other_node.close()


def test_a_peer_without_nixl_is_read_over_tcp(server: TcpDataServer, reader: NixlTransport) -> None:
    ks, data = keys(3, 400), blocks(3, 6)
    reader.write(server.address, NS_DIGEST, ks, data)
    for _ in range(2):
        out = np.zeros_like(data)
        assert reader.read(server.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out)).ok == 3
        np.testing.assert_array_equal(out, data)
    assert reader.counters["tcp_peers"] == 1 and reader.counters["nixl_reads"] == 0


def test_the_server_holds_its_lease_until_nixl_done_or_the_connection_drops(
    nserver: NixlDataServer,
    reader: NixlTransport,
    node: PoolNode,
) -> None:
    ks = keys(2, 500)
    reader.write(nserver.address, NS_DIGEST, ks, blocks(2, 7))
    host, port = nserver.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=3) as sock:
        request = wire.pack_header(wire.OP_NIXL_READ, 2, NS_DIGEST) + wire.pack_read_items([(k, 0, 0) for k in ks])
        sock.sendall(request)
        status, served, _ = wire.recv_reply(sock)
        assert (status, served) == (wire.STATUS_OK, 2)
        wire.recv_exact(sock, served * (wire.READ_META.size + wire.NIXL_ADDRESS.size))
        assert node.store.summary()["leases_active"] == 1  # a puller may still be reading the slots
    assert eventually(lambda: node.store.summary()["leases_active"] == 0)  # the drop released it


def test_without_auth_no_address_no_metadata_and_a_foreign_namespace_is_denied(
    node: PoolNode,
) -> None:
    token, other_token = "tenant-token", "other-token"
    creds = parse_credentials(
        json.dumps(
            {
                "tenants": [
                    {"name": "a", "token_sha256": token_sha256(token), "namespaces": [NS_DIGEST.hex()]},
                    {"name": "b", "token_sha256": token_sha256(other_token), "namespaces": ["00" * 16]},
                ]
            }
        ).encode()
    ).with_tickets(TicketIssuer(new_secret()))
    srv = NixlDataServer(NodeBlockStore(node), "127.0.0.1:0", credentials=creds)

    def with_ticket_of(transport: NixlTransport, who: str) -> NixlTransport:
        """The transport proving the ticket the node's control plane would give ``who``'s token."""
        principal = creds.identify(who)
        assert principal is not None
        issued = creds.issue_ticket(principal, int(time.monotonic() * 1000))
        assert issued is not None
        transport.use_tickets(StaticTickets(DataTicket(*issued)))
        return transport

    srv.start()
    try:
        ks, data = keys(2, 600), blocks(2, 8)
        owner = with_ticket_of(NixlTransport(timeout_s=3.0), token)
        assert owner.write(srv.address, NS_DIGEST, ks, data).stored == 2
        out = np.zeros_like(data)
        assert owner.read(srv.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out)).ok == 2
        for stranger in (NixlTransport(timeout_s=3.0), with_ticket_of(NixlTransport(timeout_s=3.0), other_token)):
            got = stranger.read(srv.address, NS_DIGEST, [ReadItem(k) for k in ks], list(np.zeros_like(data)))
            assert got.ok == 0 and got.reason
            assert stranger.counters["nixl_reads"] == 0
            stranger.close()
        # the raw protocol: NIXL_HELLO before AUTH gets no agent name and no metadata
        host, port = srv.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=3) as sock:
            sock.sendall(wire.pack_header(wire.OP_NIXL_HELLO, 1, bytes(16)))
            status, count, _ = wire.recv_reply(sock)
            assert (status, count) == (wire.STATUS_UNAUTHENTICATED, 0)
        owner.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("direct", [True, False])
def test_a_transfer_past_its_deadline_is_a_miss_and_its_connection_is_never_driven_again(
    nserver: NixlDataServer, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """NIXL cannot cancel a running READ: past the deadline the reader neither releases it nor
    polls its agent again (a poll is what moves a late byte on a host without RDMA), and later
    reads go over a new connection with a new agent."""
    reader = NixlTransport(timeout_s=0.5, direct=direct)
    ks, data = keys(3, 700), blocks(3, 9)
    reader.write(nserver.address, NS_DIGEST, ks, data)
    polled: list[object] = []
    released: list[object] = []
    real_release = nixl.Agent.release

    def never_done(agent: object, handle: int) -> str:
        polled.append(agent)
        return nixl.STATE_BUSY

    def release(agent: object, handle: int) -> bool:
        released.append(agent)
        return real_release(agent, handle)  # type: ignore[arg-type]

    monkeypatch.setattr(nixl.Agent, "state", never_done)
    monkeypatch.setattr(nixl.Agent, "release", release)
    got = reader.read(nserver.address, NS_DIGEST, [ReadItem(k) for k in ks], list(np.zeros_like(data)))
    assert got.ok == 0 and "time" in got.reason
    assert reader.counters["retired_connections"] == 1 and not released
    (retired,) = reader._retired
    assert retired.retired and (retired.staging.nbytes >= 3 * BB) != direct  # a staged read keeps its buffer
    monkeypatch.undo()
    monkeypatch.setattr(nixl.Agent, "release", release)
    out = np.zeros_like(data)
    assert reader.read(nserver.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out)).ok == 3
    np.testing.assert_array_equal(out, data)
    assert retired.agent not in released  # the stalled READ's agent was never touched again
    assert reader.counters["direct_reads" if direct else "staged_reads"] == 1
    reader.close()


def test_a_stopped_node_is_a_miss(nserver: NixlDataServer, reader: NixlTransport) -> None:
    ks, data = keys(2, 800), blocks(2, 10)
    reader.write(nserver.address, NS_DIGEST, ks, data)
    nserver.stop()
    got = reader.read(nserver.address, NS_DIGEST, [ReadItem(k) for k in ks], list(np.zeros_like(data)))
    assert got.ok == 0 and nserver.address in got.reason


def test_nixl_missing_is_a_clear_error_naming_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.core.errors import Unavailable

    monkeypatch.setattr(nixl, "nixl_available", lambda: "ModuleNotFoundError: No module named 'nixl_cu12'")
    with pytest.raises(Unavailable, match="nixl") as err:
        make_transport("nixl")
    assert "pip install --no-deps nixl-cu12" in str(err.value) and "kvpool[nixl]" in str(err.value)


def test_ucx_overrides_keep_loopback_on_lo_and_respect_the_operator(tmp_path: Path) -> None:
    no_rdma, rdma = str(tmp_path / "none"), tmp_path / "ib"
    rdma.mkdir()
    (rdma / "mlx5_0").mkdir()
    assert nixl.ucx_overrides(True, {}, no_rdma) == {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}
    assert nixl.ucx_overrides(False, {}, str(rdma)) == {}  # a fabric: UCX picks devices and loads ib
    assert nixl.ucx_overrides(True, {"UCX_NET_DEVICES": "mlx5_0:1", "UCX_MODULES": "all"}, no_rdma) == {}


def test_what_ucxx_puts_in_the_environment_is_hidden_from_nixl_agents() -> None:
    """``import ucxx`` sets UCX_RNDV_THRESH=8192, which slows NIXL READs ~15x (nixl_agent)."""
    assert nixl_agent.ucxx_injected({"UCX_RNDV_THRESH": "8192"}, {"ucxx": object()}) == ["UCX_RNDV_THRESH"]
    assert nixl_agent.ucxx_injected({"UCX_RNDV_THRESH": "8192"}, {}) == []  # no ucxx: the operator's
    assert nixl_agent.ucxx_injected({"UCX_RNDV_THRESH": "65536"}, {"ucxx": object()}) == []
    import ucxx._lib.libucxx  # noqa: F401  (what the bench and a mixed-transport client do)

    before = dict(os.environ)
    nixl.Agent("kvpool-test-env", False, True)
    assert dict(os.environ) == before  # restored after the agent was made


CHILD = """
import os, sys, numpy as np, pathlib, tempfile
sys.path.insert(0, sys.argv[1])
from transport_helpers import make_node, keys, blocks, NS_DIGEST
from kvpool.daemon.cluster_node import NodeBlockStore
from kvpool.transport.base import ReadItem
from kvpool.transport.nixl import NixlDataServer, NixlTransport
node = make_node(pathlib.Path(tempfile.mkdtemp(dir=sys.argv[2])))
server = NixlDataServer(NodeBlockStore(node), "127.0.0.1:0")
server.start()
reader = NixlTransport(timeout_s=3.0)
ks, data = keys(4), blocks(4, 1)
reader.write(server.address, NS_DIGEST, ks, data)
out = np.zeros_like(data)
assert reader.read(server.address, NS_DIGEST, [ReadItem(k) for k in ks], list(out)).ok == 4
assert (out == data).all() and reader.counters["nixl_reads"] == 1
mine = set()
for fd in os.listdir(f"/proc/{os.getpid()}/fd"):
    try:
        target = os.readlink(f"/proc/{os.getpid()}/fd/{fd}")
    except OSError:  # closed meanwhile (the listing's own fd)
        continue
    if target.startswith("socket:["):
        mine.add(target[8:-1])
for table in ("tcp", "tcp6"):
    for row in open(f"/proc/self/net/{table}").read().splitlines()[1:]:
        fields = row.split()
        if fields[9] in mine and fields[3] == "0A":  # a listening socket of this process
            print("LISTEN", table, fields[1])
reader.close(); server.stop(); node.close()
print("OK")
"""


def test_a_process_with_nixl_listens_on_loopback_only_and_exits_cleanly(tmp_path: Path) -> None:
    """What NIXL's UCX binds (every listener on 127.0.0.1) and how the process ends (exit 0:
    the bundled-libnl crash at exit is avoided, see ``ucx_overrides``)."""
    import subprocess
    import sys

    helpers = str(Path(__file__).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, helpers, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    listeners = [line.split()[2] for line in proc.stdout.splitlines() if line.startswith("LISTEN")]
    assert listeners  # the data server and UCX's own
    loopback = ("0100007F", "0000000000000000FFFF00000100007F")  # 127.0.0.1 in /proc/net/tcp and tcp6
    assert all(address.split(":")[0] in loopback for address in listeners), listeners
    assert proc.stdout.strip().endswith("OK")
