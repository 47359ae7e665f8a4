"""Each command's flags against the typed model they fill: they cannot disagree.

For every command: each field of its model has a flag or is listed here as deliberately
flagless (with how it is set instead), and no flags at all give the model's defaults. The
gateway's own check, against the table its flags are derived from, is in
tests/gateway/standalone/test_cli.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from bootstrap.cli import config_from_args as bootstrap_config
from bootstrap.server import BootstrapConfig
from enginesim.cli import _GROUPS as ENGINE_GROUPS
from enginesim.cli import config_from_args as engine_config
from enginesim.config import EngineConfig
from globalkv.api import ApiConfig
from globalkv.cli import parse
from globalkv.commands.indexer import config_from_args as indexer_config
from globalkv.indexer import IndexerConfig
from globalkv.ingest.config import IngestConfig
from globalkv.stack.config import StackConfig
from globalkv.stack.up import config_from_args as up_config

_NESTED = "its own flags"


def _dests(command: str) -> dict[str, Any]:
    return vars(parse([command], {}))


def _covered(model: type[BaseModel], flagged: set[str], flagless: dict[str, str]) -> None:
    assert not flagged & set(flagless), f"{model.__name__}: listed both ways"
    missing = set(model.model_fields) - flagged - set(flagless)
    assert not missing, f"{model.__name__}: fields with no flag, not listed as flagless"


def test_bootstrap_flags_are_the_config_fields() -> None:
    dests = _dests("bootstrap")
    _covered(BootstrapConfig, set(BootstrapConfig.model_fields) & set(dests), {})
    assert bootstrap_config(parse(["bootstrap"], {})) == BootstrapConfig()


INDEXER_FLAGLESS = {
    "pods": "--pod JSON (repeatable) and --pods-file PATH",
    "api": _NESTED,
    "ingest": _NESTED,
}
INGEST_FLAGLESS = {
    "max_group": "a tuning of the ingest workers, set in code",
    "rcvhwm": "a tuning of the ingest workers, set in code",
    "max_message_bytes": "a protocol bound, set in code",
    "max_discovered_pods": "a bound on pods that appear by themselves, set in code",
    "max_discovered_sources": "a bound on their DP ranks, set in code",
    "replay_reply_timeout": "a protocol timeout, set in code",
    "replay_total_timeout": "a protocol timeout, set in code",
    "retry_base": "the ingest workers' backoff, set in code",
    "retry_cap": "the ingest workers' backoff, set in code",
}


@pytest.mark.parametrize(
    ("model", "flagless"),
    [(IndexerConfig, INDEXER_FLAGLESS), (ApiConfig, {}), (IngestConfig, INGEST_FLAGLESS)],
)
def test_indexer_flags_cover_the_config_fields(
    model: type[BaseModel], flagless: dict[str, str]
) -> None:
    _covered(model, set(model.model_fields) & set(_dests("indexer")), flagless)


def test_indexer_without_flags_has_the_config_defaults() -> None:
    assert indexer_config(parse(["indexer"], {})) == IndexerConfig()


UP_FLAGS = {"gateway_port": "port", "log_level": "log_level"}
"""Fields whose flag is named otherwise (`--port`; the dispatcher's own `--log-level`)."""
UP_FLAGLESS = {"stop_timeout": "fixed: what most supervisors allow before SIGKILL"}
UP_DEFAULTS_DIFFER = {"gateway_port": (8000, 0)}
"""`globalkv up --port` is the documented 8000 a person curls; the model's 0 (a free port)
is for tests and embedders, which build StackConfig directly."""


def test_up_flags_cover_the_stack_fields() -> None:
    dests = _dests("up")
    flagged = {f for f in StackConfig.model_fields if UP_FLAGS.get(f, f) in dests}
    _covered(StackConfig, flagged, UP_FLAGLESS)


def test_up_without_flags_has_the_stack_defaults_but_the_documented_port() -> None:
    built = up_config(parse(["up"], {}))
    ((flag_default, model_default),) = UP_DEFAULTS_DIFFER.values()
    assert (built.gateway_port, StackConfig().gateway_port) == (flag_default, model_default)
    assert built == StackConfig(gateway_port=flag_default, log_level=built.log_level)


def test_engine_flags_cover_the_config_fields() -> None:
    for _, model, flags in ENGINE_GROUPS:
        flagless = {"kv_events": _NESTED, "latency": _NESTED, "faults": _NESTED}
        _covered(model, set(flags), flagless if model is EngineConfig else {})


def test_engine_without_flags_but_its_role_has_the_config_defaults() -> None:
    for role in ("prefill", "decode"):
        assert engine_config(parse(["engine", "--role", role], {})) == EngineConfig(role=role)
