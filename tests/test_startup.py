"""Start-up phases: start and time logged per phase, quarter lines off a terminal, a bar redrawn in place on one,
and the summary of where the start-up time went."""

from __future__ import annotations

import io
import logging

import pytest

from inference_server import startup


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "inference_server.startup"]


def test_plain_lines_off_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inference_server.startup")
    stream = io.StringIO()
    with startup.phase("loading weights", total=8, unit="tensors", stream=stream) as progress:
        assert list(progress.wrap(range(8))) == list(range(8))
    lines = messages(caplog)
    assert lines[0] == "loading weights ..."
    assert lines[1:5] == [f"loading weights: {p}% ({n}/8 tensors)" for p, n in ((25, 2), (50, 4), (75, 6), (100, 8))]
    assert lines[5].startswith("loading weights: done in ") and lines[5].endswith(" s")
    assert stream.getvalue() == ""  # no carriage returns in a log file
    assert startup.finished_phases()[-1][0] == "loading weights"


def test_a_bar_on_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inference_server.startup")
    terminal = Terminal()
    with startup.phase("capturing CUDA graphs", total=3, unit="batch sizes", stream=terminal) as progress:
        progress.advance(3)
    drawn = terminal.getvalue()
    assert drawn.startswith("\rcapturing CUDA graphs [") and drawn.endswith("100% 3/3 batch sizes\n")
    assert not [m for m in messages(caplog) if "%" in m]  # the bar, not the quarter lines


def test_a_phase_without_total_reports_its_time_and_a_failure_is_not_recorded(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inference_server.startup")
    with startup.phase("converting the tokenizer"):
        pass
    before = startup.finished_phases()
    with pytest.raises(ValueError), startup.phase("assembling"):
        raise ValueError("broken")
    assert startup.finished_phases() == before
    assert any(m.startswith("assembling: failed after") for m in messages(caplog))
    summary = startup.summary()
    assert "converting the tokenizer 0.0 s" in summary and summary.endswith(" s)") and "(total " in summary
