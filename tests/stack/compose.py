"""docker-compose.yml as the compose tests read it, and its services moved onto 127.0.0.1.

Localizing a service keeps its configuration path (the same `GLOBALKV_<COMMAND>_<FLAG>`
variables, the same command, the same health check) and changes only addresses: every
service host name becomes 127.0.0.1 and every (service, port) pair one free local port,
consistently for the service itself and for everyone who refers to it. The rules:

- `host:port` with `host` a service → 127.0.0.1 and that service's local port;
- `host:port` with `host` one of 127.0.0.1, localhost, *, 0.0.0.0 → the service's own port;
- a bare port number right after such an address (sglang-router's `--prefill URL PORT`)
  → a port of the same service; a bare number alone that the service exposes → its own;
- a `*_HOST` variable naming a service (an advertised host) → 127.0.0.1.

Values are read as compose reads them: `${VAR:-default}` is the variable when it is set
and not empty (in the mapping `load` is given), else the default.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
LOCAL = "127.0.0.1"
SELF_HOSTS = {"127.0.0.1", "localhost", "*", "0.0.0.0"}
ADDRESS = re.compile(r"(?:(?P<scheme>[a-z]+)://)?(?P<host>[A-Za-z0-9*._-]+):(?P<port>\d{1,5})")
_SEPARATORS = re.compile(r"([\s,]+)")


@dataclass
class Service:
    name: str
    raw: dict[str, Any]
    command: list[str]
    environment: dict[str, str]
    expose: list[int]
    published: list[tuple[int, int]]
    """(host port, container port)."""
    depends_on: dict[str, str]
    """Service → condition."""
    healthcheck: list[str] | None
    """The check's argv (after "CMD")."""
    is_globalkv: bool = field(default=False)


_DEFAULTED = re.compile(r"\$\{([A-Z0-9_]+):-([^}]*)\}")


def interpolate(text: str, environ: Mapping[str, str]) -> str:
    """`${VAR:-default}` as compose reads it: the variable when set and not empty."""
    return _DEFAULTED.sub(lambda m: environ.get(m[1]) or m[2], text)


def _published(entry: object) -> tuple[int, int]:
    """`HOST:CONTAINER`, a `${VAR:-default}` read at its default."""
    host, _, container = interpolate(str(entry), {}).rpartition(":")
    return int(host), int(container)


def _depends(raw: object) -> dict[str, str]:
    if isinstance(raw, list):
        return {str(name): "service_started" for name in raw}
    if isinstance(raw, dict):
        return {
            str(name): str((spec or {}).get("condition", "service_started"))
            for name, spec in raw.items()
        }
    return {}


def load(path: Path = COMPOSE_FILE, environ: Mapping[str, str] | None = None) -> dict[str, Service]:
    """The services, their `${VAR:-default}` values read from `environ` (none: defaults)."""
    variables = environ or {}
    document = yaml.safe_load(path.read_text())
    services = {}
    for name, raw in document["services"].items():
        check = (raw.get("healthcheck") or {}).get("test")
        services[name] = Service(
            name=name,
            raw=raw,
            command=[str(a) for a in raw.get("command", [])],
            environment={
                k: interpolate(str(v), variables) for k, v in (raw.get("environment") or {}).items()
            },
            expose=[int(p) for p in raw.get("expose", [])],
            published=[_published(p) for p in raw.get("ports", [])],
            depends_on=_depends(raw.get("depends_on")),
            healthcheck=[str(a) for a in check[1:]] if check and check[0] == "CMD" else None,
            is_globalkv="build" in raw,
        )
    return services


@dataclass(frozen=True)
class Reference:
    """One address a service's configuration mentions: `target` is the service meant."""

    source: str
    where: str
    target: str
    port: int
    text: str


def _tokens(value: str) -> list[str]:
    return _SEPARATORS.split(value)


def references(service: Service, services: Mapping[str, Service]) -> Iterator[Reference]:
    """Every (service, port) that `service`'s environment and health check point at; an
    address whose host is neither a service nor this one's own names `target` = that host."""
    places = [(f"environment {k}", v) for k, v in service.environment.items()]
    places += [("healthcheck", arg) for arg in service.healthcheck or []]
    for where, value in places:
        last: str | None = None
        for token in _tokens(value):
            match = ADDRESS.search(token)
            if match is not None:
                host = match["host"]
                last = service.name if host in SELF_HOSTS else host
                yield Reference(service.name, where, last, int(match["port"]), token)
                continue
            if token.isdigit() and last is not None:
                yield Reference(service.name, where, last, int(token), token)
            elif token.strip(" ,"):
                last = None


def localize(
    service: Service, services: Mapping[str, Service], ports: Mapping[tuple[str, int], int]
) -> tuple[dict[str, str], list[str] | None]:
    """The service's environment and health check with local addresses (module docstring)."""

    def value(key: str, text: str) -> str:
        if key.endswith("_HOST") and text in services:
            return LOCAL
        out: list[str] = []
        last: str | None = None
        for token in _tokens(text):
            match = ADDRESS.search(token)
            if match is not None and (match["host"] in services or match["host"] in SELF_HOSTS):
                host = match["host"]
                target = host if host in services else service.name
                local_port = ports[(target, int(match["port"]))]
                shown_host = LOCAL if host in services else host
                replaced = f"{shown_host}:{local_port}"
                out.append(token[: match.start("host")] + replaced + token[match.end("port") :])
                last = target
            elif token.isdigit() and last is not None:
                out.append(str(ports[(last, int(token))]))
            elif token.isdigit() and (service.name, int(token)) in ports:
                out.append(str(ports[(service.name, int(token))]))
            else:
                out.append(token)
                if token.strip(" ,"):
                    last = None
        return "".join(out)

    environment = {k: value(k, v) for k, v in service.environment.items()}
    check = None if service.healthcheck is None else [value("", a) for a in service.healthcheck]
    return environment, check


def start_order(services: Mapping[str, Service]) -> list[list[str]]:
    """Services in waves: each wave depends only on earlier ones (ValueError on a cycle)."""
    done: set[str] = set()
    waves: list[list[str]] = []
    while len(done) < len(services):
        wave = sorted(
            name for name, s in services.items() if name not in done and set(s.depends_on) <= done
        )
        if not wave:
            raise ValueError(f"depends_on cycle among {sorted(set(services) - done)}")
        waves.append(wave)
        done.update(wave)
    return waves
