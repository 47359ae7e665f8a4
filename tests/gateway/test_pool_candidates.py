"""The pool keeps the eligible workers between requests: every change of what they were
read from renews them, at once; a policy that reads load gets the loads of now."""

from __future__ import annotations

from gateway.load.tracker import LoadTracker
from gateway.settings.workers import BreakerConfig, HealthConfig, WorkerSpec
from gateway.workers.pool import WorkerPool
from tests.support.clock import FakeClock

PREFILLS = ("http://10.0.0.1:30001", "http://10.0.0.2:30001")


def _pool(clock: FakeClock) -> WorkerPool:
    breaker = BreakerConfig(failure_threshold=1, success_threshold=1, timeout_duration_secs=5)
    pool = WorkerPool(breaker, HealthConfig(failure_threshold=1, success_threshold=1), clock)
    for url in PREFILLS:
        pool.add(WorkerSpec(url=url, role="prefill", bootstrap_port=8998)).health.record(True)
    return pool


def _ready(clock: FakeClock) -> WorkerPool:
    """`_pool` with both prefills' directories read ready."""
    pool = _pool(clock)
    for worker in pool:
        worker.directory.status = worker.directory.status.READY
    pool.changed()
    return pool


def _bare(pool: WorkerPool) -> list[str]:
    return [c.worker for c in pool.candidates("prefill", None)]


def test_kept_between_requests_until_a_worker_comes_or_goes() -> None:
    pool = _ready(FakeClock(0.0))
    first = pool.candidates("prefill", None)
    assert pool.candidates("prefill", None) is first
    assert _bare(pool) == ["10.0.0.1:30001", "10.0.0.2:30001"]
    third = pool.add(WorkerSpec(url="http://10.0.0.3:30001", role="prefill"))
    third.health.record(True)
    third.directory.status = third.directory.status.UNKNOWN
    pool.changed()
    assert _bare(pool) == ["10.0.0.1:30001", "10.0.0.2:30001", "10.0.0.3:30001"]
    pool.remove("10.0.0.1:30001")
    assert _bare(pool) == ["10.0.0.2:30001", "10.0.0.3:30001"]
    decode = pool.add(WorkerSpec(url="http://10.0.0.4:30001", role="decode"))
    assert [c.worker for c in pool.candidates("decode", None)] == []
    decode.health.record(True)
    assert [c.worker for c in pool.candidates("decode", None)] == ["10.0.0.4:30001"]


def test_a_worker_turning_unhealthy_or_healthy_again_is_seen_at_once() -> None:
    pool = _ready(FakeClock(0.0))
    assert _bare(pool) == ["10.0.0.1:30001", "10.0.0.2:30001"]
    first = pool.get("10.0.0.1:30001")
    assert first is not None
    first.health.record(False, "refused")
    assert _bare(pool) == ["10.0.0.2:30001"]
    first.health.record(True)
    assert _bare(pool) == ["10.0.0.1:30001", "10.0.0.2:30001"]


def test_an_open_circuit_is_out_at_once_and_back_by_the_clock_alone() -> None:
    clock = FakeClock(0.0)
    pool = _ready(clock)
    assert _bare(pool) == ["10.0.0.1:30001", "10.0.0.2:30001"]
    first = pool.get("10.0.0.1:30001")
    assert first is not None
    first.breaker.record(False, "HTTP 500")
    assert _bare(pool) == ["10.0.0.2:30001"]
    clock.now = 4.9
    assert _bare(pool) == ["10.0.0.2:30001"]
    clock.now = 5.0  # half-open: nothing but the clock changed
    assert _bare(pool) == ["10.0.0.1:30001", "10.0.0.2:30001"]
    first.breaker.record(False, "HTTP 500")  # failed on trial: open again
    assert _bare(pool) == ["10.0.0.2:30001"]


def test_what_the_monitor_changes_renews_them_through_changed() -> None:
    pool = _pool(FakeClock(0.0))
    assert _bare(pool) == [], "a directory not read yet takes no traffic"
    first = pool.get("10.0.0.1:30001")
    assert first is not None
    first.directory.status = first.directory.status.READY
    pool.changed()
    assert _bare(pool) == ["10.0.0.1:30001"]
    first.kv_capacity_tokens = 4096
    pool.changed()
    (candidate,) = pool.candidates("prefill", None)
    assert candidate.cache_capacity_tokens == 4096


def test_a_client_naming_new_models_keeps_a_bounded_number_of_lists() -> None:
    """The model is the client's to name: lists kept per model must not grow with them."""
    pool = _ready(FakeClock(0.0))
    for i in range(200):
        named = [c.worker for c in pool.candidates("prefill", None, model=f"m-{i}")]
        assert named == ["10.0.0.1:30001", "10.0.0.2:30001"]
    assert 0 < len(pool._bare) <= 16


def test_a_policy_reading_load_gets_the_kept_workers_with_their_load_of_now() -> None:
    clock = FakeClock(0.0)
    pool = _pool(clock)
    for worker in pool:
        worker.directory.status = worker.directory.status.READY
        worker.kv_capacity_tokens = 1024
    pool.changed()
    loads = LoadTracker(clock=clock)

    def loaded() -> list[tuple[str, str, int, int | None]]:
        return [
            (c.worker, c.pod, c.in_flight, c.cache_capacity_tokens)
            for c in pool.candidates("prefill", loads)
        ]

    assert loaded() == [
        ("10.0.0.1:30001", "10.0.0.1:30001", 0, 1024),
        ("10.0.0.2:30001", "10.0.0.2:30001", 0, 1024),
    ]
    loads.start_decode("10.0.0.2:30001")
    assert loaded()[1] == ("10.0.0.2:30001", "10.0.0.2:30001", 1, 1024)
    first = pool.get("10.0.0.1:30001")
    assert first is not None
    first.breaker.record(False, "HTTP 500")
    assert [w for w, *_ in loaded()] == ["10.0.0.2:30001"]
