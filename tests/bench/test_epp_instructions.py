"""bench.epp_instructions refuses what it cannot measure before it starts anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.epp_instructions import main


@pytest.mark.parametrize(
    ("labels", "modes", "message"),
    [
        (["old"], "buffered,streamed", "unknown --modes ['streamed']"),
        (["minimal"], "buffered", "--variant labels must differ"),
        (["epp"], "buffered", "--variant labels must differ"),
        (["old", "old"], "buffered", "--variant labels must differ"),
    ],
)
def test_a_mode_or_servers_it_cannot_tell_apart_are_refused(
    labels: list[str], modes: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each server is a row of the table by its label: two of one label cannot both be."""
    (tmp_path / "gateway" / "standalone").mkdir(parents=True)
    (tmp_path / "gateway" / "standalone" / "cli.py").touch()
    argv = [a for label in labels for a in ("--variant", f"{label}={tmp_path}")]
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--modes", modes])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
