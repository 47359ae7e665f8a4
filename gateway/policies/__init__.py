"""Routing policies: one module each, one interface (`gateway.policies.base`)."""

from __future__ import annotations

from random import Random

from gateway.policies.base import Choice, NoCandidates, Policy
from gateway.policies.cache_aware import CacheAwarePolicy
from gateway.policies.least_load import LeastLoadPolicy
from gateway.policies.power_of_two import PowerOfTwoPolicy
from gateway.policies.prefix import PrefixPolicy
from gateway.policies.random import RandomPolicy
from gateway.policies.round_robin import RoundRobinPolicy
from gateway.settings.base import PolicyName
from gateway.settings.routing import CacheAwareConfig, PrefixWeights

__all__ = [
    "CacheAwarePolicy",
    "Choice",
    "LeastLoadPolicy",
    "NoCandidates",
    "Policy",
    "PowerOfTwoPolicy",
    "PrefixPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "build_policy",
]


def build_policy(
    name: PolicyName,
    rng: Random,
    *,
    prefix: PrefixWeights | None = None,
    cache_aware: CacheAwareConfig | None = None,
) -> Policy:
    """A fresh policy by its CLI name; the cache policies fall back to least load."""
    if name == "prefix":
        return PrefixPolicy(prefix or PrefixWeights(), rng, LeastLoadPolicy(rng))
    if name == "cache_aware":
        return CacheAwarePolicy(cache_aware or CacheAwareConfig(), LeastLoadPolicy(rng))
    if name == "power_of_two":
        return PowerOfTwoPolicy(rng)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "random":
        return RandomPolicy(rng)
    if name == "least_load":
        return LeastLoadPolicy(rng)
    raise ValueError(f"unknown policy {name!r}")
