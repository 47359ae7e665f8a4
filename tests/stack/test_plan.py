"""Planning a local cluster: names, ports, wiring, pass-through flags, validation."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest

from globalkv.cli import parse
from globalkv.stack.config import StackConfig
from globalkv.stack.plan import (
    Component,
    Plan,
    check_plan,
    plan_stack,
    ports_needed,
    reserve_ports,
)

LOGS = Path("/logs")


def make_plan(**settings: object) -> Plan:
    config = StackConfig.model_validate(settings)
    return plan_stack(config, itertools.count(41000), LOGS)


def flag(component: Component, name: str) -> str:
    argv = list(component.argv)
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]


def test_a_default_cluster_has_every_component_on_distinct_ports() -> None:
    plan = make_plan()
    assert [c.name for c in plan.components] == [
        "indexer",
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
        "gateway",
    ]
    assert [c.role for c in plan.components] == [
        "indexer",
        "prefill",
        "prefill",
        "decode",
        "decode",
        "gateway",
    ]
    urls = [c.url for c in plan.components]
    urls += [c.bootstrap_url for c in plan.components if c.bootstrap_url]
    urls.append(plan.indexer.events_endpoint or "")
    ports = [u.rsplit(":", 1)[1] for u in urls]
    assert len(set(ports)) == len(ports) == ports_needed(StackConfig())
    assert all(c.log_path == LOGS / f"{c.name}.log" for c in plan.components)


def test_prefills_publish_to_the_indexer_socket_as_their_pod() -> None:
    plan = make_plan(prefill=3)
    events = plan.indexer.events_endpoint
    assert flag(plan.indexer, "--bind") == events
    for i, prefill in enumerate(plan.by_role("prefill")):
        assert prefill.pod == f"prefill-{i}"
        assert flag(prefill, "--pod-id") == prefill.pod
        assert flag(prefill, "--kv-events-endpoint") == events
        assert flag(prefill, "--kv-events-replay-endpoint") == "tcp://127.0.0.1:0"
        assert prefill.bootstrap_url == f"http://127.0.0.1:{flag(prefill, '--bootstrap-port')}"


def test_the_gateway_is_told_every_engine_and_the_index() -> None:
    plan = make_plan(decode=3, gateway_port=8000)
    argv = list(plan.gateway.argv)
    pairs = [argv[i + 1 : i + 3] for i, a in enumerate(argv) if a == "--prefill"]
    assert pairs == [
        [p.url, (p.bootstrap_url or "").rsplit(":", 1)[1]] for p in plan.by_role("prefill")
    ]
    decodes = [argv[i + 1] for i, a in enumerate(argv) if a == "--decode"]
    assert decodes == [d.url for d in plan.by_role("decode")]
    assert flag(plan.gateway, "--indexer-url") == plan.indexer.url
    assert plan.gateway.url == "http://127.0.0.1:8000"
    assert "--redis-url" not in argv


def test_with_redis_the_indexer_and_gateway_share_it() -> None:
    plan = make_plan(redis_url="redis://127.0.0.1:7000/0", block_size=32)
    assert flag(plan.indexer, "--redis-url") == "redis://127.0.0.1:7000/0"
    assert flag(plan.gateway, "--redis-url") == "redis://127.0.0.1:7000/0"
    assert flag(plan.gateway, "--block-size") == "32"
    assert "--indexer-url" not in plan.gateway.argv


def test_engines_tokenizer_and_block_size_agree_everywhere() -> None:
    plan = make_plan(tokenizer="/models/tok.json", block_size=64, model="llama")
    for component in plan.components:
        assert flag(component, "--tokenizer") == "/models/tok.json"
        if component.role != "indexer":
            assert flag(component, "--model") == "llama"
    assert flag(plan.indexer, "--block-size") == "64"
    for engine in plan.by_role("prefill") + plan.by_role("decode"):
        assert flag(engine, "--page-size") == "64"


def test_extra_flags_come_last_so_they_win() -> None:
    plan = make_plan(
        prefill_args=["--kv-capacity", "64"],
        decode_args=["--decode-tokens-per-s", "50"],
        gateway_args=["--prefill-policy", "round_robin"],
        indexer_args=["--max-tokens", "1000"],
    )
    assert plan.get("prefill-1").argv[-2:] == ("--kv-capacity", "64")
    assert plan.get("decode-0").argv[-2:] == ("--decode-tokens-per-s", "50")
    assert plan.gateway.argv[-2:] == ("--prefill-policy", "round_robin")
    assert plan.indexer.argv[-2:] == ("--max-tokens", "1000")
    args = parse(plan.gateway.argv, {})
    assert args.prefill_policy == "round_robin"


def test_a_wildcard_host_is_reached_on_loopback() -> None:
    plan = make_plan(host="0.0.0.0")
    assert flag(plan.gateway, "--host") == "0.0.0.0"
    assert plan.gateway.url.startswith("http://127.0.0.1:")
    assert plan.indexer.url.startswith("http://127.0.0.1:")


def test_every_planned_command_passes_its_own_check() -> None:
    check_plan(make_plan(redis_url="redis://127.0.0.1:7000/0"))


def test_the_admin_token_reaches_each_guard_through_its_environment_only() -> None:
    plan = make_plan(admin_token="t0ken")
    assert dict(plan.indexer.env) == {"GLOBALKV_INDEXER_ADMIN_TOKEN": "t0ken"}
    assert dict(plan.gateway.env) == {
        "GLOBALKV_GATEWAY_ADMIN_TOKEN": "t0ken",
        "GLOBALKV_GATEWAY_INDEXER_TOKEN": "t0ken",
    }
    for prefill in plan.by_role("prefill"):
        assert dict(prefill.env) == {"GLOBALKV_ENGINE_BOOTSTRAP_ADMIN_TOKEN": "t0ken"}
    assert all(not c.env for c in plan.by_role("decode"))
    assert all("t0ken" not in c.argv and "t0ken" not in repr(c) for c in plan.components)
    assert "t0ken" not in StackConfig(admin_token="t0ken").model_dump_json()  # cluster.json
    check_plan(plan)
    gateway = parse(plan.gateway.argv, plan.gateway.env)
    described = "\n".join(gateway.check_config(gateway))
    assert "t0ken" not in described
    assert "(with its token)" in described


def test_without_a_token_nothing_is_passed_and_insecure_opens_every_guard() -> None:
    assert all(not c.env for c in make_plan().components)
    assert all("--insecure" not in c.argv for c in make_plan().components)
    plan = make_plan(insecure=True)
    assert "--insecure" in plan.indexer.argv
    assert "--insecure" in plan.gateway.argv
    assert all("--bootstrap-insecure" in c.argv for c in plan.by_role("prefill"))
    check_plan(plan)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"prefill_args": ["--kv-capacity", "0"]}, "prefill-0: kv_capacity"),
        ({"decode_args": ["--no-such-flag"]}, "decode-0: unrecognized arguments: --no-such-flag"),
        ({"gateway_args": ["--prefill-policy", "psychic"]}, "gateway: argument --prefill-policy"),
        ({"indexer_args": ["--pod", "{"]}, "indexer: --pod is not JSON"),
    ],
)
def test_bad_extra_flags_are_refused_naming_the_component(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_plan(make_plan(**settings))


def test_reserved_ports_are_distinct_and_free() -> None:
    ports = reserve_ports(20)
    assert len(set(ports)) == 20
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))
