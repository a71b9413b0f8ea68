"""Helpers of the engine split tests (test_remote_engine, test_engine_process, engine_child): the engine they
serve, requests on the fake model with the tokens it generates for them, and reading a handle to its end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio
from tests.fake_engine import FakeEngine, next_token

from inference_server.actors.request_handle import RequestHandle
from inference_server.core.kv_manager import KVManager
from inference_server.core.scheduler import SchedulerConfig
from inference_server.ipc.remote_engine import RemoteEngine
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import EngineParts


def split_parts(fake: FakeEngine) -> EngineParts:
    """The engine the split tests serve: no tokenizer (requests carry token ids), room for 64 requests."""
    return EngineParts(step=fake, kv=KVManager(block_size=4, num_full_blocks=512), tokenizer=None,
                       max_model_len=1024, vocab_size=512, eos_token_ids=frozenset(),
                       scheduler_config=SchedulerConfig(max_batch_size=64, max_num_batched_tokens=512))


def ids_request(first: int, max_tokens: int, length: int = 5) -> GenerationRequest:
    return GenerationRequest(SamplingParams(temperature=0.0, max_tokens=max_tokens),
                             prompt_ids=tuple(range(first, first + length)))


def expected_tokens(request: GenerationRequest) -> list[int]:
    """What the fake model generates for ``request`` (see tests/fake_engine.py)."""
    assert request.prompt_ids is not None and request.params.max_tokens is not None
    tokens, last, length = [], request.prompt_ids[-1], len(request.prompt_ids)
    for _ in range(request.params.max_tokens):
        last = next_token(length, last)
        tokens.append(last)
        length += 1
    return tokens


async def run_front(remote: RemoteEngine, errors: list[BaseException], *,
                    task_status: trio.TaskStatus[RemoteEngine] = trio.TASK_STATUS_IGNORED) -> None:
    """``remote.run`` for ``nursery.start``; the ``BrokenResourceError`` it ends with when the engine side dies
    (or is taken for hung) is kept in ``errors`` for the test to check, not raised into its nursery."""
    try:
        await remote.run(task_status=task_status)
    except trio.BrokenResourceError as error:
        errors.append(error)


async def read_all(handle: RequestHandle) -> tuple[list[int], list[str | None]]:
    """Every token of ``handle`` and each update's finish reason (the last must be the only one set)."""
    async with handle:
        await handle.admission()
        tokens: list[int] = []
        finishes: list[str | None] = []
        async for update in handle:
            tokens.extend(t.token_id for t in update.tokens)
            finishes.append(update.finish_reason)
    return tokens, finishes


class CharTokenizer:
    """A front's tokenizer for the split tests (``PromptTokenizer``): one id per character (its code point modulo
    the fake model's vocabulary, never 0), a chat template that joins ``role: content`` lines and raises on a
    message whose content is ``"{% bad"``."""

    def __init__(self, vocab_size: int = 512) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + ord(c) % (self.vocab_size - 1) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(96 + i % 26) for i in ids)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
        if any(m.get("content") == "{% bad" for m in messages):
            raise ValueError("unexpected end of template")
        return self.encode("\n".join(f"{m['role']}: {m['content']}" for m in messages))
