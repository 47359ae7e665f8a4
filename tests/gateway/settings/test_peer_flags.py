"""docs/sglang-router-flags.md stays true: it lists exactly sglang-router 0.3.2's flags (its
`--help`, kept in tests/data so that CI needs no sglang-router), the flags it calls same or
different parse into a configuration, and those it calls not supported are refused with a
message pointing to it. And sglang-router launch lines go through `globalkv gateway`."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.settings.peer_flags import ACCEPTED, FLAGS_DOC, REFUSED
from tests.gateway.standalone.test_cli import config_of
from tests.support.kubeconfig import write_kubeconfig

ROOT = Path(__file__).resolve().parents[3]
HELP = (ROOT / "tests" / "data" / "sglang_router_0.3.2_help.txt").read_text()
TABLE = (ROOT / FLAGS_DOC).read_text()
PD = ("--pd-disaggregation", "--prefill", "http://p1:30001", "9001", "--decode", "http://d1:30011")


def _peer_flags() -> list[str]:
    return sorted(set(re.findall(r"^  (--[a-z0-9-]+)", HELP, re.M)))


def _rows() -> dict[str, tuple[str, str]]:
    """Flag -> (status, example arguments) of the doc's table."""
    rows: dict[str, tuple[str, str]] = {}
    for line in TABLE.splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 4 and cells[0].startswith("`--"):
            flag = cells[0].strip("`")
            assert flag not in rows, f"{flag} listed twice"
            rows[flag] = (cells[1], cells[2].strip("`"))
    return rows


ROWS = _rows()


def test_the_table_lists_exactly_sglang_routers_flags() -> None:
    assert len(_peer_flags()) == 98
    assert sorted(ROWS) == _peer_flags()
    assert {status for status, _ in ROWS.values()} == {"same", "different", "not supported"}
    counts = {s: sum(1 for v, _ in ROWS.values() if v == s) for s in ("same", "different")}
    refused = len(ROWS) - sum(counts.values())
    summary = f"{counts['same']} same, {counts['different']} different, {refused} not supported"
    assert summary in TABLE


def test_refused_and_accepted_flags_are_sglang_routers() -> None:
    assert set(REFUSED) | set(ACCEPTED) <= set(_peer_flags())
    refused = {flag for flag, (status, _) in ROWS.items() if status == "not supported"}
    assert refused == {*REFUSED, "--worker-urls"}


@pytest.mark.parametrize(
    "flag", sorted(f for f, (status, _) in ROWS.items() if status != "not supported")
)
def test_same_and_different_flags_parse(flag: str) -> None:
    example = shlex.split(ROWS[flag][1])
    assert flag in example
    config_of(*PD, *example)


@pytest.mark.parametrize(
    "flag", sorted(f for f, (status, _) in ROWS.items() if status == "not supported")
)
def test_unsupported_flags_are_refused_pointing_to_the_table(flag: str) -> None:
    with pytest.raises(ValueError, match=re.escape(FLAGS_DOC)) as refused:
        config_of(*PD, *shlex.split(ROWS[flag][1]))
    assert flag in str(refused.value)


SGLANG_ROUTER_LINE = (
    # sglang-router's documented PD launch, then what the platform team's line adds.
    "--pd-disaggregation --prefill http://p1:30001 9001 --prefill http://p2:30001 none "
    "--decode http://d1:30011 --decode http://d2:30011 --policy cache_aware "
    "--host 0.0.0.0 --port 30000 --prometheus-port 29000 --prometheus-host 0.0.0.0 "
    "--service-discovery --prefill-selector app=sglang component=prefill "
    "--decode-selector app=sglang component=decode --service-discovery-port 30000 "
    "--service-discovery-namespace llm --bootstrap-port-annotation sglang.ai/bootstrap-port "
    "--max-concurrent-requests 256 --queue-size 100 --queue-timeout-secs 60 "
    "--rate-limit-tokens-per-second 512 --log-dir /tmp/sglang-router-logs --log-level info "
    "--request-id-headers x-request-id x-trace-id --cors-allowed-origins https://chat.example.com "
    "--dp-aware --request-timeout-secs 1800 --retry-max-retries 3 --cb-failure-threshold 5 "
    "--health-check-interval-secs 30 --worker-startup-timeout-secs 600 "
    "--tokenizer Qwen/Qwen2.5-0.5B-Instruct"
)


def test_an_sglang_router_launch_line_checks_unchanged(tmp_path: Path) -> None:
    """Checked where its pods would be found: with Kubernetes credentials."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig")
    done = subprocess.run(
        [sys.executable, "-m", "globalkv", "--check", "gateway", *shlex.split(SGLANG_ROUTER_LINE)],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "configuration ok" in done.stdout
    config = config_of(*shlex.split(SGLANG_ROUTER_LINE))
    assert (config.discovery.port, config.discovery.namespace) == (30000, "llm")
    assert config.discovery.prefill_selector == ["app=sglang", "component=prefill"]
    assert (config.admission.max_concurrent_requests, config.edge.dp_aware) == (256, True)
    assert config.tokenizer == "Qwen/Qwen2.5-0.5B-Instruct"
