"""How the compose tests move services onto 127.0.0.1: the rules, on a small file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.stack.compose import Service, load, localize, references, start_order

COMPOSE = """
services:
  db:
    image: redis
    expose: ["6379"]
  api:
    build: .
    command: ["gateway"]
    environment:
      GLOBALKV_GATEWAY_PORT: "30000"
      GLOBALKV_GATEWAY_PREFILL: http://eng:30000 8998,http://eng:30000 none
      GLOBALKV_GATEWAY_REDIS_URL: redis://db:6379/0
      GLOBALKV_GATEWAY_BLOCK_SIZE: "16"
    expose: ["30000"]
    depends_on: {db: {condition: service_healthy}, eng: {condition: service_healthy}}
    healthcheck:
      test: ["CMD", "python", "-m", "x", "http://127.0.0.1:30000/readiness"]
  eng:
    build: .
    command: ["engine"]
    environment:
      GLOBALKV_ENGINE_ADVERTISE_HOST: eng
      GLOBALKV_ENGINE_POD_ID: eng
      GLOBALKV_ENGINE_KV_EVENTS_ENDPOINT: tcp://*:5557
      GLOBALKV_ENGINE_BOOTSTRAP_PORT: "8998"
      GLOBALKV_ENGINE_PORT: "30000"
    expose: ["30000", "8998", "5557"]
"""

PORTS = {
    ("db", 6379): 1001,
    ("api", 30000): 1002,
    ("eng", 30000): 1003,
    ("eng", 8998): 1004,
    ("eng", 5557): 1005,
}


@pytest.fixture
def services(tmp_path: Path) -> dict[str, Service]:
    path = tmp_path / "compose.yml"
    path.write_text(COMPOSE)
    return dict(load(path))


def test_addresses_and_ports_move_consistently(services: dict[str, Service]) -> None:
    env, check = localize(services["api"], services, PORTS)
    assert env["GLOBALKV_GATEWAY_PORT"] == "1002"
    assert env["GLOBALKV_GATEWAY_PREFILL"] == (
        "http://127.0.0.1:1003 1004,http://127.0.0.1:1003 none"
    )
    assert env["GLOBALKV_GATEWAY_REDIS_URL"] == "redis://127.0.0.1:1001/0"
    assert env["GLOBALKV_GATEWAY_BLOCK_SIZE"] == "16"
    assert check == ["python", "-m", "x", "http://127.0.0.1:1002/readiness"]


def test_own_hosts_and_wildcards_keep_their_host(services: dict[str, Service]) -> None:
    env, _ = localize(services["eng"], services, PORTS)
    assert env["GLOBALKV_ENGINE_ADVERTISE_HOST"] == "127.0.0.1"
    assert env["GLOBALKV_ENGINE_POD_ID"] == "eng"
    assert env["GLOBALKV_ENGINE_KV_EVENTS_ENDPOINT"] == "tcp://*:1005"
    assert env["GLOBALKV_ENGINE_BOOTSTRAP_PORT"] == "1004"
    assert env["GLOBALKV_ENGINE_PORT"] == "1003"


def test_references_name_the_service_meant(services: dict[str, Service]) -> None:
    found = {(r.target, r.port) for r in references(services["api"], services)}
    assert found == {("eng", 30000), ("eng", 8998), ("db", 6379), ("api", 30000)}


def test_start_order_follows_depends_on(services: dict[str, Service]) -> None:
    assert start_order(services) == [["db", "eng"], ["api"]]
