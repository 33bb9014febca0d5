"""Weight fingerprints: name the exact weights that produced a KV cache.

A KV block's bytes are a function of the prompt *and* of the model's weights and config. A
model id is only a label: two checkpoints called ``my-model`` with other weights would hit each
other's blocks and decode from the wrong KV (issue 11). So, unless the user pins a revision that
names the exact weights, the connectors put a fingerprint of the weights into the KVSpec
revision, and with it into the namespace digest that seeds every block hash.

Guarantees:

* exact: xxh3-128 over every parameter and buffer's raw bytes, each preceded by a
  length-prefixed header (name, dtype, shape, byte count), in name order, then the caller's
  ``extra`` bytes (a canonical config encoding). Any flipped bit, renamed, reshaped, added or
  removed tensor, or config change gives another fingerprint;
* computed once per module: ``module_fingerprint`` caches the result (weakly, so the cache dies
  with the model) and reuses it only while every tensor still has the same storage pointer and
  in-place version counter; ``load_state_dict``/``copy_`` bump the counter and force a rehash.
  A write through ``param.data`` does not (torch does not count it): pass ``refresh=True`` after
  such a write;
* bounded memory: device tensors are copied to the host in chunks of ``HOST_CHUNK_BYTES``.

Cost (``docs/engine.md``): one pass over the weights at host-memory speed, measured against a
plain xxh3-128 of the same bytes in one buffer.

Imported only by ``kvpool.connectors`` / ``kvpool.engine`` (it imports torch).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import xxhash

from kvpool.core.errors import InvalidArgument

#: Scheme tag; it prefixes every fingerprint so a pinned revision can never look like one by accident.
FINGERPRINT_SCHEME = "kvpool-wfp1"

#: Largest piece of a device tensor staged on the host at once.
HOST_CHUNK_BYTES = 64 * 1024 * 1024

_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[Any, ...], str]] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def is_fingerprint(revision: str) -> bool:
    """True when ``revision`` was produced by this module (not a user pin)."""
    return revision.startswith(FINGERPRINT_SCHEME + ":")


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


def _update_with_tensor(h: Any, name: str, tensor: torch.Tensor) -> None:
    t = tensor.detach()
    if t.is_meta:
        raise InvalidArgument(f"tensor {name!r} is on the meta device", hint="load the weights before fingerprinting")
    if t.layout != torch.strided or t.is_quantized:
        raise InvalidArgument(
            f"tensor {name!r} has layout {t.layout} (quantized={t.is_quantized}); only dense tensors are fingerprinted",
            hint="pin a revision that names these exact weights instead",
        )
    header = json.dumps([name, str(t.dtype), list(t.shape), t.numel() * t.element_size()]).encode()
    h.update(_field(header))
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return
    if flat.device.type == "cpu":
        h.update(flat.contiguous().view(torch.uint8).numpy())
        return
    step = max(1, HOST_CHUNK_BYTES // flat.element_size())
    for start in range(0, flat.numel(), step):
        h.update(flat[start : start + step].contiguous().cpu().view(torch.uint8).numpy())


def tensors_fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]], extra: bytes = b"") -> str:
    """Fingerprint of named tensors' exact bytes plus ``extra``: ``"kvpool-wfp1:<32 hex>"``.

    Names must be unique; tensors are hashed in name order, so the result does not depend on the
    order a framework registers them in.
    """
    items = sorted(named_tensors, key=lambda item: item[0])
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise InvalidArgument("tensor names passed to tensors_fingerprint are not unique")
    h = xxhash.xxh3_128()
    h.update(_field(FINGERPRINT_SCHEME.encode()))
    h.update(len(items).to_bytes(8, "little"))
    for name, tensor in items:
        _update_with_tensor(h, name, tensor)
    h.update(_field(extra))
    return f"{FINGERPRINT_SCHEME}:{h.hexdigest()}"


def module_named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter (tied ones once) and every buffer of ``module``: all that its forward reads."""
    named: list[tuple[str, torch.Tensor]] = [(f"param:{n}", p) for n, p in module.named_parameters()]
    named += [(f"buffer:{n}", b) for n, b in module.named_buffers()]
    return named


def _validity_key(named: list[tuple[str, torch.Tensor]], extra: bytes) -> tuple[Any, ...]:
    """Cheap per-call key: storage pointer + in-place version of every tensor (no bytes read)."""
    parts: list[Any] = [extra]
    for name, t in named:
        try:
            version = int(getattr(t, "_version"))  # noqa: B009  (not in the stubs)
        except RuntimeError:  # inference-mode tensors carry no version counter
            version = -1
        parts.append((name, t.data_ptr(), version, str(t.dtype), tuple(t.shape), str(t.device)))
    return tuple(parts)


def module_fingerprint(module: torch.nn.Module, extra: bytes = b"", *, refresh: bool = False) -> str:
    """``tensors_fingerprint`` of every parameter and buffer of ``module``, cached per module.

    The cache entry is reused only while no tensor was replaced or modified in place (see the
    module docstring); ``refresh=True`` rehashes unconditionally.
    """
    named = module_named_tensors(module)
    key = _validity_key(named, extra)
    with _CACHE_LOCK:
        hit = _CACHE.get(module)
    if hit is not None and hit[0] == key and not refresh:
        return hit[1]
    fingerprint = tensors_fingerprint(named, extra)
    with _CACHE_LOCK:
        _CACHE[module] = (key, fingerprint)
    return fingerprint
