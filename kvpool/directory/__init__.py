"""Cluster directory (master): which node/tier holds each block, placement, leases, events."""
