"""bench.gateway_instructions' `--headers LABEL=Name:Value[,Name:Value…]`."""

from __future__ import annotations

import argparse

import pytest

from bench.gateway_instructions import _headers


def test_a_value_keeps_its_colons_and_headers_are_split_on_commas() -> None:
    """An `Origin` is a URL: only the first colon ends the name."""
    label, headers = _headers("CORS, allowed=Origin:https://app.example:8443,x-request-id: r-1")
    assert label == "CORS, allowed"
    assert headers == [("Origin", "https://app.example:8443"), ("x-request-id", "r-1")]


@pytest.mark.parametrize(
    "value", ["no-label", "=a:b", "case=", "case=name", "case=a:b,:c", "case=a:"]
)
def test_a_case_without_a_label_or_a_whole_header_is_refused(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL=Name:Value"):
        _headers(value)
