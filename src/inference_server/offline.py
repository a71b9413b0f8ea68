"""Offline Python API: ``LLM(settings).generate(prompts, params)``, through the same actors as the server.

Each ``generate`` call runs the engine under its own ``trio.run``, submits every prompt, collects each
stream to its terminal update and shuts the engine down cleanly.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from inference_server.actors.request_streams import StreamItem
from inference_server.config import Settings
from inference_server.core.request import RequestUpdate
from inference_server.core.sampling import SamplingParams
from inference_server.engine_factory import BuiltEngine, build_engine_parts
from inference_server.messages import Admitted, GenerationRequest, Rejected
from inference_server.supervisor import Engine, EngineParts


@attrs.frozen
class Completion:
    """One finished request: its text, tokens and why it ended."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    error: str | None = None
    logprobs: tuple[float, ...] = ()


async def collect(stream: trio.MemoryReceiveChannel[StreamItem]) -> Completion:
    """Read a request stream to its end."""
    text, tokens, logprobs, prompt_tokens = [], [], [], 0
    async with stream:
        async for item in stream:
            if isinstance(item, Rejected):
                return Completion("", (), "error", 0, error=f"{item.code}: {item.message}")
            if isinstance(item, Admitted):
                prompt_tokens = item.prompt_tokens
                continue
            assert isinstance(item, RequestUpdate)
            for token in item.tokens:
                text.append(token.text)
                tokens.append(token.token_id)
                logprobs.append(token.logprob)
            if item.finish_reason is not None:  # item.finished
                return Completion("".join(text), tuple(tokens), item.finish_reason, prompt_tokens, item.error,
                                  tuple(logprobs))
    return Completion("".join(text), tuple(tokens), "error", prompt_tokens, "the stream ended early")


async def run_engine(parts: EngineParts, requests: Sequence[GenerationRequest]) -> tuple[Engine, list[Completion]]:
    """Start an engine on ``parts``, run ``requests`` concurrently, stop the engine; returns the stopped
    engine (for inspection) and one completion per request, in order."""
    results: list[Completion | None] = [None] * len(requests)
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        async with trio.open_nursery() as clients:
            for index, request in enumerate(requests):
                _, stream = engine.submit(request)

                async def consume(i: int = index, s: trio.MemoryReceiveChannel = stream) -> None:
                    results[i] = await collect(s)

                clients.start_soon(consume)
        engine.close()
    return engine, [r for r in results if r is not None]


async def generate_with(parts: EngineParts, requests: Sequence[GenerationRequest]) -> list[Completion]:
    """The completions of ``requests`` on a fresh engine over ``parts``."""
    _, completions = await run_engine(parts, requests)
    return completions


class LLM:
    """Load a model once; ``generate`` runs batches of prompts through the actor engine."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.built: BuiltEngine = build_engine_parts(settings or Settings())

    @property
    def tokenizer(self):
        return self.built.loaded.tokenizer

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 *, chat: bool = False) -> list[Completion]:
        """Complete each prompt (text, token ids, or a user message when ``chat``)."""
        from inference_server.messages import ChatMessage

        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        requests = []
        for prompt, p in zip(prompts, per_prompt, strict=True):
            if chat:
                requests.append(GenerationRequest(params=p, messages=(ChatMessage("user", str(prompt)),)))
            elif isinstance(prompt, str):
                requests.append(GenerationRequest(params=p, prompt=prompt))
            else:
                requests.append(GenerationRequest(params=p, prompt_ids=tuple(prompt)))
        return trio.run(generate_with, self.built.parts, requests)
