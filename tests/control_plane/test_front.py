"""The front over two fake-model replicas on real sockets (no Ray): a repeated long prefix goes to the replica
that cached it (seen in its prefix-cache hit counter), round robin alternates, streams pass through, and a
replica lost mid-stream ends its requests with an error at the front while the other keeps serving."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack, asynccontextmanager

import attrs
import httpx
import replica_kit
import trio
from http_testkit import word_engine
from replica_kit import FakeReplica, fake_replica, serving_front
from tests.fake_engine import FakeEngine

from control_plane.front import Front
from control_plane.replicas import StaticReplicas
from inference_server.core.block_hashes import chain_hashes

WAIT_SECONDS = 60.0  # generous: the machine may be busy
BLOCK = 4  # the fake engine's KV block size


@attrs.frozen
class Cluster:
    front: Front
    client: httpx.AsyncClient
    replicas: list[FakeReplica]


async def wait_until(condition: Callable[[], bool]) -> None:
    await replica_kit.wait_until(condition, WAIT_SECONDS)


@asynccontextmanager
async def cluster(policy: str, models: list[FakeEngine] | None = None) -> AsyncIterator[Cluster]:
    models = models or [word_engine(), word_engine()]
    with ExitStack() as stack:
        replicas = [stack.enter_context(fake_replica(model)) for model in models]
        front = Front(StaticReplicas([r.url for r in replicas], retry_seconds=0.2), policy)
        async with serving_front(front, WAIT_SECONDS) as client:
            yield Cluster(front, client, replicas)


async def prefix_hits(url: str) -> float:
    return await replica_kit.prefix_hits(url, WAIT_SECONDS)


async def generate(client: httpx.AsyncClient, ids: list[int], **fields: object) -> httpx.Response:
    return await client.post("/generate", json={"prompt_token_ids": ids, "max_tokens": 2, **fields})


async def test_a_repeated_prefix_goes_to_the_replica_that_cached_it() -> None:
    system = list(range(10, 50))  # ten whole blocks
    async with cluster("prefix_aware") as c:
        first = await generate(c.client, [*system, 1])
        assert first.status_code == 200, first.text
        owner = int(first.headers["X-Replica"])
        hashes = chain_hashes([*system, 2], BLOCK)
        await wait_until(lambda: c.front.index.longest_prefixes(hashes).get(owner) == 10)
        for turn in range(2, 6):
            response = await generate(c.client, [*system, turn, turn])
            assert response.status_code == 200 and int(response.headers["X-Replica"]) == owner
        assert await prefix_hits(c.replicas[owner].url) >= 4 * 40
        assert await prefix_hits(c.replicas[1 - owner].url) == 0
        stats = (await c.client.get("/scheduler/stats")).json()
        assert [r["healthy"] for r in stats["replicas"]] == [True, True]
        assert stats["replicas"][owner]["cached_blocks"] >= 10
        metrics = (await c.client.get("/metrics")).text
        assert f'replica="{owner}"' in metrics and "control_plane:routed_requests_total" in metrics


async def test_round_robin_alternates_and_streams_pass_through() -> None:
    async with cluster("round_robin") as c:
        seen = [int((await generate(c.client, [5, 6, 7])).headers["X-Replica"]) for _ in range(4)]
        assert seen in ([0, 1, 0, 1], [1, 0, 1, 0])
        async with c.client.stream("POST", "/v1/completions",
                                   json={"prompt": [5, 6, 7], "max_tokens": 3, "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 2
        missing = await c.client.get("/no/such/route")  # proxied: the replica's JSON 404
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


async def test_a_replica_lost_mid_stream_ends_its_requests_with_an_error() -> None:
    stuck, fine = word_engine(gate=trio.Event()), word_engine()
    async with cluster("least_loaded", [stuck, fine]) as c:
        outcomes: list[object] = []

        async def stream_one() -> None:
            async with c.client.stream("POST", "/generate",
                                       json={"prompt_token_ids": [1, 2, 3], "max_tokens": 5, "stream": True}
                                       ) as response:
                outcomes.append(int(response.headers["X-Replica"]))
                outcomes.extend([line async for line in response.aiter_lines() if line.startswith("data: ")])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_one)
            await wait_until(lambda: c.front.replicas[0].load.in_flight == 1 and stuck.steps == 0
                             and c.replicas[0].engine.scheduler.has_work)
            await trio.to_thread.run_sync(c.replicas[0].kill)
        assert outcomes[0] == 0
        error = json.loads(outcomes[-2].removeprefix("data: "))["error"]
        assert error["code"] == "replica_failed" and outcomes[-1] == "data: [DONE]"
        await wait_until(lambda: not c.front.replicas[0].healthy)
        assert c.front.replicas[0].load.in_flight == 0
        response = await generate(c.client, [1, 2, 3])  # the survivor serves what comes next
        assert response.status_code == 200 and response.headers["X-Replica"] == "1"
