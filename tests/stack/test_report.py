"""How a doctor report reads: verdict first, failing stages first, exit status, JSON."""

from __future__ import annotations

from globalkv.stack.doctor.report import Level, Report, Stage, render_text


def report(*levels: Level) -> Report:
    stages = []
    for i, level in enumerate(levels):
        stage = Stage(f"s{i}", f"stage {i}")
        stage.add(Level.OK, "fine", "holds")
        if level is not Level.OK:
            stage.add(level, f"thing {i}", f"{level.value} here")
        stages.append(stage)
    return Report(stages)


def test_a_stage_is_as_bad_as_its_worst_finding() -> None:
    stage = Stage("k", "t")
    assert stage.level is Level.SKIP
    stage.skip("a", "not checked")
    stage.ok("b", "ok")
    assert stage.level is Level.OK
    stage.warn("c", "hm")
    assert stage.level is Level.WARN
    stage.fail("d", "no")
    assert stage.level is Level.FAIL
    assert [f.subject for f in stage.failures] == ["d"]


def test_warnings_keep_the_exit_status_zero() -> None:
    warned = report(Level.OK, Level.WARN)
    assert warned.healthy
    assert warned.exit_status == 0
    assert warned.first_failure is None
    assert render_text(warned).startswith("globalkv doctor: healthy, with warnings in: stage 1\n")


def test_the_first_failing_stage_leads_and_failures_print_first() -> None:
    broken = report(Level.OK, Level.FAIL, Level.WARN, Level.FAIL)
    assert broken.exit_status == 1
    assert broken.first_failure is broken.stages[1]
    text = render_text(broken)
    assert text.splitlines()[0] == (
        "globalkv doctor: PROBLEM at stage 'stage 1': thing 1: fail here"
    )
    headers = [line for line in text.splitlines() if line.startswith("[")]
    assert headers == ["[✗] stage 1", "[✗] stage 3", "[✓] stage 0", "[!] stage 2"]
    assert "    ✗ thing 3: fail here" in text


def test_json_carries_every_finding() -> None:
    data = report(Level.OK, Level.FAIL).to_json()
    assert data["healthy"] is False
    assert data["first_failing_stage"] == "s1"
    assert data["stages"][1] == {
        "key": "s1",
        "title": "stage 1",
        "level": "fail",
        "findings": [
            {"level": "ok", "subject": "fine", "message": "holds"},
            {"level": "fail", "subject": "thing 1", "message": "fail here"},
        ],
    }
