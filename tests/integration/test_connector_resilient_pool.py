"""ResilientPool against a real daemon that is absent, started, killed and restarted."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from conftest import free_port, start_daemon

from kvpool.client import PoolClient
from kvpool.connectors.resilient_pool import ResilientPool
from kvpool.core.clock import FakeClock
from kvpool.core.errors import SpecMismatch
from kvpool.core.spec import KVSpec, Namespace

SPEC = KVSpec("m", 2, 2, 8, "float16", 16)
TOKENS = list(range(70))  # 4 full blocks


def _pool(address: str, clock: FakeClock, spec: KVSpec = SPEC) -> ResilientPool:
    return ResilientPool(
        lambda: PoolClient.connect(address, spec, salt=b"t", timeout_s=2.0),
        Namespace(spec, b"t"),
        clock,
        retry_interval_ms=1000,
        address=address,
    )


def test_misses_while_down_one_warning_per_outage_and_reconnects(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    clock = FakeClock()
    pool = _pool(address, clock)
    blocks = np.random.default_rng(0).random((4, *SPEC.block_shape)).astype(np.float16)
    hashes = pool.hashes(TOKENS)
    assert len(hashes) == 4  # hashed locally, no daemon needed
    with caplog.at_level(logging.WARNING, logger="kvpool.connectors"):
        assert not pool.try_connect()
        assert pool.lookup(hashes) == 0 and pool.put(hashes, blocks) is None  # skipped: within the interval
        assert pool.skipped_calls == 2
        daemon = start_daemon(port=port)
        try:
            assert pool.lookup(hashes) == 0  # still inside the retry interval: not even tried
            clock.advance(1001)
            pool.put(hashes, blocks)
            assert pool.lookup(hashes) == 4 and pool.available
            out = np.zeros_like(blocks)
            assert pool.get_into(hashes, out) == 4 and out.tobytes() == blocks.tobytes()
            daemon.kill()
            assert pool.lookup(hashes) == 0 and not pool.available
            assert pool.get_into(hashes, out) == 0  # skipped
        finally:
            daemon.cleanup()
        daemon = start_daemon(port=port)  # a new daemon, a new arena: the client registers again
        try:
            clock.advance(1001)
            assert pool.lookup(hashes) == 0  # empty pool, but reachable
            pool.put(hashes, blocks)
            assert pool.get_into(hashes, out) == 4 and out.tobytes() == blocks.tobytes()
        finally:
            daemon.cleanup()
    warnings = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 2, warnings  # absent at start, killed
    assert sum("is back" in r.getMessage() for r in caplog.records) == 2
    assert pool.outages == 2
    pool.close()


def test_configuration_errors_are_raised_not_swallowed() -> None:
    daemon = start_daemon()
    try:
        other = KVSpec("m", 2, 2, 8, "float16", 16, revision="r2")
        pool = _pool(daemon.address, FakeClock(), other)
        assert pool.try_connect()  # another revision is another namespace: fine
        bad = ResilientPool(
            lambda: (_ for _ in ()).throw(SpecMismatch("refused")),  # a daemon refusing the spec
            Namespace(SPEC, b"t"),
            FakeClock(),
            1000,
        )
        with pytest.raises(SpecMismatch):
            bad.lookup(bad.hashes(TOKENS))
        pool.close()
    finally:
        daemon.cleanup()


def test_a_pool_restarted_right_after_failed_retries_is_used_by_the_first_call() -> None:
    """Retries against a killed daemon, then the daemon back on the same port: the very next
    call reconnects. (gRPC shares subchannels process-wide by default, so the new channel
    inherited the failed one's reconnect backoff and kept answering "connection refused"
    for seconds after the daemon was back while an old client was still held: the vLLM
    test's restarted pool went unused.)"""
    port = free_port()
    address = f"127.0.0.1:{port}"
    clock = FakeClock()
    pool = _pool(address, clock)
    blocks = np.random.default_rng(1).random((4, *SPEC.block_shape)).astype(np.float16)
    hashes = pool.hashes(TOKENS)
    alive = []  # old clients something still holds (a staged put in a saver's queue, another thread)
    for life in range(3):
        daemon = start_daemon(capacity="64MiB", port=port)
        try:
            clock.advance(1000)  # past retry_interval_ms: the next call tries again
            assert pool.lookup(hashes) == 0 and pool.available, f"life {life}: the restarted pool was not used"
            pool.put(hashes, blocks)
            assert pool.lookup(hashes) == 4
            alive.append(pool._client)
        finally:
            daemon.kill()
        for _ in range(12):  # failed retries while it is down for 3 s (each past the retry interval)
            time.sleep(0.25)
            clock.advance(1000)
            assert pool.lookup(hashes) == 0 and not pool.available
