"""`kv@<pod>@<model>` read and written by one pair of functions."""

from __future__ import annotations

import pytest

from kvplumbing.topics import kv_topic, parse_topic


@pytest.mark.parametrize(
    ("topic", "parsed"),
    [
        ("kv@p0@m", ("p0", "m")),
        ("kv@p0@org/model@v2", ("p0", "org/model@v2")),
        ("kv@pod-a@model@x", ("pod-a", "model@x")),
        ("kv@@m", None),
        ("kv@p0", None),
        ("", None),
        ("other@p0@m", None),
    ],
)
def test_parse_topic(topic: str, parsed: tuple[str, str] | None) -> None:
    assert parse_topic(topic) == parsed


@pytest.mark.parametrize(("pod", "model"), [("p0", "m"), ("10.0.0.5:30000", "org/model@v2")])
def test_a_written_topic_reads_back(pod: str, model: str) -> None:
    assert parse_topic(kv_topic(pod, model)) == (pod, model)
