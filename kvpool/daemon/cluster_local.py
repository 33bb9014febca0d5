"""The old name of ``kvpool.daemon.launcher`` (tests and tools import from here)."""

from kvpool.daemon.launcher import (
    ChildExited,
    LocalCluster,
    Proc,
    etcd_binary,
    eventually,
    free_port,
    wait_until,
)

__all__ = ["ChildExited", "LocalCluster", "Proc", "etcd_binary", "eventually", "free_port", "wait_until"]
