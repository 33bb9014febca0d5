"""Cost model: how long a prefill, a decode step and a KV transfer take.

Why a closed form: the router must predict TTFT for every candidate instance in
microseconds, and the simulator must be deterministic (time comes from this model,
never from the wall clock). The shapes follow the physics in DESIGN.md:

* prefill (compute-bound): ``base + a * new + b * new * (cached + new / 2)``: the
  linear term is the GEMMs (2 FLOPs per parameter per token), the pair term is
  attention (each new token attends to every cached token and, causally, to half of
  the new ones; 4 * layers * hidden FLOPs per pair);
* decode step (bandwidth-bound): ``base + c * batch + e * context_tokens``: the base
  is re-reading the weights, ``e`` is re-reading one token's KV, ``c`` the per-sequence
  compute and overheads;
* transfer: ``latency + bytes / bandwidth``.

Parameter sets come either from a FLOP / byte model of a published architecture on a
datasheet GPU (``from_architecture``: the standard transformer count, for the
LLaMA-70B-class models on A800/H800 nodes of the Mooncake paper) or from measurements
(``fit``).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpool.core.errors import InvalidArgument


@dataclass(frozen=True)
class CostModel:
    """Coefficients of the three closed forms (all times in milliseconds)."""

    name: str
    source: str
    kv_bytes_per_token: int
    prefill_base_ms: float
    prefill_ms_per_token: float
    prefill_ms_per_token_pair: float
    decode_base_ms: float
    decode_ms_per_seq: float
    decode_ms_per_context_token: float
    # Fixed per-request state beside the KV (a hybrid model's linear-attention recurrent + conv state):
    # constant in tokens, it travels with every prefill -> decode transfer. 0 for full-attention models.
    state_bytes_per_request: int = 0

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise InvalidArgument("kv_bytes_per_token must be positive")
        if self.state_bytes_per_request < 0:
            raise InvalidArgument("state_bytes_per_request must be >= 0")
        for name in (
            "prefill_base_ms",
            "prefill_ms_per_token",
            "prefill_ms_per_token_pair",
            "decode_base_ms",
            "decode_ms_per_seq",
            "decode_ms_per_context_token",
        ):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise InvalidArgument(f"CostModel.{name} must be finite and >= 0, got {value!r}")

    def prefill_ms(self, new_tokens: Any, cached_tokens: Any = 0) -> Any:
        """Time to prefill ``new_tokens`` on top of ``cached_tokens`` (scalars or arrays)."""
        if type(new_tokens) is int and type(cached_tokens) is int:  # the scalar fast path: same IEEE operations
            if new_tokens <= 0:
                return 0.0
            n = float(new_tokens)
            return (
                self.prefill_base_ms
                + self.prefill_ms_per_token * n
                + self.prefill_ms_per_token_pair * n * (float(cached_tokens) + n / 2.0)
            )
        new = np.asarray(new_tokens, dtype=np.float64)
        cached = np.asarray(cached_tokens, dtype=np.float64)
        ms = (
            self.prefill_base_ms
            + self.prefill_ms_per_token * new
            + self.prefill_ms_per_token_pair * new * (cached + new / 2.0)
        )
        out = np.where(new > 0, ms, 0.0)
        return float(out) if out.ndim == 0 else out

    def decode_step_ms(self, batch: Any, context_tokens: Any) -> Any:
        """One decode iteration for ``batch`` sequences holding ``context_tokens`` in total."""
        b = np.asarray(batch, dtype=np.float64)
        ctx = np.asarray(context_tokens, dtype=np.float64)
        ms = self.decode_base_ms + self.decode_ms_per_seq * b + self.decode_ms_per_context_token * ctx
        out = np.where(b > 0, ms, 0.0)
        return float(out) if out.ndim == 0 else out

    def kv_bytes(self, tokens: Any) -> Any:
        return np.asarray(tokens, dtype=np.float64) * self.kv_bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        return cls(**dict(data))


def transfer_ms(num_bytes: Any, bandwidth_bytes_per_s: float, latency_ms: float = 0.0) -> Any:
    """Time to move ``num_bytes`` over a link; zero bytes cost nothing (no round trip)."""
    if bandwidth_bytes_per_s <= 0:
        raise InvalidArgument(f"link bandwidth must be positive, got {bandwidth_bytes_per_s}")
    if isinstance(num_bytes, int | float):  # the scalar fast path (routing decisions)
        return latency_ms + num_bytes / bandwidth_bytes_per_s * 1000.0 if num_bytes > 0 else 0.0
    b = np.asarray(num_bytes, dtype=np.float64)
    out = np.where(b > 0, latency_ms + b / bandwidth_bytes_per_s * 1000.0, 0.0)
    return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class Architecture:
    """What the FLOP / byte model needs from a model config.

    Hybrid attention (Qwen3-Next, Kimi Linear: a few full-attention layers among linear-attention
    ones) changes three things, which is why it has its own fields rather than a smaller
    ``num_layers``: only the ``full_attention_layers`` keep a KV cache and pay the quadratic
    attention term; the linear layers keep a fixed ``linear_state_bytes`` per request (constant in
    tokens) and cost ``linear_flops_per_token`` beyond their projections. An MoE's FLOPs follow its
    ``active_params``, its weight reads and HBM its total ``params``. Every new field defaults to
    the dense, full-attention model, which gives exactly the numbers of before.
    """

    params: float  # total: the weights' bytes (HBM, decode re-reads)
    num_layers: int
    hidden: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    full_attention_layers: int | None = None  # None: every layer is full attention
    active_params: float | None = None  # an MoE's parameters used per token; None: dense (= params)
    attention_width: int | None = None  # query heads x head_dim of a full-attention layer; None: hidden
    linear_state_bytes: int = 0  # per request, all linear-attention layers together
    linear_flops_per_token: float = 0.0  # the linear layers' state update + read, all of them, per token

    def __post_init__(self) -> None:
        full = self.full_attention_layers
        if full is not None and not 0 <= full <= self.num_layers:
            raise InvalidArgument(f"full_attention_layers must be in [0, {self.num_layers}], got {full}")
        if (full is None or full == self.num_layers) and (self.linear_state_bytes or self.linear_flops_per_token):
            raise InvalidArgument("a linear state needs linear layers: set full_attention_layers < num_layers")
        if self.active_params is not None and not 0 < self.active_params <= self.params:
            raise InvalidArgument(f"active_params must be in (0, params], got {self.active_params}")
        if self.linear_state_bytes < 0 or self.linear_flops_per_token < 0:
            raise InvalidArgument("linear_state_bytes and linear_flops_per_token must be >= 0")

    @property
    def attention_layers(self) -> int:
        """Layers with a KV cache and a quadratic attention term."""
        return self.num_layers if self.full_attention_layers is None else self.full_attention_layers

    @property
    def flop_params(self) -> float:
        """Parameters each token multiplies through (2 FLOPs each)."""
        return self.params if self.active_params is None else self.active_params

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.attention_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Hardware:
    """One serving instance: ``gpus`` GPUs in tensor parallel."""

    gpus: int
    peak_flops: float  # dense bf16 per GPU, datasheet
    hbm_bytes_per_s: float  # per GPU, datasheet
    mfu: float = 0.5  # achieved fraction of peak FLOPs in prefill (assumption)
    mbu: float = 0.7  # achieved fraction of HBM bandwidth in decode (assumption)
    step_overhead_ms: float = 2.0  # launch / sampling / scheduling per iteration (assumption)


def from_architecture(name: str, source: str, arch: Architecture, hw: Hardware) -> CostModel:
    """The FLOP / byte model (see module docstring) for ``arch`` on ``hw``.

    Per token: ``2 * flop_params`` (+ the linear layers' state FLOPs); per attended pair
    ``4 * attention_layers * attention_width``; a decode step re-reads all weights, each running
    sequence's KV and reads + writes its linear state once. For a dense full-attention model these
    are the expressions of before, term for term (adding an exact 0.0), so its numbers do not move.
    """
    flops_per_ms = hw.gpus * hw.peak_flops * hw.mfu / 1000.0
    bytes_per_ms = hw.gpus * hw.hbm_bytes_per_s * hw.mbu / 1000.0
    width = arch.hidden if arch.attention_width is None else arch.attention_width
    per_token_ms = (2.0 * arch.flop_params + arch.linear_flops_per_token) / flops_per_ms
    return CostModel(
        name=name,
        source=source,
        kv_bytes_per_token=arch.kv_bytes_per_token,
        prefill_base_ms=hw.step_overhead_ms,
        prefill_ms_per_token=per_token_ms,
        prefill_ms_per_token_pair=4.0 * arch.attention_layers * width / flops_per_ms,
        decode_base_ms=hw.step_overhead_ms + arch.params * arch.dtype_bytes / bytes_per_ms,
        decode_ms_per_seq=per_token_ms + 2.0 * arch.linear_state_bytes / bytes_per_ms,
        decode_ms_per_context_token=arch.kv_bytes_per_token / bytes_per_ms,
        state_bytes_per_request=arch.linear_state_bytes,
    )


#: Meta LLaMA3-70B config (config.json): 80 layers, hidden 8192, 8 KV heads of 128, bf16.
LLAMA3_70B = Architecture(params=70.6e9, num_layers=80, hidden=8192, num_kv_heads=8, head_dim=128)
#: Meta LLaMA3-8B config: 32 layers, hidden 4096, 8 KV heads of 128, bf16.
LLAMA3_8B = Architecture(params=8.03e9, num_layers=32, hidden=4096, num_kv_heads=8, head_dim=128)
#: Qwen3-Next-80B-A3B (model card and config.json): 80B parameters in total, 3B activated (512 experts,
#: 10 routed + 1 shared); 48 layers, hidden 2048, layout 12 x (3 Gated DeltaNet + 1 gated attention),
#: i.e. 12 full-attention layers of 16 query / 2 KV heads of 256 (``full_attention_interval`` 4), and
#: 36 Gated DeltaNet layers of 32 value / 16 key heads of 128, conv kernel 4. Derived here:
#: KV = 2 x 12 x 2 x 256 x 2 B = 24 KiB/token (LLaMA3-70B: 320 KiB); linear state per layer =
#: 32 x 128 x 128 (recurrent) + 3 x (2 x 16 x 128 + 32 x 128) (conv) = 548,864 values, x 2 B (bf16,
#: vLLM's default state dtype follows the model's) x 36 layers = 39,518,208 B (37.7 MiB) per request;
#: the delta rule's state update + read ~ 6 x 32 x 128 x 128 FLOPs per layer per token.
QWEN3_NEXT_80B = Architecture(
    params=80e9,
    num_layers=48,
    hidden=2048,
    num_kv_heads=2,
    head_dim=256,
    full_attention_layers=12,
    active_params=3e9,
    attention_width=16 * 256,
    linear_state_bytes=36 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 2,
    linear_flops_per_token=36 * 6.0 * 32 * 128 * 128,
)
#: NVIDIA datasheets: A800 80GB SXM 312 TFLOPS bf16 dense, 2.039 TB/s; H800 SXM 989 TFLOPS, 3.35 TB/s.
A800X8 = Hardware(gpus=8, peak_flops=312e12, hbm_bytes_per_s=2.039e12)
H800X8 = Hardware(gpus=8, peak_flops=989e12, hbm_bytes_per_s=3.35e12)
#: NVIDIA datasheet: A100 80GB SXM 312 TFLOPS bf16, 2.039 TB/s (DistServe / Splitwise's testbeds).
A100X1 = Hardware(gpus=1, peak_flops=312e12, hbm_bytes_per_s=2.039e12)

_FLOP_SOURCE = (
    "Transformer FLOP/byte model (what Mooncake FAST'25 Conductor's prefill-time prediction needs): "
    "2*(active) params FLOPs/token (+ a hybrid model's linear-layer state FLOPs) + "
    "4*(full-attention) layers*attention width FLOPs per attended token pair at mfu=0.5 of datasheet peak; "
    "decode re-reads weights + KV (+ linear state) "
    "at mbu=0.7 of datasheet HBM bandwidth; 2 ms per-iteration overhead. "
)

PRESETS: dict[str, CostModel] = {
    "llama3-70b-a800x8": from_architecture(
        "llama3-70b-a800x8", _FLOP_SOURCE + "LLaMA3-70B on 8x A800 (Mooncake's testbed).", LLAMA3_70B, A800X8
    ),
    "llama3-70b-h800x8": from_architecture(
        "llama3-70b-h800x8", _FLOP_SOURCE + "LLaMA3-70B on 8x H800.", LLAMA3_70B, H800X8
    ),
    "llama3-8b-a100x1": from_architecture(
        "llama3-8b-a100x1",
        _FLOP_SOURCE + "LLaMA3-8B on 1x A100 (the single-GPU scale of DistServe / Splitwise profiles).",
        LLAMA3_8B,
        A100X1,
    ),
}

DEFAULT_PRESET = "llama3-70b-a800x8"


def get_preset(name: str) -> CostModel:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidArgument(f"unknown cost-model preset {name!r}", hint=f"use one of {sorted(PRESETS)}") from None


def load_cost_model(spec: str) -> CostModel:
    """A preset name, or a path to a JSON file written by ``fit`` / ``CostModel.to_dict``."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = pathlib.Path(spec)
    if not path.exists():
        raise InvalidArgument(f"cost model {spec!r} is neither a preset nor a file", hint=f"presets: {sorted(PRESETS)}")
    return CostModel.from_dict(json.loads(path.read_text()))


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (tiny active-set: drop negative ones and refit)."""
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def fit(
    rows: Iterable[Mapping[str, Any]],
    *,
    name: str,
    source: str,
    kv_bytes_per_token: int,
) -> CostModel:
    """Fit the closed forms to measurements.

    Each row is ``{"kind": "prefill", "new_tokens", "cached_tokens", "ms"}`` or
    ``{"kind": "decode", "batch", "context_tokens", "ms"}``. Coefficients are
    constrained to be >= 0 so extrapolation never predicts negative time. At least
    three rows of each kind are needed.
    """
    pre: list[tuple[float, float, float]] = []
    dec: list[tuple[float, float, float]] = []
    for row in rows:
        kind = row.get("kind")
        try:
            if kind == "prefill":
                pre.append((float(row["new_tokens"]), float(row.get("cached_tokens", 0)), float(row["ms"])))
            elif kind == "decode":
                dec.append((float(row["batch"]), float(row["context_tokens"]), float(row["ms"])))
            else:
                raise InvalidArgument(f"measurement row has kind {kind!r}", hint="use 'prefill' or 'decode'")
        except KeyError as exc:
            raise InvalidArgument(f"measurement row {dict(row)} lacks field {exc}") from None
    if len(pre) < 3 or len(dec) < 3:
        raise InvalidArgument(
            f"need >= 3 prefill and >= 3 decode measurements, got {len(pre)} and {len(dec)}",
            hint="measure several prompt lengths, cached prefixes, batch sizes and contexts",
        )
    p = np.array(pre)
    new, cached, ms = p[:, 0], p[:, 1], p[:, 2]
    pc = _nnls(np.stack([np.ones_like(new), new, new * (cached + new / 2.0)], axis=1), ms)
    d = np.array(dec)
    dc = _nnls(np.stack([np.ones(len(d)), d[:, 0], d[:, 1]], axis=1), d[:, 2])
    return CostModel(
        name=name,
        source=source,
        kv_bytes_per_token=kv_bytes_per_token,
        prefill_base_ms=float(pc[0]),
        prefill_ms_per_token=float(pc[1]),
        prefill_ms_per_token_pair=float(pc[2]),
        decode_base_ms=float(dc[0]),
        decode_ms_per_seq=float(dc[1]),
        decode_ms_per_context_token=float(dc[2]),
    )
