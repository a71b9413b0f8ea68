"""``bench/serve_bench.py`` and ``bench/serving_table.py``: the metric definitions on hand-made streams, the
/proc and workload helpers, and end to end against the real server on the embedded model (CPU, tiny sizes)."""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import serve_bench
import serving_table
from kit.host_sampling import ThreadCpu, listening_pid, top_threads

# -- metric definitions --------------------------------------------------------------------------------------


def coalesced_result() -> serve_bench.RequestResult:
    """Started at 0.9 s; events at 1.0 s (2 tokens), 1.3 s (3 tokens), 1.5 s (1 token)."""
    return serve_bench.RequestResult(prompt_len=8, requested=6, start=0.9, event_times=[1.0, 1.3, 1.5],
                                     event_tokens=[2, 3, 1], usage_tokens=6, done=True)


def test_per_token_itl_splits_a_coalesced_event_and_sums_to_e2e_minus_ttft() -> None:
    result = coalesced_result()
    assert result.success and result.output_tokens == 6
    assert result.ttft == pytest.approx(0.1) and result.e2e == pytest.approx(0.6)
    assert result.itl() == pytest.approx([0.0, 0.1, 0.1, 0.1, 0.2])
    assert sum(result.itl()) == pytest.approx(result.e2e - result.ttft)
    assert result.event_itl() == pytest.approx([0.3, 0.2])  # vLLM's: one sample per event gap


def test_summary_follows_vllms_definitions() -> None:
    other = serve_bench.RequestResult(prompt_len=4, requested=3, start=1.0, event_times=[1.2, 1.4, 1.6],
                                      event_tokens=[1, 1, 1], usage_tokens=3, done=True)
    failed = serve_bench.RequestResult(prompt_len=4, requested=3, start=1.0, error="HTTP 503: busy")
    report = serve_bench.summarize([coalesced_result(), other, failed])
    assert (report["completed"], report["failed"], report["errors"]) == (2, 1, ["HTTP 503: busy"])
    assert report["duration_s"] == pytest.approx(0.7)  # first start 0.9 to last token 1.6 (the failure ends at 1.0)
    assert report["total_output_tokens"] == 9 and report["total_input_tokens"] == 12
    assert report["output_throughput"] == pytest.approx(9 / 0.7)
    assert report["total_token_throughput"] == pytest.approx(21 / 0.7)
    assert report["ttft"]["mean_ms"] == pytest.approx(150.0)
    assert report["tpot"]["mean_ms"] == pytest.approx((100.0 + 200.0) / 2)  # (0.5 / 5, 0.4 / 2)
    assert report["itl_samples"] == 9 - 2 and report["event_itl_samples"] == 2 + 2
    assert report["tokens_per_event"] == pytest.approx(9 / 6)


@settings(deadline=None)  # a busy 2-core machine can stall any one example past hypothesis' 200 ms
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=50), st.sampled_from([0, 50, 99, 100]))
def test_percentile_is_numpys_linear_percentile(values: list[float], q: float) -> None:
    assert serve_bench.percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


def test_events_are_read_from_completions_chunks_and_native_events() -> None:
    chunk = b'{"choices":[{"index":0,"text":" a b","token_ids":[5,6]}],"usage":null}'
    assert serve_bench.read_event("/v1/completions", chunk) == (2, None, "")
    assert serve_bench.read_event("/v1/completions", b'{"choices":[{"text":" a"}]}') == (1, None, "")
    usage = b'{"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":4,"total_tokens":12}}'
    assert serve_bench.read_event("/v1/completions", usage) == (0, 4, "")
    error = b'{"error":{"message":"the engine failed","code":"engine_failure"}}'
    assert serve_bench.read_event("/v1/completions", error) == (0, None, "the engine failed")
    native = b'{"token_ids":[7],"text":" x","finish_reason":"length","usage":{"completion_tokens":4}}'
    assert serve_bench.read_event("/generate", native) == (1, 4, "")


def test_random_requests_are_seeded_and_within_the_ranges() -> None:
    requests = serve_bench.random_requests(50, 100, 20, 0.5, vocab_size=300, seed=3)
    assert requests == serve_bench.random_requests(50, 100, 20, 0.5, vocab_size=300, seed=3)
    assert requests != serve_bench.random_requests(50, 100, 20, 0.5, vocab_size=300, seed=4)
    assert all(50 <= len(r.prompt_ids) <= 150 and 10 <= r.output_len <= 30 for r in requests)
    assert all(0 <= t < 300 for r in requests for t in r.prompt_ids)
    fixed = serve_bench.random_requests(5, 8, 4, 0.0, vocab_size=300, seed=0)
    assert {(len(r.prompt_ids), r.output_len) for r in fixed} == {(8, 4)}


def test_workloads_of_one_seed_and_different_lengths_share_no_prefix() -> None:
    """A serving table runs several prompt lengths on one server with the same seeds: a longer prompt that began
    with a shorter one's ids would be served partly from the prefix cache."""
    short = serve_bench.random_requests(3, 64, 8, 0.0, vocab_size=50_000, seed=1000)
    long = serve_bench.random_requests(3, 256, 8, 0.0, vocab_size=50_000, seed=1000)
    other_output = serve_bench.random_requests(3, 64, 16, 0.0, vocab_size=50_000, seed=1000)
    for a, b, c in zip(short, long, other_output, strict=True):
        assert a.prompt_ids[:4] != b.prompt_ids[:4] and a.prompt_ids[:4] != c.prompt_ids[:4]
    first = serve_bench.shared_prefix_sessions(2, 1, 32, 2, 8, 4, vocab_size=50_000, seed=5)
    longer_system = serve_bench.shared_prefix_sessions(2, 1, 64, 2, 8, 4, vocab_size=50_000, seed=5)
    assert first[0][0].prompt_ids[:4] != longer_system[0][0].prompt_ids[:4]


# -- host sampling -------------------------------------------------------------------------------------------


def test_thread_cpu_attributes_work_to_the_thread_that_did_it() -> None:
    sampler = ThreadCpu(os.getpid())
    before = sampler.snapshot()
    done, release = threading.Event(), threading.Event()
    native_id: list[int] = []

    def burn() -> None:
        native_id.append(threading.get_native_id())
        start = time.thread_time()
        while time.thread_time() - start < 0.3:  # CPU work until this thread used 0.3 s, however long that takes
            pass
        done.set()
        release.wait(120)  # stay alive until sampled: an ended thread leaves /proc/<pid>/task

    worker = threading.Thread(target=burn)
    worker.start()
    assert done.wait(120)
    after = sampler.snapshot()
    release.set()
    worker.join()
    delta = sampler.delta(before, after)
    busiest = delta["threads"][0]
    assert busiest["tid"] == native_id[0] and busiest["cores"] > 0
    assert delta["total_cores"] >= busiest["cores"]
    assert any(t["name"].endswith("[main]") for t in delta["threads"])
    assert top_threads(delta, 1).endswith(f"{busiest['cores']:.2f}")


def test_the_listening_process_is_found_from_its_port() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert listening_pid(listener.getsockname()[1]) == os.getpid()


# -- end to end on the embedded model ------------------------------------------------------------------------


# ``embedded_server``: the session's server (tests/conftest.py)


def check_coherent(report: dict, num_prompts: int, output_len: int) -> None:
    assert report["completed"] == num_prompts and report["failed"] == 0
    assert report["total_output_tokens"] == report["counted_output_tokens"] == num_prompts * output_len
    assert report["total_input_tokens"] == num_prompts * report["config"]["input_len"]
    assert report["itl_samples"] == report["total_output_tokens"] - num_prompts
    assert 0 < report["ttft"]["median_ms"] <= report["e2el"]["median_ms"]
    assert report["ttft"]["p99_ms"] <= report["e2el"]["p99_ms"]
    # each request's mean per-token ITL is its TPOT, so the means over requests and over samples agree here
    # (every request has the same number of samples)
    assert report["itl"]["mean_ms"] == pytest.approx(report["tpot"]["mean_ms"], rel=1e-6)
    assert report["output_throughput"] == pytest.approx(report["total_output_tokens"] / report["duration_s"])
    assert report["gpu"] is None or report["gpu"]["samples"] >= 0
    assert report["server_cpu"]["total_cores"] > 0 and report["server_cpu"]["threads"]


def test_serve_bench_cli_against_the_embedded_model(embedded_server: tuple[int, str], tmp_path: Path) -> None:
    pid, url = embedded_server
    out = tmp_path / "report.json"
    code = serve_bench.main(["--url", url, "--input-len", "8", "--output-len", "4", "--num-prompts", "4",
                             "--concurrency", "2", "--warmup", "1", "--warmup-output-len", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0
    check_coherent(report, 4, 4)
    assert report["config"]["server_pid"] == pid  # found from the port
    assert report["config"]["vocab_size"] == 262144  # from /tokenizer_info


def test_native_route_at_a_poisson_rate(embedded_server: tuple[int, str]) -> None:
    pid, url = embedded_server
    config = serve_bench.BenchConfig(url=url, endpoint="/generate", input_len=6, output_len=3, range_ratio=0.0,
                                     num_prompts=3, concurrency=0, request_rate=20.0, server_pid=pid)
    report = trio.run(serve_bench.run_benchmark, config)
    check_coherent(report, 3, 3)
    assert report["config"]["request_rate"] == 20.0 and not math.isinf(report["duration_s"])


def test_serving_table_rows_from_a_running_server(embedded_server: tuple[int, str], tmp_path: Path) -> None:
    """The driver's per-server loop and table (its server start is ``launched``, as the session's
    ``embedded_server`` fixture starts it)."""
    pid, url = embedded_server
    args = serving_table.build_parser().parse_args(
        ["--model", "", "--concurrency", "1,2", "--num-prompts", "1,2", "--repeats", "2", "--input-len", "4",
         "--output-len", "2", "--warmup", "0"])
    points = [serving_table.Point(1, 1, 4), serving_table.Point(2, 2, 6)]
    rows = serving_table.run_points(url, pid, serving_table.Variant("default", {}), points, args, 0, math.inf,
                                    tmp_path, {})
    assert [(r["input_len"], r["concurrency"], r["runs"], r["failed"]) for r in rows] == [(4, 1, 2, 0), (6, 2, 2, 0)]
    assert all(r["output_tok_s_min"] <= r["output_tok_s"] <= r["output_tok_s_max"] for r in rows)
    assert len(list(tmp_path.glob("default_in*_c*_r*.json"))) == 4
    report = json.loads((tmp_path / "default_in6_c2_r1.json").read_text())
    assert report["total_input_tokens"] == 6 * 2
    table = serving_table.markdown_table(rows)
    assert table.count("\n| embedded | default | 4 | 1 |") == 1 and table.count("\n| embedded | default | 6 | 2 |") == 1


def test_serving_table_runs_each_repeat_again_under_arrivals(embedded_server: tuple[int, str],
                                                             tmp_path: Path) -> None:
    """``--arrivals``: every repeat plain, then while long prompts arrive; the arrivals are counted (the first
    arrives with the run's first request, so each loaded run has at least one) and tabled beside the plain row."""
    pid, url = embedded_server
    args = serving_table.build_parser().parse_args(
        ["--model", "", "--concurrency", "2", "--num-prompts", "2", "--repeats", "2", "--input-len", "4",
         "--output-len", "3", "--warmup", "1", "--arrivals", "24@5", "--arrivals-output-len", "2"])
    rows = serving_table.run_points(url, pid, serving_table.Variant("default", {}), [serving_table.Point(2, 2, 4)],
                                    args, 0, math.inf, tmp_path, {})
    assert [(r["variant"], r["runs"], r["failed"]) for r in rows] == [("default", 2, 0), ("default+arrivals", 2, 0)]
    plain, loaded = rows
    assert "arrivals" not in plain and loaded["arrivals"] == "24@5"
    assert loaded["arrivals_completed"] >= 2 and loaded["arrivals_failed"] == 0
    assert loaded["arrivals_ttft_median_ms"] > 0
    assert loaded["itl_p99_over_plain"] == pytest.approx(loaded["itl_p99_ms"] / plain["itl_p99_ms"])
    report = json.loads((tmp_path / "default_arrivals_in4_c2_r1.json").read_text())
    assert report["arrivals"]["total_input_tokens"] == 24 * report["arrivals"]["completed"]
    table = serving_table.arrivals_table(rows)
    assert table.count("\n| default | 2 | 24@5 |") == 1


@pytest.mark.parametrize("text", ["8192", "8192@", "@1", "x@1", "8192@0", "0@1", "8192@inf"])
def test_serving_table_refuses_a_malformed_arrivals_value(text: str) -> None:
    with pytest.raises(SystemExit, match="LEN@RATE"):
        serving_table.Arrivals.parse(text, 16)


@pytest.mark.heavy
def test_serving_table_end_to_end_on_the_embedded_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole driver: schedule, server start, runs, table (two server starts: about a minute on CPU)."""
    code = serving_table.main(["--model", "", "--concurrency", "1,2", "--num-prompts", "1,2", "--repeats", "1",
                               "--input-len", "4", "--output-len", "2", "--variant", "MAX_BATCH_SIZE=1",
                               "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "server start: MAX_BATCH_SIZE=1" in printed and "| embedded | MAX_BATCH_SIZE=1 | 2 |" in printed
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["variant"], r["concurrency"]) for r in rows] == [("default", 1), ("default", 2),
                                                                ("MAX_BATCH_SIZE=1", 1), ("MAX_BATCH_SIZE=1", 2)]
