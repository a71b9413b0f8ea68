"""Two replicas of the embedded model as Ray actors on a local Ray (one per module), behind the front: a
repeated long prefix goes to the replica that cached it (its prefix-cache hit counter), and a replica killed
mid-run is replaced by Ray while its in-flight streams end with an error and the other replica's finish."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import httpx
import pytest
import replica_kit
import trio
from replica_kit import serving_front

from control_plane.front import Front
from control_plane.ray_replica import RayReplicas, settings_overrides
from inference_server.config import load_settings

WAIT_SECONDS = 180.0  # generous: two model replicas share two busy cores
SYSTEM_PROMPT = ("You are a careful assistant for a geography quiz. Answer in one short sentence, name the "
                 "country and the continent, and never add anything else. ") * 3


@pytest.fixture(scope="module")
def replicas() -> Iterator[RayReplicas]:
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        settings = load_settings(overrides={"ACCESS_LOG": "false", "MAX_BATCH_SIZE": "4"}, dotenv_path=None)
        source = RayReplicas(2, settings_overrides(settings), num_gpus=0, num_cpus=1, sequential=True)
        try:
            yield source
        finally:
            source.shutdown()
    finally:
        ray.shutdown()


async def wait_until(condition: Callable[[], bool]) -> None:
    await replica_kit.wait_until(condition, WAIT_SECONDS)


@asynccontextmanager
async def front_over(replicas: RayReplicas, policy: str) -> AsyncIterator[tuple[Front, httpx.AsyncClient]]:
    from inference_server.models.loading.source import load_tokenizer

    front = Front(replicas, policy, load_tokenizer(load_settings(dotenv_path=None)))
    async with serving_front(front, WAIT_SECONDS) as client:
        yield front, client


async def prefix_hits(url: str) -> float:
    return await replica_kit.prefix_hits(url, WAIT_SECONDS)


async def test_a_repeated_long_prefix_goes_to_the_replica_that_cached_it(replicas: RayReplicas) -> None:
    async with front_over(replicas, "prefix_aware") as (front, client):
        urls = [r.url for r in front.replicas]
        before = [await prefix_hits(url) for url in urls]  # type: ignore[arg-type]
        first = await client.post("/v1/completions", json={"prompt": SYSTEM_PROMPT + "Where is Lima?",
                                                             "max_tokens": 2})
        assert first.status_code == 200, first.text
        owner = int(first.headers["X-Replica"])
        await wait_until(lambda: front.index.num_blocks(owner) >= 4)
        for city in ("Oslo", "Quito", "Hanoi"):
            response = await client.post("/v1/chat/completions" if city == "Quito" else "/v1/completions",
                                         json={"prompt": SYSTEM_PROMPT + f"Where is {city}?", "max_tokens": 2}
                                         if city != "Quito" else
                                         {"messages": [{"role": "user", "content": SYSTEM_PROMPT}], "max_tokens": 2})
            assert response.status_code == 200, response.text
            if city != "Quito":  # the chat template wraps the text differently: another prefix
                assert int(response.headers["X-Replica"]) == owner
        after = [await prefix_hits(url) for url in urls]  # type: ignore[arg-type]
        assert after[owner] - before[owner] >= 2 * 4 * front.replicas[owner].block_size  # type: ignore[operator]
        assert after[1 - owner] == before[1 - owner]


async def test_a_replica_killed_mid_run_is_replaced_and_its_streams_end_with_an_error(replicas: RayReplicas) -> None:
    import ray

    async with front_over(replicas, "round_robin") as (front, client):
        results: dict[int, tuple[int, list[str]]] = {}
        # ignore_eos: a surviving stream ends by length whatever its sampled text (temperature 1, unseeded)

        async def stream(index: int) -> None:
            async with client.stream("POST", "/generate", json={"prompt": f"Story {index}: once upon a time",
                                                                 "max_tokens": 60, "stream": True,
                                                                 "ignore_eos": True}) as response:
                lines: list[str] = []
                results[index] = (int(response.headers["X-Replica"]), lines)
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line.removeprefix("data: "))

        old_url = front.replicas[0].url
        async with trio.open_nursery() as nursery:
            for index in range(3):
                nursery.start_soon(stream, index)
                await wait_until(lambda index=index: index in results)
            await wait_until(lambda: all(len(lines) >= 2 for _, lines in results.values()))
            victim = results[0][0]
            ray.kill(replicas.actors[victim], no_restart=False)
        for replica, lines in results.values():
            if replica == victim:
                assert json.loads(lines[-2])["error"]["code"] == "replica_failed" and lines[-1] == "[DONE]"
            else:
                assert json.loads(lines[-2])["finish_reason"] == "length" and lines[-1] == "[DONE]"
        assert sum(replica == victim for replica, _ in results.values()) == 2
        await wait_until(lambda: front.replicas[victim].healthy and front.replicas[victim].url != old_url)
        assert front.replicas[victim].losses >= 1
        for _ in range(2):  # round robin: one of these lands on the replacement
            response = await client.post("/generate", json={"prompt": "Hello", "max_tokens": 2})
            assert response.status_code == 200, response.text
