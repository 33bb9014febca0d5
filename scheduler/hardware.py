"""Node presets: what one serving instance's hardware gives the scheduler -- its cost model,
its HBM left for KV after the weights and activations, its host DRAM for KV, and the
bandwidth of each hop a block crosses.

Why derive capacities instead of picking them: whether cache-aware placement matters at
all depends on how much KV an instance can keep (docs/scheduler.md, "capacity curve").
With LLaMA3-70B on 8x A800 80GB the HBM left for KV is ~1.2M tokens (2,400 blocks of 512),
which is smaller than the conversation trace's reused working set; a free choice of
"10,000 blocks per instance" made every policy equal.

The hops (per instance = one 8-GPU node; tensor parallel inside it, so NVLink is inside
an instance and never carries a block between instances):

* HBM <- host DRAM: PCIe (``pcie_bytes_per_s``, all GPUs of the node together);
* node <-> node (peer DRAM, the pool, prefill -> decode): the RDMA NICs
  (``nic_bytes_per_s``), a full-duplex FIFO per node in the simulator;
* cluster <-> remote prefill cluster: ``ClusterSpec.remote_link_bandwidth_bytes_per_s``.

Numbers are datasheet figures (cited per preset); the fractions (``gpu_memory_utilization``,
activation reserve, host DRAM share) are assumptions, named and overridable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvpool.core.errors import InvalidArgument
from kvpool.scheduler.cluster import ClusterSpec
from kvpool.scheduler.cost_model import (
    _FLOP_SOURCE,
    A800X8,
    H800X8,
    LLAMA3_70B,
    QWEN3_NEXT_80B,
    Architecture,
    CostModel,
    Hardware,
    from_architecture,
)

GIB = 1 << 30

#: NVIDIA H20 datasheet: 96 GB HBM3, 4.0 TB/s, 148 TFLOPS bf16 dense: the bandwidth-rich, compute-poor part.
H20X8 = Hardware(gpus=8, peak_flops=148e12, hbm_bytes_per_s=4.0e12)
#: NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS bf16 dense (1,979 with sparsity): the
#: compute-dense part of Prefill-as-a-Service's remote prefill cluster (Qin et al. 2026: 32x H200).
H200X8 = Hardware(gpus=8, peak_flops=989e12, hbm_bytes_per_s=4.8e12)


@dataclass(frozen=True)
class NodePreset:
    """One serving instance (a node of ``hw.gpus`` GPUs in tensor parallel) running ``arch``."""

    name: str
    source: str
    arch: Architecture
    hw: Hardware
    hbm_bytes_per_gpu: float
    host_dram_kv_bytes: float  # host DRAM the node gives to KV (its local tier, readable by peers)
    nic_bytes_per_s: float  # the node's RDMA NICs together
    pcie_bytes_per_s: float  # host DRAM -> HBM, the node's GPUs together
    gpu_memory_utilization: float = 0.9  # vLLM's default: 10% of HBM left to the runtime
    activation_bytes_per_gpu: float = 4 * GIB  # peak activations at the max batched tokens (assumption)
    max_prefill_tokens: int = 131_072  # HBM a running prefill keeps out of the cache on a prefill node

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens() <= 0:
            raise InvalidArgument(f"{self.name}: the weights and activations leave no HBM for KV")

    def kv_capacity_tokens(self) -> int:
        """HBM left for KV after weights (params x dtype) and activations, in tokens."""
        usable = self.hw.gpus * self.hbm_bytes_per_gpu * self.gpu_memory_utilization
        left = usable - self.arch.params * self.arch.dtype_bytes - self.hw.gpus * self.activation_bytes_per_gpu
        return int(left // self.arch.kv_bytes_per_token)

    def cost_model(self) -> CostModel:
        return from_architecture(self.name, _FLOP_SOURCE + self.source, self.arch, self.hw)

    def describe(self) -> dict[str, Any]:
        kv = self.kv_capacity_tokens()
        return {
            "preset": self.name,
            "kv_capacity_tokens": kv,
            "hbm_cache_blocks_prefill": max(0, kv - self.max_prefill_tokens) // 512,
            "dram_blocks": int(self.host_dram_kv_bytes // (512 * self.arch.kv_bytes_per_token)),
            "nic_GBps": self.nic_bytes_per_s / 1e9,
            "pcie_GBps": self.pcie_bytes_per_s / 1e9,
        }


@dataclass(frozen=True)
class _Node:
    """One node's hardware, whatever model it runs: GPUs, HBM per GPU, NICs, PCIe (datasheets)."""

    key: str
    source: str
    hw: Hardware
    hbm_bytes_per_gpu: float
    nic_bytes_per_s: float
    pcie_bytes_per_s: float


_DRAM = " 1 TB host DRAM for KV (assumption)."
_A800 = _Node(
    "a800x8",
    "8x A800 80GB SXM (Mooncake FAST'25's testbed: 4x 200 Gbps RDMA per node);",
    A800X8,
    80e9,
    100e9,
    100e9,
)
_H800 = _Node(
    "h800x8", "8x H800 80GB SXM: the compute-dense prefill part; 8x 400 Gbps NICs;", H800X8, 80e9, 400e9, 200e9
)
_H20 = _Node(
    "h20x8",
    "8x H20 96GB: the bandwidth-rich, compute-poor decode part (4.0 TB/s, 148 TFLOPS bf16); 8x 400 Gbps NICs;",
    H20X8,
    96e9,
    400e9,
    200e9,
)
_H200 = _Node(
    "h200x8",
    "8x H200 141GB SXM (989 TFLOPS bf16, 4.8 TB/s): the compute-dense remote prefill part; 8x 400 Gbps NICs;",
    H200X8,
    141e9,
    400e9,
    200e9,
)
#: (preset prefix, model description, architecture, the nodes it is preset on). Qwen3-Next-80B-A3B (hybrid
#: attention: 12 of 48 layers keep KV, 24 KiB/token; 37.7 MiB of linear state per request; 3B active of
#: 80B) is the model class Prefill-as-a-Service is built for.
_MODELS: tuple[tuple[str, str, Architecture, tuple[_Node, ...]], ...] = (
    ("llama3-70b", "LLaMA3-70B", LLAMA3_70B, (_A800, _H800, _H20)),
    ("qwen3-next-80b", "Qwen3-Next-80B-A3B (hybrid attention)", QWEN3_NEXT_80B, (_H800, _H200, _H20)),
)

NODE_PRESETS: dict[str, NodePreset] = {
    p.name: p
    for p in (
        NodePreset(
            f"{prefix}-{node.key}",
            f"{model} on {node.source}{_DRAM}",
            arch,
            node.hw,
            hbm_bytes_per_gpu=node.hbm_bytes_per_gpu,
            host_dram_kv_bytes=1e12,
            nic_bytes_per_s=node.nic_bytes_per_s,
            pcie_bytes_per_s=node.pcie_bytes_per_s,
        )
        for prefix, model, arch, nodes in _MODELS
        for node in nodes
    )
}


def get_node_preset(name: str) -> NodePreset:
    try:
        return NODE_PRESETS[name]
    except KeyError:
        raise InvalidArgument(f"unknown node preset {name!r}", hint=f"use one of {sorted(NODE_PRESETS)}") from None


def cluster_from_preset(
    preset: NodePreset,
    *,
    dram_fraction: float = 1.0,
    **overrides: Any,
) -> ClusterSpec:
    """A ``ClusterSpec`` whose capacities and bandwidths come from ``preset``.

    HBM cache per instance = KV capacity minus one running prefill; decode KV room = the
    whole KV capacity (the decode nodes' cached blocks are what their running requests
    left behind); DRAM tier = ``dram_fraction`` of the node's host DRAM for KV; the global
    pool is off unless ``pool_blocks`` is given (the nodes' DRAM tiers, read by peers over
    the NICs, *are* the per-node pools). ``overrides`` replace any field.
    """
    if not 0.0 <= dram_fraction <= 1.0:
        raise InvalidArgument(f"dram_fraction must be in [0, 1], got {dram_fraction}")
    kv = preset.kv_capacity_tokens()
    block_bytes = 512 * preset.arch.kv_bytes_per_token
    base = ClusterSpec(
        hbm_blocks=max(0, kv - preset.max_prefill_tokens) // 512,
        dram_blocks=int(preset.host_dram_kv_bytes * dram_fraction // block_bytes),
        pool_blocks=0,
        decode_kv_capacity_tokens=kv,
        pool_bandwidth_bytes_per_s=preset.nic_bytes_per_s,
        pcie_bandwidth_bytes_per_s=preset.pcie_bytes_per_s,
    )
    return dataclasses.replace(base, **overrides)
