"""Log lines reach stderr whole: one write per line, newline included, so that services
sharing one stderr (the launcher's children) never run two lines into one."""

from __future__ import annotations

import json
import logging
import sys

import structlog

from common.logging import configure, get_logger


class Recorder:
    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_each_log_line_is_a_single_write(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(sys, "stderr", rec)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", root.handlers[:])
    monkeypatch.setattr(root, "level", root.level)
    configure("tester")
    try:
        get_logger("t").info("hello", n=1)
        get_logger("t").warning("again")
    finally:
        structlog.reset_defaults()  # no later test logs into the recorder
    assert len(rec.writes) == 2
    for text in rec.writes:
        assert text.endswith("\n") and text.count("\n") == 1
        assert json.loads(text)["service"] == "tester"
