"""Which pods are workers, and what a worker set's changes are, without a server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from lightkube.resources.core_v1 import Pod

from globalkv.discovery.kube_source import open_source
from globalkv.discovery.kubernetes import (
    KubernetesDiscovery,
    PodRejected,
    parse_selector,
    pod_worker,
)
from globalkv.discovery.model import (
    Changes,
    DiscoveredWorker,
    Snapshot,
    SnapshotCell,
    changes,
    follow,
)
from globalkv.extras import MissingExtra
from tests.support.kube_api import pod

SETTINGS = KubernetesDiscovery(
    prefill_selector={"role": "prefill"}, decode_selector={"role": "decode"}
)
A = DiscoveredWorker("a", "http://127.0.0.1:1", "prefill", 8998)
B = DiscoveredWorker("b", "http://127.0.0.1:2", "decode")
C = DiscoveredWorker("c", "http://127.0.0.1:3", "decode")


def worker(raw: dict[str, object]) -> DiscoveredWorker | None:
    return pod_worker(SETTINGS, Pod.from_dict(raw))


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        (["app=llm"], {"app": "llm"}),
        (["app=llm", "role=prefill"], {"app": "llm", "role": "prefill"}),
        (["app=llm,role=prefill"], {"app": "llm", "role": "prefill"}),
        (["app.kubernetes.io/component=prefill"], {"app.kubernetes.io/component": "prefill"}),
        (["tier="], {"tier": ""}),
    ],
)
def test_selectors_are_key_value_items(items: list[str], expected: dict[str, str]) -> None:
    assert parse_selector(items) == expected


@pytest.mark.parametrize("item", ["app", "=llm", "app=l l", "-app=llm", "app=llm=x", "a/b/c=d"])
def test_a_selector_that_is_not_key_value_is_refused(item: str) -> None:
    with pytest.raises(ValueError, match="label selector"):
        parse_selector([item])


def test_the_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="prefill or a decode selector"):
        KubernetesDiscovery(prefill_selector={}, decode_selector={})
    with pytest.raises(ValueError, match="port 0"):
        KubernetesDiscovery(prefill_selector={"a": "b"}, decode_selector={}, port=0)
    assert SETTINGS.port == 80
    assert SETTINGS.bootstrap_port_annotation == "sglang.ai/bootstrap-port"


def test_a_ready_running_pod_is_a_worker_at_the_discovery_port() -> None:
    raw = pod(
        "p",
        {"role": "prefill", "x": "y"},
        ip="127.0.0.5",
        annotations={"sglang.ai/bootstrap-port": " 8998 "},
    )
    assert worker(raw) == DiscoveredWorker("default/p", "http://127.0.0.5:80", "prefill", 8998)


def test_decode_pods_may_be_reached_at_their_own_port() -> None:
    """An endpoint picker sends requests to the decodes' sidecars, beside the engines."""
    settings = KubernetesDiscovery(
        prefill_selector={"role": "prefill"}, decode_selector={"role": "decode"}, decode_port=8100
    )
    decode = pod_worker(settings, Pod.from_dict(pod("d", {"role": "decode"}, ip="127.0.0.4")))
    prefill = pod_worker(settings, Pod.from_dict(pod("p", {"role": "prefill"}, ip="127.0.0.5")))
    assert decode == DiscoveredWorker("default/d", "http://127.0.0.4:8100", "decode")
    assert prefill == DiscoveredWorker("default/p", "http://127.0.0.5:80", "prefill")
    with pytest.raises(ValueError, match="port 70000"):
        KubernetesDiscovery(prefill_selector={"a": "b"}, decode_selector={}, decode_port=70000)


def test_an_ipv6_pod_ip_is_bracketed_in_the_url() -> None:
    assert worker(pod("d", {"role": "decode"}, ip="fd00::7")) == DiscoveredWorker(
        "default/d", "http://[fd00::7]:80", "decode"
    )


def test_a_decode_ignores_the_bootstrap_annotation() -> None:
    raw = pod("d", {"role": "decode"}, annotations={"sglang.ai/bootstrap-port": "nonsense"})
    assert worker(raw) == DiscoveredWorker("default/d", "http://127.0.0.2:80", "decode")


@pytest.mark.parametrize(
    "raw",
    [
        pod("d", {"role": "router"}),
        pod("d", {}),
        pod("d", {"role": "decode"}, ready=False),
        pod("d", {"role": "decode"}, phase="Succeeded"),
        pod("d", {"role": "decode"}, ip=None, ready=False, phase="Pending"),
        {"metadata": {"name": "d", "namespace": "default", "labels": {"role": "decode"}}},
    ],
)
def test_pods_that_are_not_workers_yet(raw: dict[str, object]) -> None:
    assert worker(raw) is None


@pytest.mark.parametrize(
    "value", ["0", "65536", "８９９８", "89 98", "-1", "1e3", "", "99999999999"]
)
def test_a_bootstrap_annotation_that_is_not_a_port_refuses_the_pod(value: str) -> None:
    raw = pod("p", {"role": "prefill"}, annotations={"sglang.ai/bootstrap-port": value})
    with pytest.raises(PodRejected, match="is not a port") as refused:
        worker(raw)
    assert refused.value.kind == "bad bootstrap port"


def test_a_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(MissingExtra) as missing:
        open_source(SETTINGS)
    assert str(missing.value) == (
        "Kubernetes service discovery needs lightkube: pip install 'globalkv[kubernetes]'"
    )


def test_changes_are_what_takes_one_set_to_the_other() -> None:
    moved = DiscoveredWorker("b", "http://127.0.0.1:2", "prefill")
    step = changes(frozenset({A, B}), frozenset({A, moved, C}))
    assert step == Changes(added=(moved, C), removed=(B,))
    assert not changes(frozenset({A}), frozenset({A}))


async def test_a_reader_skips_to_the_newest_snapshot_and_ends_on_close() -> None:
    cell = SnapshotCell()
    reader = cell.updates()
    assert await cell.publish(frozenset({A}))
    assert await cell.publish(frozenset({A, B}))
    assert not await cell.publish(frozenset({A, B}))
    assert await anext(reader) == frozenset({A, B})
    waiting = asyncio.ensure_future(anext(reader))
    await cell.close()
    with pytest.raises(StopAsyncIteration):
        await waiting


async def test_follow_applies_each_step_from_nothing() -> None:
    async def snapshots() -> AsyncIterator[Snapshot]:
        for snapshot in (frozenset({A, B}), frozenset({A, B}), frozenset({A, C}), frozenset()):
            yield snapshot

    applied: list[Changes] = []

    async def apply(step: Changes) -> None:
        applied.append(step)

    assert await follow(snapshots(), apply) == frozenset()
    assert applied == [
        Changes(added=(A, B), removed=()),
        Changes(added=(C,), removed=(B,)),
        Changes(added=(), removed=(A, C)),
    ]
