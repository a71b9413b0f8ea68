"""FAULTS through the HTTP app: a tokenizer fault fails only its own request (400, the others and the
engine carry on), and ``GET /debug/engine`` reports an idle engine holding nothing afterwards."""

from __future__ import annotations

import trio
from http_testkit import post_stream, word_engine

from inference_server.core.fault_wrappers import FaultyTokenizer
from inference_server.core.faults import FaultDecisions, FaultSpec
from inference_server.http import debug
from inference_server.supervisor import EngineState

SPEC = FaultSpec(tokenizer_error=0.4, seed=3)


def expected_faults(n: int) -> list[bool]:
    decisions = FaultDecisions(SPEC)
    return [decisions.fires("tokenizer_error") for _ in range(n)]


async def test_a_tokenizer_fault_fails_only_that_request(serve, tokenizer) -> None:
    faulty = FaultyTokenizer(tokenizer, FaultDecisions(SPEC))
    async with serve(word_engine(step_seconds=0.01), tokenizer=faulty) as served:
        # A streamed request whose prompt was tokenized first keeps running while the others fail or finish.
        expected = expected_faults(13)
        assert not expected[0]
        streamed: list = []
        async with trio.open_nursery() as nursery:
            async def stream() -> None:
                streamed.append(await post_stream(served.client, "/generate",
                                                  {"prompt": "hello world", "max_tokens": 40, "stream": True}))

            nursery.start_soon(stream)
            with trio.fail_after(30):
                while served.engine.counts().requests == 0:
                    await trio.sleep(0.01)
            statuses = []
            for _ in range(12):
                response = await served.client.post("/generate", json={"prompt": "the capital of", "max_tokens": 3})
                body = await response.get_json()
                statuses.append(response.status_code)
                if response.status_code == 400:
                    assert body["error"]["param"] == "prompt"
                    assert "injected tokenizer_error" in body["error"]["message"]
                else:
                    assert response.status_code == 200 and len(body["token_ids"]) == 3
        assert statuses == [400 if fault else 200 for fault in expected[1:]]
        assert 400 in statuses and 200 in statuses
        (result,) = streamed
        assert result.status == 200 and result.events[-1] == "[DONE]"
        assert result.events[-2]["finish_reason"] == "length"
        assert served.engine.state is EngineState.READY and not served.failures
        with trio.fail_after(30):
            while served.engine.counts().kv_sequences:  # releases go out with the next step
                await trio.sleep(0.01)
        debug = await served.client.get("/debug/engine")
        counts = await debug.get_json()
        assert debug.status_code == 200
        assert counts == {"state": "ready", "requests": 0, "stream_entries": 0, "kv_sequences": 0,
                          "kv_blocks_in_use": 0, "kv_blocks_cached": counts["kv_blocks_cached"]}


async def test_debug_engine_answers_503_when_the_engine_does_not_answer(serve, monkeypatch) -> None:
    """With ``ENGINE_PROCESS=separate`` the counts are a question to the engine process; one that stopped
    answering (SIGSTOP, a hang in a step) used to leave ``GET /debug/engine`` waiting forever (every probe a
    hung connection). It now answers 503 after ``COUNTS_TIMEOUT_SECONDS``; never zeros, which a leak check
    would take for a clean engine."""
    monkeypatch.setattr(debug, "COUNTS_TIMEOUT_SECONDS", 0.2)
    async with serve(word_engine(step_seconds=0.01)) as served:
        async def never_answers() -> None:
            await trio.sleep_forever()

        monkeypatch.setattr(served.state.engine, "read_counts", never_answers)  # the engine the routes ask
        with trio.fail_after(30):
            response = await served.client.get("/debug/engine")
        body = await response.get_json()
        assert response.status_code == 503 and response.headers["Retry-After"]
        assert body["error"]["code"] == "unavailable" and "did not answer" in body["error"]["message"]
