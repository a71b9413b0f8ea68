"""A real Prometheus on ``monitoring/prometheus.yml`` (only the target replaced) scraping a live server (the
fake step function under real Hypercorn), and every query of every panel of the provisioned Grafana
dashboard evaluated through Prometheus' HTTP API: each must return at least one series.

Needs a ``prometheus`` binary on PATH (``apt-get install prometheus``); installs nothing itself.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from served import fake_server

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "inference-server.json"
RATE_WINDOW = "30s"  # what $__rate_interval stands for here (scrapes every second)
LOAD_SECONDS = 6.0
PROMETHEUS_TIMEOUT = 60.0

pytestmark = pytest.mark.heavy


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, with Grafana's variables substituted."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"].replace("$__rate_interval", RATE_WINDOW).replace("$model_name", ".*"))
            for panel in dashboard["panels"] for target in panel["targets"]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prometheus_config(target: str, path: Path) -> Path:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    [job] = config["scrape_configs"]
    job["static_configs"] = [{"targets": [target]}]
    path.write_text(yaml.safe_dump(config))
    return path


def load(url: str, stop: threading.Event) -> None:
    """Requests from three sessions (the same prompt: prefix-cache hits) and one rejection."""
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/generate", json={"prompt_token_ids": [2] * 500, "max_tokens": 4}).status_code == 400
        i = 0
        while not stop.is_set():
            response = client.post("/generate", json={"prompt": "the capital of france is paris and", "max_tokens": 16,
                                                      "ignore_eos": True, "session_id": f"s{i % 3}"})
            assert response.status_code == 200
            i += 1


def test_every_dashboard_panel_query_returns_a_series(tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary on PATH (apt-get install prometheus); this test installs nothing")
    with fake_server({}, tmp_path / "server.log") as (_, url):
        target = url.removeprefix("http://")
        port = free_port()
        config = prometheus_config(target, tmp_path / "prometheus.yml")
        with (tmp_path / "prometheus.log").open("wb") as log:
            prometheus = subprocess.Popen([binary, f"--config.file={config}",
                                           f"--storage.tsdb.path={tmp_path / 'data'}",
                                           f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
        try:
            api = f"http://127.0.0.1:{port}/api/v1"
            stop = threading.Event()
            workers = [threading.Thread(target=load, args=(url, stop), daemon=True) for _ in range(3)]
            for worker in workers:
                worker.start()
            time.sleep(LOAD_SECONDS)
            stop.set()
            for worker in workers:
                worker.join(60)
            with httpx.Client(timeout=30) as client:
                deadline = time.monotonic() + PROMETHEUS_TIMEOUT
                scrapes = 0.0
                while scrapes < 5 and time.monotonic() < deadline:
                    time.sleep(0.5)
                    try:
                        result = client.get(f"{api}/query", params={"query": "sum(count_over_time(up[1m]))"}).json()
                    except httpx.TransportError:
                        continue  # Prometheus not listening yet
                    scrapes = float(result["data"]["result"][0]["value"][1]) if result["data"]["result"] else 0.0
                assert scrapes >= 5, (tmp_path / "prometheus.log").read_text()[-3000:]
                up = client.get(f"{api}/query", params={"query": "up"}).json()["data"]["result"]
                assert [series["value"][1] for series in up] == ["1"]
                models = client.get(f"{api}/label/model_name/values",
                                    params={"match[]": "vllm:num_requests_running"}).json()["data"]
                assert models == ["tiny-test"]  # the dashboard's model_name variable
                empty = []
                queries = dashboard_queries()
                for title, query in queries:
                    answer = client.get(f"{api}/query", params={"query": query}).json()
                    assert answer["status"] == "success", (title, query, answer)
                    if not answer["data"]["result"]:
                        empty.append((title, query))
                assert not empty, empty
                assert len(queries) >= 14
        finally:
            prometheus.terminate()
            prometheus.wait(30)
