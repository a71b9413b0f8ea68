"""``bench/burst_hold_call.sh``, the HOLD_BURSTS device call, run here with a stand-in ``python3``: what it would
ask ``serving_table.py`` for (the burst's settings, the three servers, the chunk case), that those arguments parse and
name real settings with valid values, and that it returns its summary in at most 8 files. A mistyped setting would
otherwise only show on the device, as a server that never starts, after minutes of a call."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import serving_table
from inference_server.config import load_settings

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "burst_hold_call.sh"

# python3 as the script sees it: pip (device_call.sh's wheel install) succeeds, serving_table.py records its arguments
# and leaves a table and one row per server where --out says, anything else is the real interpreter (the summary).
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
if args[:1] == ["-m"]:
    sys.exit(0)
if args[:1] == ["bench/serving_table.py"]:
    args = args[1:]
    with open(os.environ["CALLS"], "a") as calls:
        calls.write(json.dumps(args) + "\\n")
    out = Path(args[args.index("--out") + 1])
    out.mkdir(parents=True, exist_ok=True)
    variants = ["default"] + [args[i + 1] for i, a in enumerate(args) if a == "--variant"]
    rows = [dict(variant=v, ttft_median_ms=500.0 + i, ttft_p99_ms=900.0 + i, itl_median_ms=24.5, itl_p99_ms=60.0 + i,
                 output_tok_s=3000.0, runs=3, failed=0) for i, v in enumerate(variants)]
    (out / "rows.json").write_text(json.dumps(rows))
    (out / "table.md").write_text("| table |\\n")
    print("server default ready in 1.0 s")
    sys.exit(0)
os.execv(sys.executable, [sys.executable, *args])
"""


def run_script(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[list[str]], Path]:
    """Run the script from the project root with the stand-in; its result, serving_table's argument lists, $OUT."""
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(FAKE_PYTHON)
    (fake / "python3").chmod(0o755)
    out, calls = tmp_path / "out", tmp_path / "calls.jsonl"
    out.mkdir()
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(out), "CALLS": str(calls)}
    result = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    recorded = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return result, recorded, out


def server_environments(args: list[str]) -> list[dict[str, str]]:
    """The settings of each server one serving_table.py call starts: its --env pairs, then each --variant's."""
    parsed = serving_table.build_parser().parse_args(args)
    base = serving_table.parse_pairs(parsed.env)
    return [base] + [{**base, **serving_table.parse_pairs(v.split(","))} for v in parsed.variant]


def test_the_call_asks_for_the_burst_on_three_servers_and_the_chunk_case_on_two(tmp_path: Path) -> None:
    result, calls, out = run_script(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(calls) == 2
    burst, chunks = (serving_table.build_parser().parse_args(args) for args in calls)
    # prefill_table.sh's burst: 100 x 512 tokens at once, 128 out, MAX_MODEL_LEN=4096, median of 3
    assert (burst.model, burst.concurrency, burst.num_prompts, burst.input_len, burst.output_len, burst.repeats) == (
        "gemma-4-26b-a4b", "100", "100", "512", 128, 3)
    assert [{k: v for k, v in e.items() if k != "MAX_MODEL_LEN"} for e in server_environments(calls[0])] == [
        {"HOLD_BURSTS": "true"}, {"HOLD_BURSTS": "false"}, {"HOLD_BURSTS": "true", "MAX_PREFILL_TOKENS": "16384"}]
    assert {e["MAX_MODEL_LEN"] for e in server_environments(calls[0])} == {"4096"}
    # the chunk policy's case (docs/benchmarks.md): 64 streams, 512 in / 256 out, 8,192-token prompts at 1/s
    assert (chunks.concurrency, chunks.num_prompts, chunks.input_len, chunks.output_len, chunks.arrivals) == (
        "64", "64", "512", 256, "8192@1")
    assert [e["HOLD_BURSTS"] for e in server_environments(calls[1])] == ["true", "false"]
    for args in calls:  # every server's environment is valid settings
        for environment in server_environments(args):
            load_settings(overrides=environment, environ={}, dotenv_path=None)
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    assert {"burst-hold.md", "chunks-hold.md", "summary.md"} <= set(files)
    summary = (out / "summary.md").read_text()
    for server in ("| burst-hold | HOLD_BURSTS=true | 500 / 900 | 24.5 / 60.0 |", "| burst-hold | HOLD_BURSTS=false |",
                   "| burst-hold | HOLD_BURSTS=true,MAX_PREFILL_TOKENS=16384 |", "| chunks-hold | HOLD_BURSTS=false |"):
        assert server in summary, summary


@pytest.mark.parametrize(("part", "names"), [("burst", ["burst-hold"]), ("chunks", ["chunks-hold"])])
def test_a_part_alone(tmp_path: Path, part: str, names: list[str]) -> None:
    result, calls, out = run_script(tmp_path, part)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [Path(args[args.index("--out") + 1]).name for args in calls] == names
    assert [line.split(" | ")[0] for line in (out / "summary.md").read_text().splitlines()[2:]] == [
        f"| {names[0]}"] * len(server_environments(calls[0]))


def test_an_unknown_part_is_refused(tmp_path: Path) -> None:
    result, calls, _ = run_script(tmp_path, "everything")
    assert result.returncode == 2 and "usage" in result.stdout and not calls
