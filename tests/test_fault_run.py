"""``bench/fault_run.py`` end to end, briefly: a real ``serve`` process (tiny dummy preset, CPU) with slow
steps and allocator refusals on, a few seconds of load with stalled and dropping clients: nothing lost,
nothing leaked, exit status 0 after SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_short_fault_run_loses_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    command = [sys.executable, str(REPO / "bench" / "fault_run.py"), "--model", "gemma-4-31b-tiny",
               "--dummy-weights", "--prompt-ids", "--seconds", "3", "--requests", "40", "--concurrency", "4",
               "--drop", "0.2", "--stall", "0.2", "--stall-seconds", "0.5",
               "--faults", "alloc_refuse=0.3,step_delay=0.3:0.02,seed=1", "--json", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    result = json.loads(out.read_text())
    assert result["lost"] == 0 and result["errored"] == 0 and result["unreachable"] == 0
    assert result["completed"] >= 1
    assert result["completed"] + result["rejected"] + result["dropped"] == result["sent"]
    behaviours = result["behaviours"]
    assert behaviours.get("stall", 0) >= 1
    assert behaviours.get("drop_after_send", 0) + behaviours.get("drop_mid_stream", 0) >= 1
    assert {k: result["after_run"][k] for k in ("requests", "stream_entries", "kv_sequences", "kv_blocks_in_use")} \
        == {"requests": 0, "stream_entries": 0, "kv_sequences": 0, "kv_blocks_in_use": 0}
    assert result["exit_code"] == 0 and result["orphans"] == []
