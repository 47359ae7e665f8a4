"""The file source: workers added and removed as the file changes, and a bad file refused
whole with the last good workers kept."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from globalkv.discovery.files import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_VALUES,
    FileSource,
    parse_workers,
)
from globalkv.discovery.model import Changes, DiscoveredWorker
from tests.discovery.support import consumer, removed_ids, until

GOOD = """
workers:
  - url: http://127.0.0.1:30001/
    role: prefill
    bootstrap_port: 8998
  - url: http://127.0.0.1:30002
    role: decode
    model: qwen3-8b
    id: decode-a
"""
P1 = DiscoveredWorker("http://127.0.0.1:30001", "http://127.0.0.1:30001", "prefill", 8998)
D1 = DiscoveredWorker("decode-a", "http://127.0.0.1:30002", "decode", None, "qwen3-8b")


class Polls:
    """The source's sleep: counts the polls so a test can wait for more of them."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self, seconds: float) -> None:
        self.count += 1
        await asyncio.sleep(0.005)


@asynccontextmanager
async def following(path: Path) -> AsyncIterator[tuple[FileSource, list[Changes], Polls]]:
    polls = Polls()
    async with (
        FileSource(path, interval=0.005, sleep=polls) as source,
        consumer(source.snapshots()) as applied,
    ):
        yield source, applied, polls


async def more_polls(polls: Polls, count: int = 3) -> None:
    target = polls.count + count
    await until(lambda: polls.count >= target, f"{count} more polls")


async def test_workers_come_and_go_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "workers.yaml"
    path.write_text(GOOD)
    async with following(path) as (source, applied, _):
        await until(lambda: source.current == {P1, D1}, "both workers")
        replace(path, "workers:\n  - {url: 'http://127.0.0.1:30003', role: decode}\n")
        d2 = DiscoveredWorker("http://127.0.0.1:30003", "http://127.0.0.1:30003", "decode")
        await until(lambda: source.current == {d2}, "the new file's worker")
        replace(path, "workers: []\n")
        await until(lambda: source.current == frozenset(), "no workers")
        await until(lambda: len(applied) == 3, "three steps applied")
        assert sorted(removed_ids(applied)) == ["decode-a", "http://127.0.0.1:30001", d2.id]


async def test_a_bad_file_keeps_the_last_good_workers_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "workers.yaml"
    path.write_text(GOOD)
    caplog.set_level(logging.ERROR, logger="globalkv.discovery.files")
    async with following(path) as (source, applied, polls):
        await until(lambda: source.current == {P1, D1}, "both workers")
        replace(path, "workers: [ {url: http://127.0.0.1:30001, role: prefill\n")
        await until(lambda: source.errors["invalid"] == 1, "the bad file refused")
        await more_polls(polls)
        replace(path, "workers:\n  - {url: 'http://127.0.0.1:30001', role: router}\n")
        await until(lambda: source.errors["invalid"] == 2, "the second bad file refused")
        await more_polls(polls)
        path.unlink()
        await until(lambda: source.errors["unreadable"] == 1, "the missing file")
        await more_polls(polls)
        assert source.current == {P1, D1}
        assert len(applied) == 1
        errors = [r.getMessage() for r in caplog.records]
        assert len(errors) == 3
        assert "not valid YAML" in errors[0]
        assert "workers.0.role" in errors[1]
        assert all("keeping the last good file's 2 workers" in e for e in errors)
        replace(path, GOOD.replace("30002", "30004"))
        await until(lambda: len(applied) == 2, "the good file again")


async def test_a_file_that_appears_later_is_read(tmp_path: Path) -> None:
    path = tmp_path / "workers.json"
    async with following(path) as (source, _, polls):
        await until(lambda: source.errors["unreadable"] == 1, "no file yet")
        await more_polls(polls)
        assert source.current is None
        assert source.errors["unreadable"] == 1
        replace(
            path, json.dumps({"workers": [{"url": "http://127.0.0.1:30002", "role": "decode"}]})
        )
        await until(lambda: source.current is not None and len(source.current) == 1, "the file")


async def test_a_file_too_large_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "workers.yaml"
    path.write_text("#" * (MAX_FILE_BYTES + 1))
    async with following(path) as (source, _, _polls):
        await until(lambda: source.errors["too large"] == 1, "the large file refused")
        assert source.current is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("- url: http://127.0.0.1:1\n  role: decode\n", "mapping with a 'workers' list"),
        (
            "workers:\n  - {url: 'http://127.0.0.1:1', role: decode, bootstrap_port: 8998}\n",
            "prefill only",
        ),
        (
            "workers:\n  - {url: 'http://127.0.0.1:1', role: prefill, bootstrap_port: '8998'}\n",
            "bootstrap_port",
        ),
        (
            "workers:\n  - {url: 'http://127.0.0.1:1', role: prefill, bootstrap_port: 70000}\n",
            "bootstrap_port",
        ),
        ("workers:\n  - {url: 'http://127.0.0.1:PORT', role: decode}\n", "invalid port"),
        ("workers:\n  - {url: 'tcp://127.0.0.1:1', role: decode}\n", "not an http(s) URL"),
        ("workers:\n  - {url: 'http://127.0.0.1:1', role: decode, weight: 2}\n", "weight"),
        (
            "workers:\n  - {url: 'http://127.0.0.1:1', role: decode}\n"
            "  - {url: 'http://127.0.0.1:1/', role: prefill}\n",
            "listed twice",
        ),
        (
            "workers:\n  - {url: 'http://127.0.0.1:1', role: decode, id: x}\n"
            "  - {url: 'http://127.0.0.1:2', role: decode, id: x}\n",
            "listed twice",
        ),
    ],
)
def test_one_bad_entry_refuses_the_file(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        parse_workers(text, as_json=False)


def test_json_files_are_read_as_json() -> None:
    assert parse_workers('{"workers": []}', as_json=True) == frozenset()
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_workers("workers: []", as_json=True)


def _laughs(levels: int) -> str:
    """YAML of `levels` anchors, each a list of ten aliases of the one before: 10**levels
    entries in a file of a few hundred bytes."""
    lines = ["a0: &a0 {url: 'http://127.0.0.1:1', role: decode}"]
    lines += [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 10)}]" for n in range(1, levels + 1)]
    return "\n".join(lines) + f"\nworkers: *a{levels}\n"


def replace(path: Path, text: str) -> None:
    """Write `path` whole at once, as a ConfigMap update does: the poller must not read a
    file half-written (an empty one is a bad file of its own)."""
    written = path.with_suffix(".new")
    written.write_text(text)
    written.replace(path)


DEEP_JSON = '{"workers": ' + "[" * 200_000 + "]" * 200_000 + "}"
"""Past the JSON parser's recursion limit, well within the size limit."""
SHALLOW_PAST_DEPTH = '{"workers": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}"
DEEP_YAML = "workers:\n" + "".join(f"{'  ' * n}- x:\n" for n in range(1, 600)) + "    - y\n"


@pytest.mark.parametrize(
    ("text", "as_json", "says"),
    [
        (DEEP_JSON, True, f"JSON nested deeper than {MAX_DEPTH} levels"),
        (SHALLOW_PAST_DEPTH, True, f"JSON nested deeper than {MAX_DEPTH} levels"),
        ("workers: " + "[" * 100_000 + "]" * 100_000, False, "YAML nested deeper"),
        (DEEP_YAML, False, "YAML nested deeper"),
        (_laughs(9), False, f"more than {MAX_VALUES} values"),
        ('{"workers": [' + "1," * MAX_VALUES + "1]}", True, f"more than {MAX_VALUES} values"),
    ],
)
def test_files_nested_too_deeply_or_holding_too_much_are_refused(
    text: str, as_json: bool, says: str
) -> None:
    assert len(text.encode()) <= MAX_FILE_BYTES
    with pytest.raises(ValueError, match=says) as refused:
        parse_workers(text, as_json=as_json)
    assert "\n" not in str(refused.value)


def test_aliases_within_the_bounds_are_read() -> None:
    text = (
        "workers:\n"
        "  - {url: 'http://127.0.0.1:1', role: decode, model: &m qwen3-8b}\n"
        "  - {url: 'http://127.0.0.1:2', role: decode, model: *m}\n"
    )
    assert {w.model for w in parse_workers(text, as_json=False)} == {"qwen3-8b"}


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("workers.json", DEEP_JSON),
        ("workers.yaml", "workers: " + "[" * 100_000 + "]" * 100_000),
        ("workers.yaml", _laughs(9)),
        ("workers.yaml", "#" * (MAX_FILE_BYTES + 1)),
    ],
)
async def test_a_hostile_file_is_refused_in_one_line_and_the_next_good_file_applies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, bad: str
) -> None:
    path = tmp_path / name
    good = json.dumps({"workers": [{"url": "http://127.0.0.1:30002", "role": "decode"}]})
    path.write_text(good)
    caplog.set_level(logging.ERROR, logger="globalkv.discovery.files")
    async with following(path) as (source, applied, polls):
        await until(lambda: source.current is not None, "the good file")
        first = source.current
        replace(path, bad)
        await until(lambda: sum(source.errors.values()) == 1, "the hostile file refused")
        await more_polls(polls)
        assert source.current == first
        (line,) = [r.getMessage() for r in caplog.records]
        assert "refused" in line
        assert "keeping the last good file's 1 workers" in line
        assert "\n" not in line
        replace(path, good.replace("30002", "30003"))
        await until(lambda: len(applied) == 2, "the next good file applied")
        assert {w.url for w in source.current or ()} == {"http://127.0.0.1:30003"}
