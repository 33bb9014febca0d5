"""KVSpec and Namespace: what a block's bytes mean, and who may read them.

Blocks of different namespaces never match, because the namespace digest seeds
every block-hash chain (see ``kvpool.core.hashing``): a prefill and a decode node
with different layouts, dtypes or model revisions can never read each other's
bytes, and one tenant can never probe another's prompts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvpool.core.errors import InvalidArgument, SpecMismatch

#: dtype name -> bytes per element. fp8 is carried as raw bytes (numpy has no fp8).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

#: dtype name -> the numpy dtype used to hold it on the host (same itemsize).
NUMPY_HOLDER: dict[str, str] = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "int8": "int8",
    "uint8": "uint8",
}

KINDS = ("mha", "mla")  # "mha" covers MHA and GQA (separate K and V); "mla" is one latent

SPEC_ENCODING_VERSION = "kvpool-spec-v1"

#: longest model name / revision, in UTF-8 bytes: a spec is kept per namespace for the
#: daemon's life, so a client must not be able to make one arbitrarily large
MAX_MODEL_NAME_BYTES = 256
MAX_REVISION_BYTES = 256


@dataclass(frozen=True)
class KVSpec:
    """The shape and meaning of one model's KV cache in the pool.

    One pool block holds K and V of every layer for ``block_tokens`` tokens, in the
    canonical layer-major layout ``[layer][k|v][kv_head][token][head_dim]``. For MLA
    (``kind="mla"``) there is one latent per layer instead of K and V, with
    ``num_kv_heads == 1`` and ``head_dim`` the latent width.
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    revision: str = ""
    kind: str = "mha"

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgument("KVSpec.model is empty", hint="name the model, e.g. 'llama-3-8b'")
        for name, limit in (("model", MAX_MODEL_NAME_BYTES), ("revision", MAX_REVISION_BYTES)):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value.encode()) > limit:
                size = len(value.encode()) if isinstance(value, str) else "?"
                raise InvalidArgument(
                    f"KVSpec.{name} is {size} bytes; the limit is {limit} bytes",
                    hint=f"use a shorter {name} (a fingerprint, not the model's full description)",
                )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"KVSpec.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise InvalidArgument(
                f"KVSpec.dtype {self.dtype!r} is not supported",
                hint=f"use one of {sorted(DTYPE_BYTES)}",
            )
        if self.kind not in KINDS:
            raise InvalidArgument(f"KVSpec.kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise InvalidArgument("an MLA spec has one latent head: set num_kv_heads=1")

    @property
    def kv_factor(self) -> int:
        """2 for separate K and V, 1 for an MLA latent."""
        return 1 if self.kind == "mla" else 2

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one element of ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """(layers, k|v, kv_heads, tokens, head_dim): the canonical block layout."""
        return (self.num_layers, self.kv_factor, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes: layers x (K and V, or 1 for MLA) x kv_heads x head_dim x dtype bytes."""
        return self.num_layers * self.kv_factor * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one canonical block (``block_tokens`` tokens)."""
        return self.bytes_per_token * self.block_tokens

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """The numpy dtype that holds this spec's elements on the host."""
        return np.dtype(NUMPY_HOLDER[self.dtype])

    def layer_range_bytes(self, first_layer: int, num_layers: int) -> tuple[int, int]:
        """(offset, length) in bytes of a run of whole layers inside one block."""
        if first_layer < 0 or num_layers <= 0 or first_layer + num_layers > self.num_layers:
            raise InvalidArgument(
                f"layer range [{first_layer}, {first_layer + num_layers}) is outside 0..{self.num_layers}"
            )
        per_layer = self.block_bytes // self.num_layers
        return first_layer * per_layer, num_layers * per_layer

    def canonical_encoding(self) -> bytes:
        """A stable, injective byte encoding: same spec -> same bytes on every machine and
        version; different specs -> different bytes (JSON escapes every text field, so a model
        name containing separators cannot impersonate another field)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        body = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return f"{SPEC_ENCODING_VERSION}|{body}".encode("ascii")

    def digest(self) -> bytes:
        """16-byte digest of the canonical encoding."""
        return xxhash.xxh3_128_digest(self.canonical_encoding())

    def describe(self) -> str:
        """One line for logs and ``kvpool inspect namespaces``."""
        return (
            f"{self.model}@{self.revision or '-'} {self.kind} layers={self.num_layers} "
            f"kv_heads={self.num_kv_heads} head_dim={self.head_dim} {self.dtype} "
            f"block_tokens={self.block_tokens}"
        )

    def require_same(self, other: KVSpec, what: str = "peer") -> None:
        """Raise SpecMismatch naming both specs if they differ."""
        if self != other:
            raise SpecMismatch(
                f"{what} spec differs from the pool namespace: pool has [{self.describe()}], "
                f"{what} has [{other.describe()}]",
                hint="use the same model revision, layout, dtype and block size, or a separate namespace",
            )

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (``from_dict`` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVSpec:
        """A KVSpec from ``to_dict``'s output; unknown keys are InvalidArgument."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InvalidArgument(f"unknown KVSpec fields {sorted(unknown)}", hint=f"known: {sorted(known)}")
        return cls(**data)


@dataclass(frozen=True)
class Namespace:
    """(KVSpec digest, tenant salt, adapter id): the scope in which block hashes match."""

    spec: KVSpec
    salt: bytes = b""
    adapter: str = ""

    def encoding(self) -> bytes:
        """Length-prefixed so that no two (spec, salt, adapter) triples share an encoding."""
        parts = [b"kvpool-ns-v1", self.spec.digest(), self.salt, self.adapter.encode("utf-8")]
        return b"".join(len(p).to_bytes(4, "little") + p for p in parts)

    def digest(self) -> bytes:
        """16 bytes; also h0, the seed of every block-hash chain in this namespace."""
        return xxhash.xxh3_128_digest(self.encoding())
