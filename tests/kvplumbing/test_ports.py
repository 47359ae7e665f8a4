"""unclaimed_ports: free ports outside the kernel's ephemeral range, or the kernel's own."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from kvplumbing import ports
from kvplumbing.ports import LOWEST, unclaimed_ports


def _range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, low: int, high: int) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(f"{low}\t{high}\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", path)


def test_ports_are_distinct_free_and_below_the_ephemeral_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _range(tmp_path, monkeypatch, 32768, 60999)
    chosen = unclaimed_ports(20)
    assert len(set(chosen)) == 20
    assert all(LOWEST <= port < 32768 for port in chosen)
    for port in chosen:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _range(tmp_path, monkeypatch, 32768, 60999)
    first = random.Random(7).randrange(LOWEST, 32768)
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", first))
        except OSError:
            pytest.skip(f"port {first} is in use by another process")
        taken.listen()
        chosen = unclaimed_ports(3, rng=random.Random(7))
    assert first not in chosen
    assert len(set(chosen)) == 3


def test_without_room_below_the_range_the_kernel_chooses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _range(tmp_path, monkeypatch, 10050, 60999)
    chosen = unclaimed_ports(5)
    assert len(set(chosen)) == 5
    assert all(port >= 10050 for port in chosen)


def test_an_unreadable_range_falls_back_to_the_usual_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert all(LOWEST <= port < 32768 for port in unclaimed_ports(4))
