"""The Kubernetes API stand-in keeps the contract the discovery tests rely on."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.kube_api import BadSelector, FakeKubeApi, parse_selector, pod, selector_matches

LABELS = {"app": "llm", "role": "prefill"}


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ("", True),
        ("app=llm", True),
        ("app==llm,role=prefill", True),
        ("app!=llm", False),
        ("zone!=a", True),
        ("role in (prefill, decode)", True),
        ("role notin (prefill)", False),
        ("app", True),
        ("!app", False),
        ("!zone,app in (llm)", True),
    ],
)
def test_label_selectors(selector: str, matches: bool) -> None:
    assert selector_matches(parse_selector(selector), LABELS) is matches


def test_a_bad_selector_is_refused() -> None:
    with pytest.raises(BadSelector):
        parse_selector("role in prefill")


async def test_pages_come_from_one_snapshot_and_expire_with_compaction(api: FakeKubeApi) -> None:
    for number in range(3):
        api.apply(pod(f"p{number}", LABELS))
    async with httpx.AsyncClient(base_url=api.url) as client:
        first = (await client.get("/api/v1/pods", params={"limit": 2})).json()
        assert [item["metadata"]["name"] for item in first["items"]] == ["p0", "p1"]
        api.delete("p2")
        token = first["metadata"]["continue"]
        rest = (await client.get("/api/v1/pods", params={"limit": 2, "continue": token})).json()
        assert [item["metadata"]["name"] for item in rest["items"]] == ["p2"]
        assert rest["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
        again = (await client.get("/api/v1/pods", params={"limit": 1})).json()
        api.apply(pod("p3", LABELS))
        api.compact()  # history up to p3: the snapshot `again` paged from is gone
        gone = await client.get("/api/v1/pods", params={"continue": again["metadata"]["continue"]})
        assert gone.status_code == 410
        assert gone.json()["reason"] == "Expired"


async def test_a_watch_from_a_compacted_version_gets_a_410_error_event(api: FakeKubeApi) -> None:
    api.apply(pod("p0", LABELS))
    api.compact()
    async with httpx.AsyncClient(base_url=api.url) as client:
        answer = await client.get("/api/v1/pods", params={"watch": "1", "resourceVersion": "100"})
        assert answer.status_code == 200
        (event,) = [json.loads(line) for line in answer.text.splitlines()]
        assert event["type"] == "ERROR"
        assert event["object"]["code"] == 410


async def test_a_watch_sees_relabelling_as_added_and_deleted(api: FakeKubeApi) -> None:
    api.apply(pod("p0", {"app": "other"}))
    start = str(api.version)
    api.apply(pod("p0", LABELS))
    api.apply(pod("p0", {**LABELS, "v": "2"}))
    api.apply(pod("p0", {"app": "other"}))
    params = {
        "watch": "true",
        "resourceVersion": start,
        "labelSelector": "app=llm",
        "timeoutSeconds": "1",
    }
    async with httpx.AsyncClient(base_url=api.url) as client:
        answer = await client.get("/api/v1/pods", params={**params, "allowWatchBookmarks": "true"})
    events = [json.loads(line)["type"] for line in answer.text.splitlines()]
    assert events == ["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]
