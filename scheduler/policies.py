"""Policy registry: name -> constructor, so the CLI, the router and the tools agree."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvpool.core.errors import InvalidArgument
from kvpool.scheduler.policy_base import Policy
from kvpool.scheduler.policy_dynamo import DynamoCostPolicy
from kvpool.scheduler.policy_kv_centric import KvCentricPolicy
from kvpool.scheduler.policy_least_loaded import LeastLoadedPolicy
from kvpool.scheduler.policy_llmd import LlmdWeightedPolicy
from kvpool.scheduler.policy_paas import PaasPolicy
from kvpool.scheduler.policy_prefix import PrefixPolicy
from kvpool.scheduler.policy_random import RandomPolicy
from kvpool.scheduler.policy_remote_prefill import RemotePrefillPolicy
from kvpool.scheduler.policy_round_robin import RoundRobinPolicy
from kvpool.scheduler.policy_sglang import SglangCacheAwarePolicy

_FACTORIES: dict[str, Callable[[int], Policy]] = {
    "random": lambda seed: RandomPolicy(np.random.default_rng(seed)),
    "round-robin": lambda seed: RoundRobinPolicy(),
    "least-loaded": lambda seed: LeastLoadedPolicy(),
    "prefix-only": lambda seed: PrefixPolicy(),
    "sglang": lambda seed: SglangCacheAwarePolicy(),
    "dynamo": lambda seed: DynamoCostPolicy(),
    "llm-d": lambda seed: LlmdWeightedPolicy(),
    "kv-centric": lambda seed: KvCentricPolicy(),
    "kv-centric-noreject": lambda seed: KvCentricPolicy(reject=False),
    "remote-prefill": lambda seed: RemotePrefillPolicy(),
    "paas": lambda seed: PaasPolicy(),
}

#: Policies for a P+D disaggregated cluster (remote-prefill wants remote instances instead).
PD_POLICIES = ("random", "round-robin", "least-loaded", "prefix-only", "sglang", "dynamo", "llm-d", "kv-centric")
BASELINES = ("sglang", "dynamo", "llm-d")


def policy_names() -> list[str]:
    return list(_FACTORIES)


def make_policy(name: str, seed: int = 0) -> Policy:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise InvalidArgument(f"unknown policy {name!r}", hint=f"use one of {policy_names()}") from None
    return factory(seed)
