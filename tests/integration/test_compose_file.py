"""docker-compose.yml, checked without Docker: commands, host names, ports, dependencies.

Every globalkv service's command is validated by the CLI itself (`globalkv --check
<command>` with the service's environment, nothing started); every address in any
service's configuration names a service, on a port that service exposes; published ports
are exposed ones; health checks and `depends_on` conditions are consistent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvplumbing.auth import PUBLISHED_DEFAULT_TOKEN
from tests.stack.compose import ROOT, Service, load, references, start_order

SERVICES = load()
GLOBALKV = sorted(name for name, s in SERVICES.items() if s.is_globalkv)
EXPECTED = {"redis", "indexer", "prefill-0", "prefill-1", "decode-0", "decode-1", "gateway"}


def _check(service: Service) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLOBALKV_")}
    env.update(service.environment)
    return subprocess.run(
        [sys.executable, "-m", "globalkv", "--check", *service.command],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_stack_has_every_role() -> None:
    assert set(SERVICES) == EXPECTED


def test_every_globalkv_command_is_valid_with_its_environment() -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = pool.map(_check, (SERVICES[n] for n in GLOBALKV))
        results = dict(zip(GLOBALKV, outcomes, strict=True))
    for name, result in results.items():
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
        assert "configuration ok" in result.stdout, name


def test_a_wrong_variable_makes_the_check_fail() -> None:
    """The check above can fail: a bad value in the same configuration path is refused."""
    broken = SERVICES["prefill-0"]
    broken = Service(**{**broken.__dict__, "environment": dict(broken.environment)})
    broken.environment["GLOBALKV_ENGINE_PAGE_SIZE"] = "0"
    result = _check(broken)
    assert result.returncode == 2
    assert "page_size" in result.stderr


GUESTS = {"gateway": "doctor"}
"""Commands the docs run in a service's container (`docker compose run gateway doctor`)."""


def test_every_globalkv_variable_names_its_own_command() -> None:
    for name in GLOBALKV:
        service = SERVICES[name]
        commands = [service.command[0], *([GUESTS[name]] if name in GUESTS else [])]
        prefixes = tuple(f"GLOBALKV_{command.upper()}_" for command in commands)
        strays = [k for k in service.environment if not k.startswith(prefixes)]
        assert not strays, f"{name} sets variables its command never reads: {strays}"


GUARDS = {
    "indexer": "GLOBALKV_INDEXER_ADMIN_TOKEN",
    "prefill-0": "GLOBALKV_ENGINE_BOOTSTRAP_ADMIN_TOKEN",
    "prefill-1": "GLOBALKV_ENGINE_BOOTSTRAP_ADMIN_TOKEN",
    "gateway": "GLOBALKV_GATEWAY_ADMIN_TOKEN",
}


def test_every_guard_takes_the_token_from_one_variable_else_the_default() -> None:
    """In containers no client is on loopback: without the token nobody could change the
    pods, the workers or a directory. The default is the one every component warns about."""
    for name, variable in GUARDS.items():
        assert SERVICES[name].environment[variable] == PUBLISHED_DEFAULT_TOKEN, name
    assert SERVICES["gateway"].environment["GLOBALKV_DOCTOR_ADMIN_TOKEN"] == (
        PUBLISHED_DEFAULT_TOKEN
    )
    chosen = load(environ={"GLOBALKV_ADMIN_TOKEN": "from-dot-env"})
    for name, variable in GUARDS.items():
        assert chosen[name].environment[variable] == "from-dot-env", name
    assert "GLOBALKV_ADMIN_TOKEN=" in (ROOT / ".env.example").read_text()


def test_every_address_names_a_service_on_a_port_it_exposes() -> None:
    found = [r for s in SERVICES.values() for r in references(s, SERVICES)]
    assert {r.target for r in found} >= {"redis", "prefill-0", "prefill-1", "decode-0"}
    for ref in found:
        assert ref.target in SERVICES, f"{ref.source} {ref.where}: {ref.text} is not a service"
        exposed = SERVICES[ref.target].expose
        assert ref.port in exposed, (
            f"{ref.source} {ref.where} points at {ref.target}:{ref.port} ({ref.text}), "
            f"but {ref.target} exposes {exposed}"
        )


def test_host_names_given_alone_are_the_service_itself() -> None:
    """An advertised host must resolve to the service advertising it."""
    for service in SERVICES.values():
        for key, value in service.environment.items():
            if value in SERVICES:
                assert value == service.name, f"{service.name} {key}={value}"


def test_the_gateway_is_told_every_engine() -> None:
    env = SERVICES["gateway"].environment
    prefills = {r.target for r in references(SERVICES["gateway"], SERVICES) if "PREFILL" in r.where}
    decodes = {r.target for r in references(SERVICES["gateway"], SERVICES) if "DECODE" in r.where}
    assert prefills == {"prefill-0", "prefill-1"}
    assert decodes == {"decode-0", "decode-1"}
    assert (
        env["GLOBALKV_GATEWAY_REDIS_URL"]
        == SERVICES["indexer"].environment["GLOBALKV_INDEXER_REDIS_URL"]
    )
    assert (
        env["GLOBALKV_GATEWAY_BLOCK_SIZE"]
        == SERVICES["indexer"].environment["GLOBALKV_INDEXER_BLOCK_SIZE"]
    )


def test_published_ports_are_exposed_and_cover_gateway_index_and_metrics() -> None:
    published = {}
    for service in SERVICES.values():
        for host, container in service.published:
            assert container in service.expose, f"{service.name} publishes {container}"
            published[host] = (service.name, container)
    assert published[8000] == ("gateway", 30000)
    assert published[8100] == ("indexer", 8100)
    metrics_port = int(SERVICES["gateway"].environment["GLOBALKV_GATEWAY_PROMETHEUS_PORT"])
    assert published[29000] == ("gateway", metrics_port)


def test_dependencies_exist_are_acyclic_and_wait_for_health() -> None:
    for service in SERVICES.values():
        for target, condition in service.depends_on.items():
            assert target in SERVICES, f"{service.name} depends on unknown {target}"
            assert condition == "service_healthy", f"{service.name} → {target}: {condition}"
            assert SERVICES[target].raw.get("healthcheck"), f"{target} has no health check"
    waves = start_order(SERVICES)
    assert waves[0] == ["decode-0", "decode-1", "prefill-0", "prefill-1", "redis"]
    assert waves[-1] == ["gateway"]
    assert set(SERVICES["gateway"].depends_on) == EXPECTED - {"gateway"}


@pytest.mark.parametrize("name", GLOBALKV)
def test_globalkv_services_share_one_image_with_health_checks(name: str) -> None:
    service = SERVICES[name]
    assert service.raw["build"] == "."
    assert service.raw["image"] == "globalkv:local"
    assert service.healthcheck is not None
    assert service.healthcheck[:3] == ["python", "-m", "globalkv.stack.healthcheck"]
