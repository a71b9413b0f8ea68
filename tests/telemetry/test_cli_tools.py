"""``inference-server tail`` and ``report`` against a real server process (fake step function): the tail
prints requests as they happen, SIGTERM leaves a complete run file, and the report summarises and plots it."""

from __future__ import annotations

import signal
import sqlite3
import sys
import threading
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from served import fake_server

from inference_server.__main__ import main
from inference_server.cli import tail as tail_cli


def test_tail_then_sigterm_then_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    telemetry_dir = tmp_path / "telemetry"
    env = {"TELEMETRY_DIR": str(telemetry_dir), "TIMELINE_DIR": str(tmp_path / "timeline")}
    with fake_server(env, tmp_path / "server.log") as (process, url):
        seen: list[dict] = []
        subscribed = threading.Event()

        def tail() -> None:
            for line in tail_cli.read_lines(f"{url}/telemetry/tail?session_id=s1&steps=0", timeout=60):
                seen.append(line)
                subscribed.set()
                if line["event"] == "finished":
                    return

        reader = threading.Thread(target=tail, daemon=True)
        reader.start()
        assert subscribed.wait(60)
        with httpx.Client(base_url=url, timeout=60) as client:
            for session in ("s0", "s1", "s2"):
                response = client.post("/generate", json={"prompt": "the capital of france is", "max_tokens": 8,
                                                          "ignore_eos": True, "session_id": session},
                                       headers={"X-Trace-Id": f"trace-{session}"})
                assert response.status_code == 200 and response.headers["X-Trace-Id"] == f"trace-{session}"
            metrics = client.get("/metrics").text
            assert 'vllm:request_success_total{finished_reason="length",model_name="tiny-test"} 3.0' in metrics
        reader.join(60)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    assert [line["event"] for line in seen] == ["subscribed", "queued", "started", "first_token", "finished"]
    assert seen[-1]["trace_id"] == "trace-s1" and seen[-1]["output_tokens"] == 8
    assert tail_cli.describe(seen[-1]).split()[1:4] == ["finished", f"#{seen[-1]['request_id']}", "length"]

    [run_file] = telemetry_dir.glob("run-*.sqlite")
    with sqlite3.connect(run_file) as db:
        assert db.execute("SELECT trace_id, session_id, output_tokens FROM requests ORDER BY trace_id").fetchall() == [
            ("trace-s0", "s0", 8), ("trace-s1", "s1", 8), ("trace-s2", "s2", 8)]
        assert db.execute("SELECT value FROM meta WHERE key = 'end_time_unix'").fetchone() is not None
    capsys.readouterr()
    assert main(["report", str(run_file), "--out", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    assert "3 requests {'length': 3}" in printed and "ttft" in printed
    for name in ("latency_cdf.png", "throughput_queue.png", "kv_usage.png"):
        assert (tmp_path / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_refuses_what_is_not_a_run_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.sqlite"
    junk.write_text("not a database")
    assert main(["report", str(junk)]) == 2
    assert "not a run file" in capsys.readouterr().err


def test_tail_describes_every_line_the_server_sends() -> None:
    """Each NDJSON line kind of ``/telemetry/tail`` gets a readable line, not its raw JSON."""
    lines = [{"event": "subscribed", "capacity": 1024, "session_id": None, "trace_id": None},
             {"event": "kv_blocks", "t": 2.5, "seq": 13, "stored": 2, "removed": 3},
             {"event": "lost", "events": 4, "total": 9}]
    described = [tail_cli.describe(line) for line in lines]
    assert not any(text.lstrip().startswith("{") for text in described), described
    assert described[1].split() == ["2.500", "kv", "blocks", "seq", "13", "stored", "2", "removed", "3"]


@pytest.mark.filterwarnings("error")
def test_a_run_without_requests_or_steps_plots_without_warnings(tmp_path: Path) -> None:
    """A run that served nothing (started and stopped) used to print matplotlib's "No artists with labels"
    warnings from empty legends; its plots are written quietly."""
    from inference_server.cli.report import plot

    written = plot({"requests": [], "steps": []}, tmp_path)
    assert [path.name for path in written] == ["latency_cdf.png", "throughput_queue.png", "kv_usage.png"]
