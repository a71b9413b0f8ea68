"""``GET /kv/events``: a snapshot of the prefix cache's chained block hashes, then one numbered batch per step
that changed the cache, and load lines; a new reader's snapshot holds what earlier requests cached."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
from http_testkit import serving_on_socket

from inference_server.core.block_hashes import HASH_SCHEME, chain_hashes

TIMEOUT = 60.0
BLOCK = 4  # the test engine's block size


def feed(url: str) -> Iterator[dict]:
    with httpx.Client(timeout=TIMEOUT) as client, client.stream("GET", f"{url}/kv/events") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        for line in response.iter_lines():
            if line:
                yield json.loads(line)


def test_snapshot_then_numbered_batches_of_the_prompt_s_chained_hashes() -> None:
    prompt = list(range(20, 33))  # three whole blocks and one token
    with serving_on_socket() as server:
        lines = feed(server.url)
        snapshot = next(lines)
        assert snapshot == {"event": "snapshot", "seq": 0, "block_size": BLOCK, "hash_scheme": HASH_SCHEME,
                            "hashes": []}
        response = httpx.post(f"{server.url}/generate", json={"prompt_token_ids": prompt, "max_tokens": 2},
                              timeout=TIMEOUT)
        assert response.status_code == 200
        stored: list[int] = []
        seq = 0
        for line in lines:
            if line["event"] == "kv":
                assert line["seq"] == seq + 1 and line["removed"] == []
                seq = line["seq"]
                stored += line["stored"]
            elif line["event"] == "load" and set(chain_hashes(prompt, BLOCK)) <= set(stored):
                break
        lines.close()
        again = next(feed(server.url))
        assert again["event"] == "snapshot" and again["seq"] >= seq
        assert set(chain_hashes(prompt, BLOCK)) <= set(again["hashes"])
