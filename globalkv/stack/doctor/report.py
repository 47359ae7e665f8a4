"""What `doctor` found, stage by stage, and how it is shown.

A report follows the diagnostic path of a request: the gateway's worker pools, each
prefill's bootstrap directory, the index, prefix routing, and a probe request through
all of it. The text form opens with a verdict naming the first failing stage, then prints
the failing stages before the others (each group in path order), so the line to act on
is at the top. `--json` gives the same content for scripts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Level(enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    """Not checked: no address given, or an earlier failure made it meaningless."""

    @property
    def mark(self) -> str:
        return {"ok": "✓", "warn": "!", "fail": "✗", "skip": "-"}[self.value]


_SEVERITY = {Level.SKIP: 0, Level.OK: 1, Level.WARN: 2, Level.FAIL: 3}


@dataclass(frozen=True, slots=True)
class Finding:
    level: Level
    subject: str
    message: str


@dataclass(slots=True)
class Stage:
    key: str
    title: str
    findings: list[Finding] = field(default_factory=list)
    label: str = ""
    """Put before each subject: a gateway serving two pools is probed once per pool."""

    def add(self, level: Level, subject: str, message: str) -> Finding:
        finding = Finding(level, f"{self.label}{subject}", message)
        self.findings.append(finding)
        return finding

    def labelled(self, label: str) -> Stage:
        """This stage, its findings' subjects led by `label`."""
        return Stage(self.key, self.title, self.findings, label) if label else self

    def ok(self, subject: str, message: str) -> None:
        self.add(Level.OK, subject, message)

    def warn(self, subject: str, message: str) -> None:
        self.add(Level.WARN, subject, message)

    def fail(self, subject: str, message: str) -> None:
        self.add(Level.FAIL, subject, message)

    def skip(self, subject: str, message: str) -> None:
        self.add(Level.SKIP, subject, message)

    @property
    def level(self) -> Level:
        return max((f.level for f in self.findings), key=_SEVERITY.__getitem__, default=Level.SKIP)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.level is Level.FAIL]


@dataclass(slots=True)
class Report:
    stages: list[Stage]

    def stage(self, key: str) -> Stage:
        for stage in self.stages:
            if stage.key == key:
                return stage
        raise KeyError(key)

    @property
    def healthy(self) -> bool:
        return all(stage.level is not Level.FAIL for stage in self.stages)

    @property
    def first_failure(self) -> Stage | None:
        return next((s for s in self.stages if s.level is Level.FAIL), None)

    @property
    def exit_status(self) -> int:
        return 0 if self.healthy else 1

    def to_json(self) -> dict[str, Any]:
        first = self.first_failure
        return {
            "healthy": self.healthy,
            "first_failing_stage": None if first is None else first.key,
            "stages": [
                {
                    "key": s.key,
                    "title": s.title,
                    "level": s.level.value,
                    "findings": [
                        {"level": f.level.value, "subject": f.subject, "message": f.message}
                        for f in s.findings
                    ],
                }
                for s in self.stages
            ],
        }


def render_text(report: Report) -> str:
    first = report.first_failure
    if first is None:
        warned = [s.title for s in report.stages if s.level is Level.WARN]
        verdict = "healthy" + (f", with warnings in: {', '.join(warned)}" if warned else "")
    else:
        problem = first.failures[0]
        verdict = f"PROBLEM at stage '{first.title}': {problem.subject}: {problem.message}"
    lines = [f"globalkv doctor: {verdict}", ""]
    failing = [s for s in report.stages if s.level is Level.FAIL]
    others = [s for s in report.stages if s.level is not Level.FAIL]
    for stage in failing + others:
        lines.append(f"[{stage.level.mark}] {stage.title}")
        for finding in stage.findings:
            lines.append(f"    {finding.level.mark} {finding.subject}: {finding.message}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
