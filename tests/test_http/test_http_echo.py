"""``echo`` and prompt logprobs on ``/v1/completions`` and ``/generate``, against the fake model (whose
prompt logprob at position p is ``fake_prompt_logprob(p)`` and whose top-k there is ``fake_prompt_top``): the
legacy OpenAI shape lm-eval's ``local-completions`` reads, for text, token-id and batched prompts, with
``max_tokens`` 0 and 1."""

from __future__ import annotations

import pytest
from http_testkit import fake_prompt_logprob, fake_prompt_top, fake_token

COMPLETIONS = "/v1/completions"


async def completion(served, body: dict) -> dict:
    response = await served.client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, await response.get_data()
    return await response.get_json()


def word(token_id: int) -> str:
    return f"w{token_id - fake_token(0)}"


@pytest.mark.parametrize("max_tokens", [0, 1])
async def test_echo_token_id_prompts_as_lm_eval_sends_them(serve, max_tokens: int) -> None:
    """lm-eval's loglikelihood request: token-id lists, echo, logprobs 1; one choice per prompt, in order."""
    prompts = [[2, 9, 10], [2, 9, 10, 11, 12]]
    async with serve() as served:
        payload = await completion(served, {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
                                            "temperature": 0})
        assert [c["index"] for c in payload["choices"]] == [0, 1]
        for prompt, choice in zip(prompts, payload["choices"], strict=True):
            logprobs = choice["logprobs"]
            length = len(prompt) + max_tokens
            assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == length
            assert len(logprobs["top_logprobs"]) == len(logprobs["text_offset"]) == length
            assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
            assert logprobs["token_logprobs"][1:len(prompt)] == [fake_prompt_logprob(p) for p in range(1, len(prompt))]
            for position in range(1, len(prompt)):
                ((best, best_logprob),) = fake_prompt_top(position, 1)
                expected = {served.state.token_text(best): best_logprob,
                            served.state.token_text(prompt[position]): fake_prompt_logprob(position)}
                assert logprobs["top_logprobs"][position] == expected
            assert logprobs["tokens"][:len(prompt)] == [served.state.token_text(t) for t in prompt]
            assert choice["finish_reason"] == "length"
            if max_tokens:
                assert logprobs["tokens"][-1] == word(fake_token(len(prompt)))
                assert logprobs["token_logprobs"][-1] == -0.25
            strings = logprobs["tokens"]
            assert logprobs["text_offset"] == [sum(map(len, strings[:i])) for i in range(len(strings))]
        assert payload["usage"]["prompt_tokens"] == 8
        assert payload["usage"]["completion_tokens"] == 2 * max_tokens
        assert served.kv_is_idle()


async def test_echo_text_prompt_puts_the_prompt_before_the_output(serve, tokenizer) -> None:
    async with serve() as served:
        payload = await completion(served, {"prompt": "the capital of france is", "echo": True, "max_tokens": 2,
                                            "logprobs": 0})
        (choice,) = payload["choices"]
        prompt_ids = tokenizer.encode("the capital of france is")  # <bos> first
        assert choice["text"] == "the capital of france is" + f" {word(fake_token(6))} {word(fake_token(7))}"
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [served.state.token_text(t) for t in prompt_ids] + ["w6", "w7"]
        assert logprobs["token_logprobs"] == [None] + [fake_prompt_logprob(p) for p in range(1, 6)] + [-0.25, -0.25]
        assert logprobs["top_logprobs"][1] == {"the": fake_prompt_logprob(1)}  # logprobs 0: only the token
        prompt_end = sum(len(served.state.token_text(t)) for t in prompt_ids)  # token strings from 0, as vLLM
        assert logprobs["text_offset"][-3:] == [prompt_end - len("is"), prompt_end, prompt_end + len(" w6")]


async def test_echo_without_logprobs_and_token_id_prompt_text(serve) -> None:
    async with serve() as served:
        # token ids are echoed without their special tokens (SGLang's rule: echo(encode(text)) starts with text)
        for prompt, text in [([2, 9, 10], "the capital"), ("hello", "hello")]:
            payload = await completion(served, {"prompt": prompt, "echo": True, "max_tokens": 0})
            (choice,) = payload["choices"]
            assert choice["text"] == text
            assert choice["logprobs"] is None and choice["finish_reason"] == "length"
            assert payload["usage"]["completion_tokens"] == 0


async def test_echo_with_n_repeats_the_prompt_per_choice(serve) -> None:
    async with serve() as served:
        payload = await completion(served, {"prompt": ["hello", "hello world"], "n": 2, "echo": True,
                                            "max_tokens": 1})
        texts = [c["text"] for c in payload["choices"]]
        assert texts == ["hello w2", "hello w2", "hello world w3", "hello world w3"]


async def test_prompt_logprobs_field_in_vllm_shape(serve) -> None:
    async with serve() as served:
        payload = await completion(served, {"prompt": [2, 9, 10], "prompt_logprobs": 2, "max_tokens": 1})
        (choice,) = payload["choices"]
        assert choice["text"] == " w3" and choice["logprobs"] is None
        prompt_logprobs = choice["prompt_logprobs"]
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == 3
        for position, token in [(1, 9), (2, 10)]:
            expected = {str(i): {"logprob": lp, "decoded_token": served.state.token_text(i)}
                        for i, lp in fake_prompt_top(position, 2)}
            expected[str(token)] = {"logprob": fake_prompt_logprob(position),
                                    "decoded_token": served.state.token_text(token)}
            assert prompt_logprobs[position] == expected


@pytest.mark.parametrize("stream", [False, True])
async def test_generate_prompt_logprobs(serve, stream: bool) -> None:
    async with serve() as served:
        body = {"prompt_token_ids": [2, 9, 10, 11], "max_tokens": 2, "prompt_logprobs": 1, "stream": stream}
        response = await served.client.post("/generate", json=body)
        assert response.status_code == 200
        if stream:
            import json
            events = [json.loads(line[6:]) for line in (await response.get_data(as_text=True)).splitlines()
                      if line.startswith("data: {")]
            carrying = [e for e in events if "prompt_logprobs" in e]
            assert len(carrying) == 1 and carrying[0] is events[0]
            prompt_logprobs = carrying[0]["prompt_logprobs"]
        else:
            prompt_logprobs = (await response.get_json())["prompt_logprobs"]
        assert prompt_logprobs[0] is None
        assert prompt_logprobs[1:] == [
            {"token_id": t, "logprob": fake_prompt_logprob(p), "top_logprobs": [list(x) for x in fake_prompt_top(p, 1)]}
            for p, t in [(1, 9), (2, 10), (3, 11)]]


async def test_scoring_only_generate_with_max_tokens_zero(serve) -> None:
    async with serve() as served:
        body = {"prompt_token_ids": [2, 9], "max_tokens": 0, "prompt_logprobs": 0}
        payload = await (await served.client.post("/generate", json=body)).get_json()
        assert payload["token_ids"] == [] and payload["finish_reason"] == "length"
        assert payload["prompt_logprobs"] == [None, {"token_id": 9, "logprob": fake_prompt_logprob(1),
                                                     "top_logprobs": []}]
        assert payload["usage"]["completion_tokens"] == 0
