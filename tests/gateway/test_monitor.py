"""Background state: health, /server_info discovery, pod registration, directory readiness."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from gateway.requests.bodies import parse_request
from gateway.requests.query import RouteQuery
from gateway.settings.workers import HealthConfig, KvEventsSpec, WorkerSpec
from gateway.workers.directory import DirectoryStatus
from gateway.workers.monitor import PodRegistration, RegistrationFailed
from gateway.workers.pods import pod_info
from gateway.workers.pool import Worker, worker_id
from gateway.workers.server_info import parse_server_info
from tests.gateway.fakes import (
    PREFILLS,
    Cluster,
    Reading,
    StubLookup,
    StubProbe,
    config,
    make_gateway,
)
from tests.support.clock import FakeClock
from tests.support.net import await_for

EMULATOR_INFO = {
    "served_model_name": "tiny",
    "disaggregation_bootstrap_port": 8998,
    "kv_events": {
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv@pod-a@tiny",
        "block_size": 16,
        "dp_size": 2,
    },
}


class Registrar:
    def __init__(self, fail: bool = False) -> None:
        self.pods: list[PodRegistration] = []
        self.removed: list[str] = []
        self.fail = fail

    async def register(self, pod: PodRegistration) -> None:
        if self.fail:
            raise RegistrationFailed("indexer down")
        self.pods.append(pod)

    async def unregister(self, pod_id: str) -> None:
        self.removed.append(pod_id)

    async def listed(self) -> set[str]:
        return {pod.id for pod in self.pods} - set(self.removed)


def test_parse_server_info_from_our_engine_and_from_sglang() -> None:
    ours = parse_server_info(EMULATOR_INFO, "10.0.0.1")
    assert ours.kv_events == KvEventsSpec(
        endpoint="tcp://10.0.0.1:5557", replay_endpoint="tcp://10.0.0.1:5558", topic="kv@pod-a@tiny"
    )
    assert (ours.bootstrap_port, ours.dp_size, ours.block_size, ours.model) == (8998, 2, 16, "tiny")
    sglang = {
        "kv_events_config": '{"publisher": "zmq", "endpoint": "tcp://0.0.0.0:6000"}',
        "page_size": 64,
        "dp_size": 1,
        "served_model_name": "llama",
    }
    parsed = parse_server_info(sglang, "::1")
    assert parsed.kv_events is not None
    assert parsed.kv_events.endpoint == "tcp://[::1]:6000"
    assert (parsed.block_size, parsed.bootstrap_port) == (64, None)
    assert parse_server_info({"kv_events_config": "{broken"}, "h").kv_events is None
    connecting = {"kv_events": {"endpoint": "tcp://indexer:5557", "topic": "kv@p@m", "bind": False}}
    spec = parse_server_info(connecting, "h").kv_events
    assert spec == KvEventsSpec(endpoint=None, topic="kv@p@m", mode="bind")
    registration = PodRegistration("p", "m", 16, "prefill", "http://h:1", "h", None, spec, 1)
    assert pod_info(registration).kv_events.mode == "bind"


def test_identity_helpers() -> None:
    assert worker_id("http://10.0.0.1:30001/") == "10.0.0.1:30001"
    assert worker_id("https://h") == "h:443"
    assert worker_id("http://[::1]:8") == "[::1]:8"


async def test_discovery_registers_the_pod_and_reads_its_directory() -> None:
    cluster = Cluster()
    cluster.server_info["10.0.0.1:30001"] = EMULATOR_INFO
    registrar = Registrar()
    probe = StubProbe()
    topology = {"dp_size": 2, "follow_bootstrap_room": True}
    probe.readings["http://10.0.0.1:8998"] = Reading(topology=topology)
    cfg = config(
        prefill=[WorkerSpec(url="http://10.0.0.1:30001", role="prefill")], model=None, block_size=4
    )
    gateway = await make_gateway(cluster, cfg, registrar=registrar, probe=probe)
    worker = gateway.pool.get("10.0.0.1:30001")
    assert worker is not None
    assert worker.pod == "pod-a"
    assert worker.bootstrap_port is None, "`none` stays null in requests"
    assert worker.directory.status is DirectoryStatus.READY
    assert (worker.directory.dp_size, worker.directory.follow_bootstrap_room) == (2, True)
    assert gateway.monitor.served_model() == "tiny"
    (pod,) = registrar.pods
    assert (pod.id, pod.model, pod.block_size, pod.bootstrap_port, pod.dp_size) == (
        "pod-a",
        "tiny",
        16,
        8998,
        2,
    )
    info = pod_info(pod)
    assert info.kv_events.endpoint == "tcp://10.0.0.1:5557"
    await gateway.monitor.run_once(force=True)
    assert len(registrar.pods) == 1, "registered once"
    await gateway.remove_worker(worker.id)
    assert registrar.removed == ["pod-a"]


async def test_the_discovered_kv_capacity_reaches_the_prefill_candidates() -> None:
    cluster = Cluster()
    cluster.server_info["10.0.0.1:30001"] = {**EMULATOR_INFO, "kv_cache": [{"capacity": 64}]}
    cfg = config(prefill=[WorkerSpec(url="http://10.0.0.1:30001", role="prefill")])
    gateway = await make_gateway(cluster, cfg, registrar=Registrar())
    (candidate,) = gateway.pool.candidates("prefill", gateway.router.loads)
    assert (candidate.worker, candidate.cache_capacity_tokens) == ("10.0.0.1:30001", 64 * 16)


async def test_without_bootstrap_port_the_directory_is_unknown_and_eligible() -> None:
    cluster = Cluster()
    cfg = config(prefill=[WorkerSpec(url="http://10.0.0.1:30001", role="prefill")])
    gateway = await make_gateway(cluster, cfg)
    worker = gateway.pool.get("10.0.0.1:30001")
    assert worker is not None
    assert worker.directory.status is DirectoryStatus.UNKNOWN
    assert worker.eligible


async def test_a_server_info_that_fails_is_asked_again_and_one_that_is_missing_is_not() -> None:
    cluster = Cluster()
    cluster.server_info["10.0.0.1:30001"] = 503
    cfg = config(prefill=[WorkerSpec(url="http://10.0.0.1:30001", role="prefill")])
    gateway = await make_gateway(cluster, cfg, registrar=Registrar())
    worker = gateway.pool.get("10.0.0.1:30001")
    assert worker is not None
    assert not worker.discovered
    assert worker.last_error == (
        "/server_info answered 503 without a JSON object; asked again next round"
    )
    cluster.server_info["10.0.0.1:30001"] = EMULATOR_INFO
    await gateway.monitor.run_once()
    assert (worker.discovered, worker.pod, worker.registered_pod) == (True, "pod-a", "pod-a")
    assert worker.last_error is None
    cluster.server_info["10.0.0.2:30001"] = 404
    missing = gateway.add_worker(WorkerSpec(url="http://10.0.0.2:30001", role="prefill"))
    await gateway.monitor.run_once()
    assert (missing.discovered, missing.kv_events) == (True, None)
    cluster.server_info["10.0.0.2:30001"] = EMULATOR_INFO
    await gateway.monitor.run_once()
    assert missing.kv_events is None, "a worker without /server_info is not asked again"


async def test_a_round_that_fails_unexpectedly_does_not_stop_the_monitor() -> None:
    class Flaky(StubProbe):
        fail = False

        async def read(self, bootstrap_url: str) -> Reading:
            if self.fail:
                self.fail = False
                raise RuntimeError("a bug in a reader")
            return await super().read(bootstrap_url)

    flaky, clock = Flaky(), FakeClock()
    gateway = await make_gateway(Cluster(), config(), probe=flaky, clock=clock)
    flaky.fail, clock.now = True, clock.now + 100  # every check due; the first read raises
    before = len(flaky.reads)
    gateway.monitor.start()
    try:
        await await_for(
            _async(lambda: len(flaky.reads) >= before + 2 and not flaky.fail),
            timeout=10,
            what="a round after the failed one",
        )
    finally:
        await gateway.monitor.stop()


async def test_failed_registration_is_retried_and_shown() -> None:
    cluster = Cluster()
    cluster.server_info["10.0.0.1:30001"] = EMULATOR_INFO
    registrar = Registrar(fail=True)
    cfg = config(prefill=[WorkerSpec(url="http://10.0.0.1:30001", role="prefill")])
    gateway = await make_gateway(cluster, cfg, registrar=registrar)
    worker = gateway.pool.get("10.0.0.1:30001")
    assert worker is not None
    assert worker.registered_pod is None
    assert "indexer down" in (worker.last_error or "")
    registrar.fail = False
    await gateway.monitor.run_once(force=True)
    assert worker.registered_pod == "pod-a"
    assert worker.last_error is None, "a registration that succeeded on retry is no problem"


async def test_a_call_error_outlives_a_later_registration() -> None:
    cluster = Cluster()
    cluster.server_info["10.0.0.1:30001"] = EMULATOR_INFO
    registrar = Registrar(fail=True)
    cfg = config(prefill=[WorkerSpec(url="http://10.0.0.1:30001", role="prefill")])
    gateway = await make_gateway(cluster, cfg, registrar=registrar)
    worker = gateway.pool.get("10.0.0.1:30001")
    assert worker is not None
    worker.note_error("prefill call answered HTTP 500", 1.0)
    registrar.fail = False
    await gateway.monitor.run_once(force=True)
    assert worker.last_error == "prefill call answered HTTP 500"


@pytest.mark.parametrize(
    ("reading", "status"),
    [
        (Reading(ready=False, registered=1, expected=2), DirectoryStatus.NOT_READY),
        (Reading(reachable=False, ready=False, error="refused"), DirectoryStatus.UNREACHABLE),
    ],
)
async def test_unready_directory_takes_no_traffic(
    reading: Reading, status: DirectoryStatus
) -> None:
    cluster = Cluster()
    probe = StubProbe()
    probe.readings["http://10.0.0.1:8998"] = reading
    gateway = await make_gateway(cluster, probe=probe)
    worker = gateway.pool.get("10.0.0.1:30001")
    assert worker is not None
    assert worker.directory.status is status
    assert not worker.eligible
    assert [c.worker for c in gateway.pool.candidates("prefill", gateway.loads)] == [
        "10.0.0.2:30001"
    ]


async def test_a_ready_directory_turns_unreachable_only_after_the_failure_threshold() -> None:
    cluster = Cluster()
    probe = StubProbe()
    url = "http://10.0.0.1:8998"
    probe.readings[url] = Reading(ready=True, registered=1, expected=1)
    health = HealthConfig(failure_threshold=3)
    gateway = await make_gateway(cluster, config(health=health), probe=probe)
    worker = gateway.pool.get("10.0.0.1:30001")
    assert worker is not None

    def status(worker: Worker) -> DirectoryStatus:  # read anew: no narrowing between reads
        return worker.directory.status

    def kept() -> list[str]:  # the candidates kept for a policy that reads no load
        return [c.worker for c in gateway.pool.candidates("prefill", None)]

    assert status(worker) is DirectoryStatus.READY
    assert kept() == ["10.0.0.1:30001", "10.0.0.2:30001"]
    probe.readings[url] = Reading(reachable=False, ready=False, error="timed out")
    for _ in range(2):
        await gateway.monitor.run_once(force=True)
        assert status(worker) is DirectoryStatus.READY
        assert worker.eligible, "one missed read is a hiccup, not a dead directory"
    await gateway.monitor.run_once(force=True)
    assert status(worker) is DirectoryStatus.UNREACHABLE
    assert not worker.eligible
    assert kept() == ["10.0.0.2:30001"]
    probe.readings[url] = Reading(ready=True, registered=1, expected=1)
    await gateway.monitor.run_once(force=True)
    assert status(worker) is DirectoryStatus.READY
    assert kept() == ["10.0.0.1:30001", "10.0.0.2:30001"]
    assert worker.directory.misses == 0


async def test_health_checks_follow_the_interval_and_thresholds() -> None:
    cluster = Cluster()
    clock = FakeClock()
    health = HealthConfig(interval_secs=60, failure_threshold=3)
    gateway = await make_gateway(cluster, config(health=health), clock=clock)
    decode = gateway.pool.get("10.0.1.1:30011")
    assert decode is not None
    assert decode.health.healthy
    cluster.health["10.0.1.1:30011"] = 500
    checks = len([c for c in cluster.calls if c.path == "/health"])
    await gateway.monitor.run_once()
    assert len([c for c in cluster.calls if c.path == "/health"]) == checks, "not due yet"
    for _ in range(3):
        clock.now += 60
        await gateway.monitor.run_once()
    assert not decode.health.healthy
    assert decode.health.last_error == "HTTP 500"
    assert not decode.eligible


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def condition() -> bool:
        return check()

    return condition


async def test_pools_of_two_models_are_keyed_in_the_index_by_their_own() -> None:
    cluster = Cluster()
    for url, model in zip(PREFILLS, ("model-a", "model-b"), strict=True):
        topic = f"kv@{model}-pod@{model}"
        info = {"served_model_name": model, "kv_events": {"endpoint": "tcp://*:1", "topic": topic}}
        cluster.server_info[url.split("//")[1]] = info
    registrar, lookup = Registrar(), StubLookup()
    cfg = config(model=None, block_size=4)
    gateway = await make_gateway(cluster, cfg, registrar=registrar, lookup=lookup)
    assert {(pod.id, pod.model) for pod in registrar.pods} == {
        ("model-a-pod", "model-a"),
        ("model-b-pod", "model-b"),
    }
    for named in ("model-b", "model-a", "not-served", None):
        parsed = parse_request("completions", {"prompt": [1, 2], "model": named})
        namespace = gateway.router.namespace(parsed.body)
        await gateway.router.look_up(RouteQuery([1, 2], namespace=namespace))
    assert [model for model, _ in lookup.asked] == ["model-b", "model-a", "model-a", "model-a"]


def test_parse_server_info_reads_our_engines_kv_capacity_in_tokens() -> None:
    ranks = [{"dp_rank": 0, "capacity": 100}, {"dp_rank": 1, "capacity": 50}]
    assert parse_server_info({**EMULATOR_INFO, "kv_cache": ranks}, "h").kv_capacity_tokens == 2400
    assert parse_server_info(EMULATOR_INFO, "h").kv_capacity_tokens is None
    for bad in ([{"capacity": "100"}], [{"capacity": 0}], ["x"], [], {"capacity": 5}):
        assert parse_server_info({**EMULATOR_INFO, "kv_cache": bad}, "h").kv_capacity_tokens is None
    # Pages without a page size are no token count.
    assert parse_server_info({"kv_cache": ranks}, "h").kv_capacity_tokens is None
