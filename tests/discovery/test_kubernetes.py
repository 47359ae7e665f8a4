"""The Kubernetes source against tests/support/kube_api.py, over real sockets: pods coming
and going, the API server restarting, history compacted under a watch, watches dropped,
and objects no real API server would send."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User

from globalkv.discovery.kube_source import open_source
from globalkv.discovery.kube_watch import KubernetesSource
from globalkv.discovery.kubernetes import KubernetesDiscovery
from globalkv.discovery.model import Changes, DiscoveredWorker
from kvplumbing.backoff import Backoff
from tests.discovery.support import added_ids, applied_ids, consumer, removed_ids, until
from tests.support.kube_api import FakeKubeApi, pod

pytestmark = pytest.mark.integration

PREFILL = {"app": "llm", "role": "prefill"}
DECODE = {"app": "llm", "role": "decode"}
ANNOTATION = "sglang.ai/bootstrap-port"
SETTINGS = KubernetesDiscovery(
    prefill_selector=PREFILL,
    decode_selector=DECODE,
    port=30000,
    backoff=Backoff(0.01, 0.2),
)


@asynccontextmanager
async def discovering(
    api: FakeKubeApi, settings: KubernetesDiscovery = SETTINGS
) -> AsyncIterator[tuple[KubernetesSource, list[Changes]]]:
    config = KubeConfig.from_one(cluster=Cluster(server=api.url), user=User(token="test"))
    client = AsyncClient(config=config)
    try:
        async with (
            KubernetesSource(settings, client=client) as source,
            consumer(source.snapshots()) as applied,
        ):
            yield source, applied
    finally:
        await client.close()


def workers(source: KubernetesSource) -> dict[str, DiscoveredWorker]:
    return {worker.id: worker for worker in source.current or ()}


def ids(source: KubernetesSource) -> set[str]:
    return set(workers(source))


async def test_running_ready_pods_become_workers_by_selector(api: FakeKubeApi) -> None:
    api.apply(pod("p1", PREFILL, ip="127.0.0.11", annotations={ANNOTATION: "8998"}))
    api.apply(pod("p2", PREFILL, ip="127.0.0.12"))
    api.apply(pod("d1", DECODE, ip="127.0.0.21", annotations={ANNOTATION: "8998"}))
    api.apply(pod("other", {"app": "llm", "role": "router"}, ip="127.0.0.31"))
    async with discovering(api) as (source, applied):
        await until(lambda: len(ids(source)) == 3, "three workers")
        assert workers(source) == {
            "default/p1": DiscoveredWorker(
                "default/p1", "http://127.0.0.11:30000", "prefill", 8998
            ),
            "default/p2": DiscoveredWorker("default/p2", "http://127.0.0.12:30000", "prefill"),
            "default/d1": DiscoveredWorker("default/d1", "http://127.0.0.21:30000", "decode"),
        }
        await until(lambda: applied_ids(applied) == ids(source), "the consumer caught up")
        assert sorted(added_ids(applied)) == ["default/d1", "default/p1", "default/p2"]
    lists, watches = api.list_requests(), api.watch_requests()
    assert {q["labelSelector"] for q in lists} == {"app=llm,role=prefill", "app=llm,role=decode"}
    assert all(q["limit"] == "500" for q in lists)
    assert {q["resourceVersion"] for q in watches} == {"104"}  # the lists' version
    assert all(q["allowWatchBookmarks"] == "true" for q in watches)
    assert source.counts["failures"] == 0


async def test_a_pod_is_a_worker_only_while_running_ready_and_not_terminating(
    api: FakeKubeApi,
) -> None:
    pending = pod("d1", DECODE, ip=None, ready=False, phase="Pending")
    api.apply(pending)
    api.apply(pod("d0", DECODE, ip="127.0.0.20"))
    async with discovering(api) as (source, applied):
        await until(lambda: ids(source) == {"default/d0"}, "the ready pod only")
        api.apply(pod("d1", DECODE, ip="127.0.0.21", ready=False))
        api.apply(pod("d1", DECODE, ip="127.0.0.21"))
        await until(lambda: "default/d1" in ids(source), "d1 once Ready")
        api.apply(pod("d1", DECODE, ip="127.0.0.21", ready=False))
        await until(lambda: "default/d1" not in ids(source), "d1 gone when it loses Ready")
        api.apply(pod("d1", DECODE, ip="127.0.0.21"))
        await until(lambda: "default/d1" in ids(source), "d1 back when Ready again")
        terminating = pod("d1", DECODE, ip="127.0.0.21")
        terminating["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
        api.apply(terminating)
        await until(lambda: "default/d1" not in ids(source), "d1 gone while terminating")
        api.delete("d1")
        api.delete("d0")
        await until(lambda: ids(source) == set(), "no workers once deleted")
        await until(lambda: "default/d0" in removed_ids(applied), "the consumer caught up")
        assert added_ids(applied).count("default/d1") == 2
        assert removed_ids(applied).count("default/d1") == 2
        assert source.rejected == {}  # not being a worker yet is not bad input


async def test_relabelled_pods_change_role_or_leave(api: FakeKubeApi) -> None:
    api.apply(pod("x", PREFILL, ip="127.0.0.11"))
    async with discovering(api) as (source, _):
        await until(lambda: "default/x" in ids(source), "x as a prefill")
        assert workers(source)["default/x"].role == "prefill"
        api.apply(pod("x", DECODE, ip="127.0.0.11"))
        await until(
            lambda: (
                workers(source).get("default/x", None) is not None
                and workers(source)["default/x"].role == "decode"
            ),
            "x as a decode",
        )
        api.apply(pod("x", {"app": "llm"}, ip="127.0.0.11"))
        await until(lambda: ids(source) == set(), "x no longer matching")


async def test_a_pod_both_selectors_match_is_a_prefill(api: FakeKubeApi) -> None:
    settings = replace(
        SETTINGS, prefill_selector={"tier": "prefill"}, decode_selector={"app": "llm"}
    )
    api.apply(pod("both", {"app": "llm", "tier": "prefill"}, ip="127.0.0.11"))
    async with discovering(api, settings) as (source, applied):
        await until(lambda: "default/both" in ids(source), "the pod")
        assert [w.role for w in source.current or ()] == ["prefill"]
        api.apply(pod("both", {"app": "llm"}, ip="127.0.0.11"))
        await until(lambda: len(applied) == 2, "the move applied")
        assert [(w.id, w.role) for w in applied[-1].removed] == [("default/both", "prefill")]
        assert [(w.id, w.role) for w in applied[-1].added] == [("default/both", "decode")]


async def test_a_pod_back_under_its_name_with_a_new_ip_replaces_the_old_worker(
    api: FakeKubeApi,
) -> None:
    api.apply(pod("d1", DECODE, ip="127.0.0.21"))
    async with discovering(api) as (source, applied):
        await until(lambda: "default/d1" in ids(source), "d1")
        api.apply(pod("d1", DECODE, ip="127.0.0.22"))
        await until(
            lambda: workers(source)["default/d1"].url == "http://127.0.0.22:30000", "new IP"
        )
        await until(lambda: len(applied) == 2, "the change applied")
        assert [w.url for w in applied[-1].removed] == ["http://127.0.0.21:30000"]
        assert [w.url for w in applied[-1].added] == ["http://127.0.0.22:30000"]


async def test_namespace_scopes_the_watch(api: FakeKubeApi) -> None:
    api.apply(pod("d1", DECODE, ip="127.0.0.21", namespace="serving"))
    api.apply(pod("d2", DECODE, ip="127.0.0.22", namespace="elsewhere"))
    async with discovering(api, replace(SETTINGS, namespace="serving")) as (source, _):
        await until(lambda: ids(source) == {"serving/d1"}, "the serving namespace's pod")
    assert {path for path, _ in api.requests} == {"/api/v1/namespaces/serving/pods"}


async def test_api_server_restart_keeps_workers_and_resumes_the_watch(api: FakeKubeApi) -> None:
    api.apply(pod("p1", PREFILL, ip="127.0.0.11"))
    api.apply(pod("d1", DECODE, ip="127.0.0.21"))
    async with discovering(api) as (source, applied):
        await until(lambda: ids(source) == {"default/p1", "default/d1"}, "both workers")
        await api.stop()
        await until(lambda: source.counts["failures"] >= 4, "failed reconnects")
        assert ids(source) == {"default/p1", "default/d1"}
        api.apply(pod("d2", DECODE, ip="127.0.0.22"))  # changed while the server was away
        api.delete("p1")
        await api.start()
        await until(lambda: ids(source) == {"default/d1", "default/d2"}, "the missed changes")
        assert source.counts["lists"] == 2  # resumed from its version, not listed again
        await until(lambda: applied_ids(applied) == ids(source), "the consumer caught up")
        assert removed_ids(applied) == ["default/p1"]


async def test_gone_version_relists_and_removes_only_what_the_list_lacks(
    api: FakeKubeApi,
) -> None:
    api.apply(pod("p1", PREFILL, ip="127.0.0.11"))
    api.apply(pod("p2", PREFILL, ip="127.0.0.12"))
    api.apply(pod("d1", DECODE, ip="127.0.0.21"))
    async with discovering(api) as (source, applied):
        await until(lambda: len(ids(source)) == 3, "three workers")
        await api.stop()
        api.delete("p2")
        api.apply(pod("p3", PREFILL, ip="127.0.0.13"))
        api.apply(pod("d1", {**DECODE, "rollout": "2"}, ip="127.0.0.21"))
        api.compact()  # the watches' version is now gone
        await api.start()
        await until(lambda: ids(source) == {"default/p1", "default/p3", "default/d1"}, "relisted")
        assert source.counts["gone"] == 2
        assert source.counts["lists"] == 4
        await until(lambda: applied_ids(applied) == ids(source), "the consumer caught up")
        assert removed_ids(applied) == ["default/p2"]
        assert sorted(added_ids(applied)) == [
            "default/d1",
            "default/p1",
            "default/p2",
            "default/p3",
        ]


async def test_a_dropped_watch_resumes_from_the_last_version_seen(api: FakeKubeApi) -> None:
    api.apply(pod("d1", DECODE, ip="127.0.0.21"))
    async with discovering(api) as (source, _):
        await until(lambda: api.watching == 2, "both watches")
        api.apply(pod("d2", DECODE, ip="127.0.0.22"))
        await until(lambda: "default/d2" in ids(source), "d2")
        seen = str(api.version)
        api.drop_watches()
        api.apply(pod("d3", DECODE, ip="127.0.0.23"))
        await until(lambda: "default/d3" in ids(source), "d3 after the drop")
        assert source.counts["lists"] == 2
        assert source.counts["gone"] == 0
        decode_watches = [
            q for q in api.watch_requests() if q["labelSelector"] == "app=llm,role=decode"
        ]
        assert decode_watches[1]["resourceVersion"] == seen


async def test_a_watch_the_server_ends_carries_on_without_a_failure(api: FakeKubeApi) -> None:
    async with discovering(api) as (source, _):
        await until(lambda: api.watching == 2, "both watches")
        api.end_watches()
        await until(lambda: len(api.watch_requests()) == 4, "both watching again")
        api.apply(pod("d1", DECODE, ip="127.0.0.21"))
        await until(lambda: ids(source) == {"default/d1"}, "d1")
        assert source.counts["failures"] == 0
        assert source.counts["lists"] == 2


async def test_bookmarks_carry_the_version_past_compacted_history(api: FakeKubeApi) -> None:
    api.apply(pod("d1", DECODE, ip="127.0.0.21"))
    async with discovering(api) as (source, _):
        await until(lambda: api.watching == 2, "both watches")
        for number in range(20):  # churn no selector matches
            api.apply(pod(f"job-{number}", {"app": "batch"}, ip="127.0.0.99"))
        api.bookmark()
        api.end_watches()
        latest = str(api.version)
        await until(
            lambda: sum(q["resourceVersion"] == latest for q in api.watch_requests()) == 2,
            "both watches resumed at the bookmark",
        )
        api.compact()
        api.drop_watches()
        await until(
            lambda: sum(q["resourceVersion"] == latest for q in api.watch_requests()) == 4,
            "both resumed again after the drop",
        )
        api.apply(pod("d2", DECODE, ip="127.0.0.22"))
        await until(lambda: ids(source) == {"default/d1", "default/d2"}, "d2")
        assert source.counts["gone"] == 0
        assert source.counts["lists"] == 2


async def test_pods_stating_unusable_things_are_skipped_counted_and_logged_once(
    api: FakeKubeApi, caplog: pytest.LogCaptureFixture
) -> None:
    api.apply(pod("bad-port", PREFILL, ip="127.0.0.11", annotations={ANNOTATION: "http"}))
    api.apply(pod("no-ip", DECODE, ip=None))
    api.apply(pod("bad-ip", DECODE, ip="300.1.1.1"))
    nameless = pod("x", DECODE, ip="127.0.0.24")
    nameless["metadata"]["name"] = ""
    api.apply(nameless)
    api.apply(pod("good", DECODE, ip="127.0.0.21"))
    async with discovering(api) as (source, _):
        await until(lambda: ids(source) == {"default/good"}, "the good pod only")
        api.apply(
            pod(
                "bad-port", {**PREFILL, "v": "2"}, ip="127.0.0.11", annotations={ANNOTATION: "http"}
            )
        )
        api.apply(pod("bad-port", PREFILL, ip="127.0.0.11", annotations={ANNOTATION: "8998"}))
        await until(lambda: "default/bad-port" in ids(source), "bad-port once fixed")
        assert workers(source)["default/bad-port"].bootstrap_port == 8998
        assert source.rejected == {
            "bad bootstrap port": 1,
            "no pod IP": 1,
            "bad pod IP": 1,
            "no name": 1,
        }
        assert source.counts["failures"] == 0
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 4
    assert any("'http' is not a port" in message for message in skipped)


async def test_an_undecodable_object_keeps_the_workers_until_it_is_gone(api: FakeKubeApi) -> None:
    api.apply(pod("p1", PREFILL, ip="127.0.0.11"))
    api.apply(pod("d1", DECODE, ip="127.0.0.21"))
    async with discovering(api) as (source, _):
        await until(lambda: ids(source) == {"default/p1", "default/d1"}, "both workers")
        broken = pod("broken", DECODE, ip="127.0.0.29")
        broken["status"]["podIP"] = 7  # no real API server stores this
        api.apply(broken)
        await until(lambda: source.counts["failures"] >= 3, "the watch and relists failing")
        assert ids(source) == {"default/p1", "default/d1"}
        api.delete("broken")
        api.apply(pod("d2", DECODE, ip="127.0.0.22"))
        await until(lambda: "default/d2" in ids(source), "decode discovery recovered")
        assert ids(source) == {"default/p1", "default/d1", "default/d2"}


async def test_unreachable_at_start_publishes_nothing_until_a_list_succeeds() -> None:
    api = FakeKubeApi()  # not listening yet
    api.apply(pod("d1", DECODE, ip="127.0.0.21"))
    async with discovering(api) as (source, applied):
        await until(lambda: source.counts["failures"] >= 4, "failed lists")
        assert source.current is None
        assert applied == []
        await api.start()
        try:
            await until(lambda: ids(source) == {"default/d1"}, "d1 once the server answers")
        finally:
            await api.stop()


async def test_a_huge_list_is_paged_and_capped(api: FakeKubeApi) -> None:
    for number in range(1200):
        api.apply(pod(f"d{number:04}", DECODE, ip=f"127.1.{number // 250}.{number % 250 + 1}"))
    settings = replace(SETTINGS, max_workers=1000)
    async with discovering(api, settings) as (source, _):
        await until(lambda: len(ids(source)) == 1000, "the first 1000 workers", timeout=30)
        assert source.left_out == 200
        assert max(ids(source)) == "default/d0999"
    pages = [q for q in api.list_requests() if q["labelSelector"] == "app=llm,role=decode"]
    assert len(pages) == 3
    assert "continue" not in pages[0]
    assert all("continue" in q for q in pages[1:])


async def test_duplicate_addresses_keep_the_first_pod_by_id(api: FakeKubeApi) -> None:
    api.apply(pod("a", DECODE, ip="127.0.0.21"))
    api.apply(pod("b", DECODE, ip="127.0.0.21"))
    async with discovering(api) as (source, _):
        await until(lambda: ids(source) == {"default/a"}, "a only")
        assert source.left_out == 1
        api.delete("a")
        await until(lambda: ids(source) == {"default/b"}, "b once a is gone")
        assert source.left_out == 0


async def test_the_client_comes_from_kubeconfig(
    api: FakeKubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                "users": [{"name": "fake", "user": {"token": "test"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    api.apply(pod("d1", DECODE, ip="127.0.0.21"))
    async with open_source(SETTINGS) as source:
        await until(lambda: source.current is not None and len(source.current) == 1, "d1")


async def test_no_kubernetes_configuration_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(ValueError, match=r"^Kubernetes service discovery: .*absent"):
        async with open_source(SETTINGS):
            pass
