"""``ClusterClient._plan``: the read plan over the directory's holders is the same whether each
block has its own holder list or blocks share one (``locate`` shares one list per distinct
set of holders, and ``_plan`` ranks each shared list once): contiguous runs on one holder of
the best rank, ending at the first block nobody holds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.client.cluster_client import ClusterClient, Holder

NODES = [Holder(f"n{i}", f"c{i}", f"d{i}", "host-a" if i < 2 else "host-b") for i in range(4)]


def _client(local: int | None, same_host_shm: bool) -> ClusterClient:
    client = ClusterClient.__new__(ClusterClient)  # _plan needs only what _rank reads
    client.local = None if local is None else type("Local", (), {"node_id": f"n{local}"})()  # type: ignore[assignment]
    client.same_host_shm = same_host_shm
    client.host = "host-a"
    return client


def _reference(client: ClusterClient, holders: list[list[Holder]]) -> list[tuple[Holder, int, int]]:
    runs: list[tuple[Holder, int, int]] = []
    for i, options in enumerate(holders):
        if not options:
            break
        best = min(client._rank(h) for h in options)
        candidates = [h for h in options if client._rank(h) == best]
        if runs and runs[-1][0] in candidates and runs[-1][2] == i:
            runs[-1] = (runs[-1][0], runs[-1][1], i + 1)
        else:
            runs.append((candidates[0], i, i + 1))
    return runs


@settings(max_examples=200, deadline=None)
@given(
    masks=st.lists(st.integers(0, 15), max_size=60),
    local=st.one_of(st.none(), st.integers(0, 3)),
    same_host_shm=st.booleans(),
)
def test_shared_holder_lists_plan_as_separate_ones(masks: list[int], local: int | None, same_host_shm: bool) -> None:
    client = _client(local, same_host_shm)
    separate = [[n for bit, n in enumerate(NODES) if m >> bit & 1] for m in masks]
    by_mask: dict[int, list[Holder]] = {}
    shared = [by_mask.setdefault(m, [n for bit, n in enumerate(NODES) if m >> bit & 1]) for m in masks]
    expected = _reference(client, separate)
    assert client._plan(separate) == expected
    assert client._plan(shared) == expected
