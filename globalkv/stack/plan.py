"""What a local cluster is made of: the command line of each part, from its configuration.

Planning is pure: given the configuration and a supply of ports it names every component,
its URL and the exact `globalkv <command> …` arguments it runs with, so the plan can be
checked (`check_plan`, through each command's own `check_config`) before any process
starts, and tested without starting one.

Wiring, all on 127.0.0.1: the indexer binds one SUB socket and every prefill's KV-event
publisher connects to it with the topic `kv@<pod>@<model>` (llm-d's layout: only the
indexer listens, nothing binds a wildcard address), each prefill keeps its replay socket
on a free port it advertises, and the gateway adopts every prefill from its `/server_info`
and registers it as a pod with the index. Flags given in `*_args` come last, so they
override the planned ones.

With several indexers (`indexers`, on Redis only) they share the pods by leases
(`globalkv indexer --replicas`): then each prefill binds its own PUB on a free port, every
indexer can connect to whichever it holds, and nothing binds for the indexers. With
several gateways (`gateways`) each is a full gateway of the same workers, on its own port.

With an admin token, every component that guards state gets it (the indexer's pods, the
gateway's workers and its registrations with the indexer, each prefill's directory)
through its environment, never its command line, which `ps` and `cluster.json` show.
Without one they are in protected mode: changes only from this machine, which is where
they find each other, unless the gateway and the index API listen on a host address of
their own (then the gateway's registrations come from it, and need the token).
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from globalkv.cli import parse
from globalkv.stack.config import LOOPBACK, StackConfig, reachable
from kvplumbing.environment import env_var_name
from kvplumbing.ports import unclaimed_ports

Role = Literal["indexer", "prefill", "decode", "gateway", "epp", "sidecar"]


@dataclass(frozen=True, slots=True)
class Component:
    """One process of the cluster as planned: how it starts and where it answers."""

    name: str
    role: Role
    url: str
    argv: tuple[str, ...]
    """Arguments after `python -m globalkv`."""
    log_path: Path
    bootstrap_url: str | None = None
    """Prefill: its bootstrap directory."""
    pod: str | None = None
    """Prefill: the pod id the index knows it by."""
    events_endpoint: str | None = None
    """Indexer: the SUB socket the prefills publish to."""
    workers: tuple[str, ...] = ()
    """Gateway, picker, sidecar: the URLs of the workers it must list as eligible."""
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    """`GLOBALKV_*` variables of its own: secrets, kept off its command line."""


@dataclass(frozen=True, slots=True)
class Plan:
    components: tuple[Component, ...]

    def by_role(self, role: Role) -> list[Component]:
        return [c for c in self.components if c.role == role]

    def get(self, name: str) -> Component:
        for component in self.components:
            if component.name == name:
                return component
        names = ", ".join(c.name for c in self.components)
        raise KeyError(f"no component {name!r} (components: {names})")

    @property
    def gateway(self) -> Component:
        return self.by_role("gateway")[0]

    @property
    def gateways(self) -> list[Component]:
        return self.by_role("gateway")

    @property
    def indexer(self) -> Component:
        return self.by_role("indexer")[0]


def reserve_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports free now, for the children to bind (`kvplumbing.ports`).

    Another process could still name one before its child binds it; that child then fails
    to start and `LocalCluster.start` reports it with its log.
    """
    return unclaimed_ports(count, host)


def ports_needed(config: StackConfig) -> int:
    """Each indexer's HTTP (and a single one's events), each prefill's HTTP and directory,
    each decode, each gateway (but a first one on a port given); with the envoy entry, each
    decode's sidecar, each picker's HTTP and gRPC, Envoy's admin (and its listener, unless
    given)."""
    indexers = 2 if config.indexers == 1 else config.indexers
    engines = indexers + 2 * config.prefill + config.decode
    if config.entry == "envoy":
        return engines + config.decode + 2 * config.gateways + 1 + (config.gateway_port == 0)
    gateways = config.gateways - (0 if config.gateway_port == 0 else 1)
    return engines + gateways


def _secrets(command: str, config: StackConfig, *flags: str) -> dict[str, str]:
    """The admin token as `command`'s variables for `flags`."""
    token = config.token
    return {} if token is None else {env_var_name(command, flag): token for flag in flags}


def plan_stack(config: StackConfig, ports: Iterator[int], log_dir: Path) -> Plan:
    """Every component with its arguments; takes `ports_needed(config)` ports from `ports`."""
    local = reachable(config.host)
    components = _indexers(config, ports, log_dir)
    events = components[0].events_endpoint or "tcp://*:0"  # replicas: each prefill binds
    components += _engines(config, ports, log_dir, events)
    indexer_url = components[0].url
    if config.entry == "envoy":
        return Plan(
            tuple(components + _envoy_entry(config, ports, log_dir, indexer_url, components))
        )
    for i in range(config.gateways):
        name = "gateway" if config.gateways == 1 else f"gateway-{i}"
        port = config.gateway_port + i if config.gateway_port else next(ports)
        components.append(
            Component(
                name,
                "gateway",
                f"http://{local}:{port}",
                (*_gateway_argv(config, port, indexer_url, components), *config.gateway_args),
                log_dir / f"{name}.log",
                env=_secrets("gateway", config, "--admin-token", "--indexer-token"),
                workers=tuple(c.url for c in components if c.role in ("prefill", "decode")),
            )
        )
    return Plan(tuple(components))


def _envoy_entry(
    config: StackConfig,
    ports: Iterator[int],
    log_dir: Path,
    indexer_url: str,
    engines: Sequence[Component],
) -> list[Component]:
    """A sidecar before each decode, the pickers choosing prefill and sidecar, and Envoy
    (the "gateway": where clients send) calling the pickers, with each response's headers
    too."""
    local = reachable(config.host)
    prefills = [c for c in engines if c.role == "prefill"]
    secrets = _secrets("gateway", config, "--admin-token", "--indexer-token")
    built: list[Component] = []
    for decode in (c for c in engines if c.role == "decode"):
        name, port = decode.name.replace("decode", "sidecar"), next(ports)
        argv = _gateway_argv(config, port, indexer_url, [*prefills, decode], "sidecar")
        built.append(
            Component(
                name,
                "sidecar",
                f"http://{LOOPBACK}:{port}",
                (*argv, *config.gateway_args),
                log_dir / f"{name}.log",
                env={k.replace("GATEWAY", "SIDECAR"): v for k, v in secrets.items()},
                workers=(*(p.url for p in prefills), decode.url),
            )
        )
    sidecars = [replace(s, role="decode") for s in built]
    pickers = []
    for i in range(config.gateways):
        name = "epp" if config.gateways == 1 else f"epp-{i}"
        port, grpc_port = next(ports), next(ports)
        argv = _gateway_argv(config, port, indexer_url, [*prefills, *sidecars], "epp")
        argv += ["--grpc-host", LOOPBACK, "--grpc-port", str(grpc_port)]
        built.append(
            Component(
                name,
                "epp",
                f"http://{local}:{port}",
                (*argv, *config.gateway_args),
                log_dir / f"{name}.log",
                env={k.replace("GATEWAY", "EPP"): v for k, v in secrets.items()},
                workers=(*(p.url for p in prefills), *(s.url for s in sidecars)),
            )
        )
        pickers.append(f"{LOOPBACK}:{grpc_port}")
    port = config.gateway_port or next(ports)
    argv = ["--log-level", config.log_level, "envoy", "--host", config.host]
    argv += ["--port", str(port), "--admin-port", str(next(ports))]
    argv += [a for s in sidecars for a in ("--endpoint", s.url.split("//", 1)[1])]
    argv += [a for p in pickers for a in ("--picker", p)]
    # PD: the response's headers end the prefill's part of a pick's load at the first byte,
    # not at the response's end, so the prefix policy sees the prefills' queues as they are.
    argv += ["--response-headers", "--config-dir", str(log_dir / "envoy")]
    built.append(
        Component("envoy", "gateway", f"http://{local}:{port}", tuple(argv), log_dir / "envoy.log")
    )
    return built


def _indexers(config: StackConfig, ports: Iterator[int], log_dir: Path) -> list[Component]:
    """One indexer binding the SUB every prefill publishes to, or replicas sharing pods."""
    common = ("--log-level", config.log_level)
    local = reachable(config.host)
    components = []
    for i in range(config.indexers):
        name = "indexer" if config.indexers == 1 else f"indexer-{i}"
        port = next(ports)
        argv = [*common, "indexer", "--host", config.host, "--port", str(port)]
        argv += ["--block-size", str(config.block_size), "--tokenizer", config.tokenizer]
        events = None
        if config.indexers == 1:
            events = f"tcp://{LOOPBACK}:{next(ports)}"
            argv += ["--bind", events]
        else:
            argv += ["--replicas", "--indexer-id", name, "--reconcile-interval", "1"]
        if config.redis_url:
            argv += ["--redis-url", config.redis_url]
        if config.insecure and config.token is None:
            argv.append("--insecure")
        components.append(
            Component(
                name,
                "indexer",
                f"http://{local}:{port}",
                (*argv, *config.indexer_args),
                log_dir / f"{name}.log",
                events_endpoint=events,
                env=_secrets("indexer", config, "--admin-token"),
            )
        )
    return components


def _engines(
    config: StackConfig, ports: Iterator[int], log_dir: Path, events: str
) -> list[Component]:
    common = ("--log-level", config.log_level)
    insecure = config.insecure and config.token is None
    engine_common = ["--host", LOOPBACK, "--model", config.model]
    engine_common += ["--page-size", str(config.block_size), "--tokenizer", config.tokenizer]
    engine_common += ["--api", config.engine]
    components = []
    for i in range(config.prefill):
        name, port, bootstrap_port = f"prefill-{i}", next(ports), next(ports)
        argv = [*common, "engine", "--role", "prefill", "--port", str(port), *engine_common]
        argv += ["--pod-id", name, "--bootstrap-port", str(bootstrap_port)]
        argv += ["--kv-events-endpoint", events]
        argv += ["--kv-events-replay-endpoint", f"tcp://{LOOPBACK}:0"]
        if config.engine == "vllm":
            argv += ["--kv-events-format", "vllm"]
        if insecure:
            argv.append("--bootstrap-insecure")
        components.append(
            Component(
                name,
                "prefill",
                f"http://{LOOPBACK}:{port}",
                (*argv, *config.prefill_args),
                log_dir / f"{name}.log",
                bootstrap_url=f"http://{LOOPBACK}:{bootstrap_port}",
                pod=name,
                env=_secrets("engine", config, "--bootstrap-admin-token"),
            )
        )
    for i in range(config.decode):
        name, port = f"decode-{i}", next(ports)
        argv = [*common, "engine", "--role", "decode", "--port", str(port), *engine_common]
        argv += ["--pod-id", name]
        if config.engine == "vllm":  # a vLLM decode keeps a prefix cache: its events too
            argv += ["--decode-kv-events", "--kv-events-endpoint", events]
            argv += ["--kv-events-format", "vllm"]
            argv += ["--kv-events-replay-endpoint", f"tcp://{LOOPBACK}:0"]
        components.append(
            Component(
                name,
                "decode",
                f"http://{LOOPBACK}:{port}",
                (*argv, *config.decode_args),
                log_dir / f"{name}.log",
            )
        )
    return components


def _gateway_argv(
    config: StackConfig,
    port: int,
    indexer_url: str,
    engines: Sequence[Component],
    command: str = "gateway",
) -> list[str]:
    """The arguments of `command` (the gateway, or a picker or sidecar, which take its
    flags) over `engines`."""
    argv = ["--log-level", config.log_level, command, "--pd-disaggregation"]
    host = LOOPBACK if command == "sidecar" else config.host
    argv += ["--host", host, "--port", str(port), "--prometheus-port", "0"]
    vllm = config.engine == "vllm"
    for engine in engines:
        if engine.role == "prefill" and vllm:
            argv += ["--vllm-prefill", engine.url]
        elif engine.role == "prefill":
            assert engine.bootstrap_url is not None
            argv += ["--prefill", engine.url, engine.bootstrap_url.rsplit(":", 1)[1]]
        elif engine.role == "decode":
            argv += ["--vllm-decode" if vllm else "--decode", engine.url]
    if config.redis_url:
        argv += ["--redis-url", config.redis_url, "--block-size", str(config.block_size)]
    else:
        argv += ["--indexer-url", indexer_url]
    argv += ["--model", config.model, "--tokenizer", config.tokenizer]
    interval = str(config.health_check_interval)
    argv += ["--health-check-interval-secs", interval, "--directory-refresh-secs", interval]
    argv += ["--worker-startup-check-interval", "0.25"]
    if config.insecure and config.token is None:
        argv.append("--insecure")
    return argv


def check_plan(plan: Plan) -> None:
    """Run each component's own `check_config` on its arguments; `ValueError` names the
    component and what its command refused. Starts nothing."""
    for component in plan.components:
        try:
            args = _parse_quietly(component.argv, component.env)
            args.check_config(args)
        except ValueError as exc:
            raise ValueError(f"{component.name}: {exc}") from None


def _parse_quietly(argv: Sequence[str], env: Mapping[str, str]) -> argparse.Namespace:
    """The dispatcher's parse with the component's own variables only, with argparse's
    exit turned into `ValueError` carrying its message."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parse(argv, env)
    except SystemExit:
        lines = [line for line in errors.getvalue().splitlines() if line.strip()]
        message = lines[-1].partition(": error: ")[2] or lines[-1] if lines else ""
        raise ValueError(message or "invalid arguments") from None
