"""`globalkv up --gateways 2 --indexers 2` as real processes: every gateway serves and
shares its state with the other, the pods are split over the indexers, and after a kill -9
of one indexer the survivor follows them all and the index equals what the engines cache
(their `/_sim/cache`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from globalkv.stack.cluster import LocalCluster, StackConfig
from tests.support.net import wait_for

pytestmark = pytest.mark.integration

FAST = {
    "prefill_args": ["--prefill-tokens-per-s", "500000", "--prefill-overhead-ms", "1"],
    "decode_args": ["--decode-tokens-per-s", "5000"],
}
BS = 16


def _owners(indexer_url: str) -> dict[str, str | None]:
    pods = httpx.get(f"{indexer_url}/v1/pods", timeout=5).json()["pods"]
    return {p["id"]: p["owner"] for p in pods}


def _wrong_entries(cluster: LocalCluster, indexer_url: str) -> int:
    """Cached prefixes whose depth in the index differs from the engine's, over all pods."""
    wrong = 0
    for prefill in cluster.plan.by_role("prefill"):
        cache: dict[str, Any] = httpx.get(f"{prefill.url}/_sim/cache", timeout=5).json()
        for rank in cache["ranks"]:
            for tokens in rank["prefixes"]:
                body = {"model": "emulated-model", "token_ids": tokens}
                hits = httpx.post(f"{indexer_url}/v1/lookup", json=body, timeout=5).json()["pods"]
                depth = max((h["hit_blocks"] for h in hits if h["pod"] == prefill.pod), default=0)
                wrong += depth != len(tokens) // BS
    return wrong


def _converged(cluster: LocalCluster, indexer_url: str) -> bool:
    """The index caught up with every engine (events are applied a moment after)."""
    return _wrong_entries(cluster, indexer_url) == 0


def test_two_gateways_two_indexers_survive_an_indexer_kill(redis_url: str, tmp_path: Path) -> None:
    config = StackConfig(
        prefill=2,
        decode=1,
        gateways=2,
        indexers=2,
        redis_url=redis_url,
        gateway_port=0,
        run_dir=tmp_path / "run",
        block_size=BS,
        gateway_args=["--share-state-interval-secs", "0.1"],
        **FAST,
    )
    with LocalCluster(config) as cluster:
        names = [c.name for c in cluster.components]
        assert names[:2] == ["indexer-0", "indexer-1"]
        assert names[-2:] == ["gateway-0", "gateway-1"]
        assert len(set(cluster.gateway_urls)) == 2
        for i, gateway in enumerate(cluster.gateway_urls):
            body = {"text": f"prompt {i} " * 20, "sampling_params": {"max_new_tokens": 2}}
            answer = httpx.post(f"{gateway}/generate", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
        for gateway in cluster.gateway_urls:  # each shares with the other through Redis

            def sharing(url: str = gateway) -> bool:
                text = httpx.get(f"{url}/metrics", timeout=5).text
                return (
                    "globalkv_gateway_shared_replicas 1.0" in text
                    and "globalkv_gateway_shared_state_available 1.0" in text
                )

            wait_for(sharing, timeout=20, what=f"{gateway} to share with the other")
        survivor = cluster.indexer_urls[1]
        owners = _owners(survivor)
        assert sorted(owners) == ["prefill-0", "prefill-1"]
        assert sorted(owners.values()) == ["indexer-0", "indexer-1"]  # one each
        wait_for(lambda: _converged(cluster, survivor), timeout=20, what="the index to converge")

        cluster.kill("indexer-0")
        wait_for(
            lambda: set(_owners(survivor).values()) == {"indexer-1"},
            timeout=30,
            what="indexer-1 to own every pod",
        )
        for i, gateway in enumerate(cluster.gateway_urls):
            body = {"text": f"after the kill {i} " * 20, "sampling_params": {"max_new_tokens": 2}}
            answer = httpx.post(f"{gateway}/generate", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
        wait_for(lambda: _converged(cluster, survivor), timeout=20, what="the index to converge")
