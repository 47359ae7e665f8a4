"""`doctor`'s walk over a fake cluster (one MockTransport), one broken stage at a time."""

from __future__ import annotations

from typing import Any

import httpx

from globalkv.stack.doctor.diagnose import Doctor, DoctorConfig
from globalkv.stack.doctor.report import Level, Report, Stage, render_text
from tests.stack.fake_cluster import (
    DECODE,
    DIRECTORY,
    GATEWAY,
    INDEXER,
    RANK,
    SETTINGS,
    VLLM_MODEL,
    FakeCluster,
)


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


async def diagnose(
    fake: FakeCluster,
    *,
    gateway: str | None = GATEWAY,
    indexer: str | None = INDEXER,
    api_key: str | None = None,
    admin_token: str | None = None,
    probe: bool = True,
    entry: str | None = None,
) -> Report:
    time = FakeTime()
    settings = DoctorConfig(
        gateway=gateway,
        indexer=indexer,
        api_key=api_key,
        admin_token=admin_token,
        probe=probe,
        entry=entry,
    )
    async with httpx.AsyncClient(transport=fake.transport()) as client:
        doctor = Doctor(
            settings,
            client,
            connect=fake.connect,
            clock=time.clock,
            wall=lambda: 1003.0,
            sleep=time.sleep,
            nonce="n0",
        )
        return await doctor.run()


def findings(stage: Stage) -> dict[str, tuple[Level, str]]:
    return {f.subject: (f.level, f.message) for f in stage.findings}


def levels(report: Report) -> dict[str, Level]:
    return {s.key: s.level for s in report.stages}


async def test_a_healthy_cluster_passes_every_stage() -> None:
    report = await diagnose(FakeCluster())
    assert report.healthy
    assert report.exit_status == 0
    assert set(levels(report).values()) == {Level.OK}
    probe = findings(report.stage("probe"))
    assert list(probe)[:5] == ["register", "resolve", "connect", "verify-room", "consume"]
    assert probe["register"] == (Level.OK, "1.5 ms")
    assert probe["resolve"] == (Level.OK, "0.5 ms")
    assert probe["verify-room"] == (Level.OK, "10.1 ms")
    index = findings(report.stage("index"))
    assert index["pod p0 (m)"][1].startswith("dp0: seq 2 3.0s ago, 3 batches, 0 resets")
    assert index["probe blocks"][0] is Level.OK
    routing = findings(report.stage("routing"))
    assert routing["probe routing"][0] is Level.OK
    assert routing["repeated probe"][0] is Level.OK
    assert routing["index lookups"][0] is Level.OK
    assert routing["gateway index"] == (Level.OK, f"the indexer at {INDEXER}")
    assert routing["gateway tokenizer"] == (Level.OK, "byte")
    assert routing["gateway model"] == (Level.OK, "lookups keyed by m")
    assert render_text(report).startswith("globalkv doctor: healthy\n")


async def test_a_dead_decode_fails_the_pools_even_while_the_gateway_trusts_it() -> None:
    report = await diagnose(FakeCluster(dead={DECODE}))
    assert report.exit_status == 1
    assert report.first_failure is report.stage("gateway")
    level, message = findings(report.stage("gateway"))["decode d0.test:30000"]
    assert level is Level.FAIL
    assert "/health unreachable (ConnectError" in message
    assert "gateway sees it healthy" in message
    text = render_text(report)
    assert text.startswith(
        "globalkv doctor: PROBLEM at stage 'gateway worker pools': decode d0.test:30000"
    )
    assert text.index("[✗] gateway worker pools") < text.index("[✓] probe request")


async def test_a_pool_without_eligible_workers_fails() -> None:
    report = await diagnose(FakeCluster(decode_eligible=False))
    level, message = findings(report.stage("gateway"))["decode pool"]
    assert level is Level.FAIL
    assert "none of 1 eligible" in message


async def test_a_worker_s_last_error_warns_while_recent_and_is_shown_after() -> None:
    error = "decode call answered HTTP 503"
    recent = await diagnose(FakeCluster(decode_last_error=(error, 12.0)))
    level, message = findings(recent.stage("gateway"))["decode d0.test:30000"]
    assert (level, message.endswith(f"; last error (12s ago): {error}")) == (Level.WARN, True)
    assert recent.healthy
    old = await diagnose(FakeCluster(decode_last_error=(error, 4000.0)))
    level, message = findings(old.stage("gateway"))["decode d0.test:30000"]
    assert (level, f"last error (4000s ago): {error}" in message) == (Level.OK, True)


async def test_a_decode_that_advertises_nothing_is_no_warning() -> None:
    """vLLM's decodes and a picker's sidecars serve no /server_info: nothing to discover,
    and a decode needs nothing discovered. The doctor reads the gateway's state of the
    worker (its discovery over, its last error that step's), not the error's wording. One
    the gateway asks again is a warning."""
    silent = "the engine's answer, in words the doctor does not know"

    async def decode_finding(**decode: Any) -> tuple[Level, str]:
        report = await diagnose(FakeCluster(decode_last_error=(silent, 3.0), **decode))
        return findings(report.stage("gateway"))["decode d0.test:30000"]

    level, message = await decode_finding(decode_error_step="discovery")
    assert level is Level.OK
    assert message.endswith("; nothing discovered: a decode needs nothing advertised")
    asked_again = await decode_finding(decode_error_step="discovery", decode_discovered=False)
    assert asked_again[0] is Level.WARN
    assert (await decode_finding())[0] is Level.WARN, "a failed call"


async def test_behind_envoy_the_probe_enters_where_clients_do() -> None:
    """The picker (as --gateway) is read; the probe goes to --entry, here down."""
    envoy = "http://envoy.test:8000"
    fake = FakeCluster(dead={envoy})
    report = await diagnose(fake, entry=envoy)
    assert report.stage("gateway").level is Level.OK
    level, message = findings(report.stage("probe"))["gateway"]
    assert level is Level.FAIL
    assert message.startswith("POST /generate unreachable")
    assert f"POST {envoy}/generate" in fake.seen
    assert fake.probes == 0


async def test_an_incomplete_directory_names_its_missing_ranks() -> None:
    report = await diagnose(FakeCluster(directory_ready=False))
    level, message = findings(report.stage("directories"))["prefill p0.test:30000 (pod p0)"]
    assert level is Level.FAIL
    assert f"directory {DIRECTORY} not ready: 0/1 ranks registered" in message
    assert "missing dp0 cp0 tp0 pp0" in message


async def test_an_unreachable_rank_address_fails_its_directory() -> None:
    report = await diagnose(FakeCluster(unreachable_ranks={RANK}))
    assert report.first_failure is report.stage("directories")
    level, message = findings(report.stage("directories"))["prefill p0.test:30000 (pod p0)"]
    assert level is Level.FAIL
    assert "1 of 1 ranks fail: dp0 cp0 tp0 pp0 at 10.0.0.1:40000 unreachable" in message


async def test_a_probe_failure_names_its_stage_and_what_was_not_reached() -> None:
    fake = FakeCluster(probe_error=(500, "room", "bootstrap_room mismatch"))
    report = await diagnose(fake)
    assert report.first_failure is report.stage("probe")
    probe = findings(report.stage("probe"))
    assert [probe[s][0] for s in ("register", "resolve", "connect")] == [Level.OK] * 3
    assert probe["verify-room"] == (Level.FAIL, "HTTP 500 (room): bootstrap_room mismatch")
    assert probe["consume"] == (Level.SKIP, "not reached")
    assert report.stage("routing").findings[-1].level is Level.SKIP


async def test_a_failure_before_the_pd_path_is_the_request_s() -> None:
    report = await diagnose(FakeCluster(probe_error=(503, None, "no decode worker")))
    assert findings(report.stage("probe"))["request"] == (
        Level.FAIL,
        "HTTP 503: no decode worker",
    )


async def test_an_index_the_gateway_cannot_reach_fails_routing() -> None:
    report = await diagnose(FakeCluster(fallback="index_unavailable"))
    level, message = findings(report.stage("routing"))["probe routing"]
    assert level is Level.FAIL
    assert "fell back to load (index_unavailable)" in message


async def test_a_gateway_without_tokenizer_is_a_warning() -> None:
    report = await diagnose(FakeCluster(fallback="no_tokenizer", cached_on_repeat=False))
    routing = findings(report.stage("routing"))
    assert routing["probe routing"][0] is Level.WARN
    assert "--tokenizer" in routing["probe routing"][1]
    assert routing["repeated probe"][0] is Level.WARN
    assert report.healthy


async def test_the_gateway_s_settings_are_judged_without_a_probe() -> None:
    bare = {"index": None, "tokenizer": None, "tokenizer_loaded": False, "model_in_use": None}
    report = await diagnose(FakeCluster(settings=bare), probe=False)
    routing = findings(report.stage("routing"))
    assert routing["gateway index"][0] is Level.WARN
    assert "routed by load (start it with --tokenizer)" in routing["gateway tokenizer"][1]
    assert routing["gateway model"][0] is Level.WARN
    other = {**SETTINGS, "indexer_url": "http://other:8100"}
    routing = findings((await diagnose(FakeCluster(settings=other))).stage("routing"))
    assert routing["gateway index"] == (
        Level.WARN,
        f"it asks the indexer at http://other:8100, not {INDEXER}",
    )


async def test_a_gateway_without_v1_config_is_judged_by_its_counters() -> None:
    report = await diagnose(FakeCluster(settings=None))
    routing = findings(report.stage("routing"))
    assert routing["gateway settings"][0] is Level.SKIP
    assert routing["probe routing"][0] is Level.OK
    assert report.healthy


async def test_events_that_never_reach_the_index_fail_freshness() -> None:
    report = await diagnose(FakeCluster(events_flow=False))
    level, message = findings(report.stage("index"))["probe blocks"]
    assert level is Level.FAIL
    assert "within 5s" in message


async def test_a_repeat_that_misses_the_cache_under_the_prefix_policy_fails() -> None:
    report = await diagnose(FakeCluster(cached_on_repeat=False))
    level, message = findings(report.stage("routing"))["repeated probe"]
    assert level is Level.FAIL
    assert "routing did not follow the cache" in message


async def test_another_prefill_policy_is_only_a_warning() -> None:
    report = await diagnose(FakeCluster(policy="round_robin", cached_on_repeat=False))
    routing = findings(report.stage("routing"))
    assert routing["probe routing"] == (
        Level.WARN,
        "prefill policy is round_robin: the index is not consulted",
    )
    assert routing["gateway prefill policy"] == (
        Level.WARN,
        "round_robin: the index is not consulted",
    )
    assert routing["repeated probe"][0] is Level.WARN
    assert report.healthy


async def test_retries_during_the_probe_are_shown() -> None:
    report = await diagnose(FakeCluster(retries_per_probe=2))
    level, message = findings(report.stage("probe"))["retries"]
    assert level is Level.WARN
    assert "2 after a decode failure" in message


async def test_index_problems_fail_the_index_stage() -> None:
    resyncing = await diagnose(FakeCluster(index_status=503))
    assert findings(resyncing.stage("index"))["indexer"][0] is Level.FAIL
    unsubscribed = await diagnose(FakeCluster(subscribed=False))
    assert findings(unsubscribed.stage("index"))["pod p0 (m)"] == (
        Level.FAIL,
        "not subscribed to its KV events: its cache is invisible",
    )
    repaired = await diagnose(FakeCluster(resets=2))
    level, message = findings(repaired.stage("index"))["pod p0 (m)"]
    assert level is Level.WARN
    assert "2 resets" in message


async def test_an_indexer_without_tokenizer_takes_token_ids_only() -> None:
    report = await diagnose(FakeCluster(index_tokenizer=False))
    level, message = findings(report.stage("routing"))["index tokenizer"]
    assert level is Level.OK
    assert message.startswith("none: the index API takes token_ids only")


async def test_with_only_the_indexer_prefills_come_from_its_pods() -> None:
    fake = FakeCluster()
    report = await diagnose(fake, gateway=None)
    assert levels(report)["gateway"] is Level.SKIP
    assert levels(report)["probe"] is Level.SKIP
    assert findings(report.stage("directories"))["pod p0"][0] is Level.OK
    assert not [s for s in fake.seen if GATEWAY in s]
    assert report.healthy


async def test_with_only_the_gateway_the_index_stage_is_skipped() -> None:
    fake = FakeCluster()
    report = await diagnose(fake, indexer=None)
    assert levels(report)["index"] is Level.SKIP
    assert levels(report)["probe"] is Level.OK
    assert not [s for s in fake.seen if INDEXER in s]


async def test_an_unreachable_gateway_fails_first_and_the_probe_too() -> None:
    report = await diagnose(FakeCluster(dead={GATEWAY}))
    assert report.first_failure is report.stage("gateway")
    assert findings(report.stage("probe"))["gateway"][0] is Level.FAIL
    # The prefills are still found, through the pods the index follows.
    assert findings(report.stage("directories"))["pod p0"][0] is Level.OK


async def test_the_admin_token_reads_a_gateway_that_has_one_and_the_index_s_lookups() -> None:
    fake = FakeCluster(gateway_token="t0ken")
    report = await diagnose(fake, admin_token="t0ken")
    assert report.healthy
    assert fake.authorized == {GATEWAY, INDEXER}


async def test_a_gateway_that_needs_a_token_is_reported_with_the_flags_to_give() -> None:
    report = await diagnose(FakeCluster(gateway_token="t0ken"))
    level, message = findings(report.stage("gateway"))["gateway"]
    assert level is Level.FAIL
    assert "answered HTTP 401" in message
    assert "--admin-token / GLOBALKV_DOCTOR_ADMIN_TOKEN" in message


async def test_the_api_key_goes_to_the_gateway_only() -> None:
    fake = FakeCluster()
    report = await diagnose(fake, api_key="secret")
    assert report.healthy
    assert fake.authorized == {GATEWAY}


async def test_a_gateway_with_an_sglang_and_a_vllm_pool_is_probed_in_each() -> None:
    fake = FakeCluster(vllm_pool=True)
    report = await diagnose(fake)
    assert fake.probes == 2  # /generate, then again
    assert [body.get("model") for body in fake.completions] == [VLLM_MODEL, VLLM_MODEL]
    probe = findings(report.stage("probe"))
    assert probe["SGLang pool: answer"][0] is Level.OK
    assert probe["vLLM pool: answer"][0] is Level.OK
    routing = findings(report.stage("routing"))
    assert routing["SGLang pool: repeated probe"][0] is Level.OK
    assert routing["vLLM pool: repeated probe"][0] is Level.OK
    assert report.healthy


async def test_a_gateway_with_one_pool_keeps_unlabelled_findings() -> None:
    report = await diagnose(FakeCluster())
    assert "answer" in findings(report.stage("probe"))
