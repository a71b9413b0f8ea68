"""Every metric family present and moving during a CPU run of ``inference-server serve`` on the embedded
model (heavy: loads Gemma 3 270M), with a KV pool small enough that requests get preempted (560 tokens of
budget: one 512-token sliding window, and about 800 full-attention tokens for eight 140-token requests)."""

from __future__ import annotations

import signal
import sqlite3
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_http"))
from http_testkit import MOVING_FAMILIES
from served import fake_server

pytestmark = pytest.mark.heavy
# About 40 tokens: two whole 16-token blocks, which the prefix cache keeps for the last request.
PROMPT = ("The history of the city of Paris begins with a small settlement of fishermen on an island in the "
          "river Seine, where a Celtic tribe called the Parisii built their houses and traded")
OUTPUT_TOKENS = 100


def scrape(client: httpx.Client) -> dict[str, dict[str, float]]:
    families: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        samples = families.setdefault(family.name, {})  # present even before its first labelled sample
        for sample in family.samples:
            samples[sample.name + repr(sorted(sample.labels.items()))] = sample.value
    return families


def total(families: dict[str, dict[str, float]], family: str, suffix: str) -> float:
    return sum(v for k, v in families.get(family, {}).items() if k.startswith(family + suffix + "["))


def test_every_family_moves_on_the_embedded_model(tmp_path: Path) -> None:
    env = {"MODEL": "", "DEVICE": "cpu", "KV_CACHE_TOKENS": "560", "MAX_BATCH_SIZE": "8",
           "TELEMETRY_DIR": str(tmp_path / "telemetry"), "TIMELINE_DIR": str(tmp_path / "timeline")}
    command = [sys.executable, "-m", "inference_server", "serve"]
    with fake_server(env, tmp_path / "server.log", command=command) as (process, url), \
            httpx.Client(base_url=url, timeout=300) as client:
        before = scrape(client)
        assert set(MOVING_FAMILIES) <= set(before), set(MOVING_FAMILIES) - set(before)
        peaks: dict[str, float] = {}
        done = threading.Event()

        def poll() -> None:
            with httpx.Client(base_url=url, timeout=60) as poller:
                while not done.wait(0.1):
                    families = scrape(poller)
                    for family, suffix in MOVING_FAMILIES.items():
                        if suffix == "":
                            peaks[family] = max([peaks.get(family, 0.0), *families.get(family, {}).values()])

        def requests(session: str) -> None:
            with httpx.Client(base_url=url, timeout=300) as worker:
                response = worker.post("/generate", json={"prompt": PROMPT, "max_tokens": OUTPUT_TOKENS,
                                                          "ignore_eos": True, "session_id": session})
                assert response.status_code == 200, response.text

        threads = [threading.Thread(target=poll, daemon=True)]
        threads += [threading.Thread(target=requests, args=(f"s{i % 4}",), daemon=True) for i in range(8)]
        for thread in threads:
            thread.start()
        assert client.post("/generate", json={"prompt_token_ids": [2] * 5000, "max_tokens": 4}).status_code == 400
        for thread in threads[1:]:
            thread.join(600)
        requests("s0")  # alone, after the others: its prompt's blocks are in the prefix cache
        done.set()
        threads[0].join(60)
        after = scrape(client)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    for family, suffix in MOVING_FAMILIES.items():
        if suffix == "":
            assert peaks.get(family, 0.0) > 0, family
        else:
            assert total(after, family, suffix) > total(before, family, suffix), family
    [run_file] = (tmp_path / "telemetry").glob("run-*.sqlite")
    with sqlite3.connect(run_file) as db:
        assert db.execute("SELECT count(*), sum(output_tokens) FROM requests").fetchone() == (9, 9 * OUTPUT_TOKENS)
        assert db.execute("SELECT sum(preempted) FROM steps").fetchone()[0] > 0
