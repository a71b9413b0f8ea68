"""OpenAI response bodies and stream chunks, exactly as openai-python, lm-eval and AIPerf parse them.

Streams (``text/event-stream``, one ``data:`` JSON object per event, then ``data: [DONE]``):

* chat: a first chunk per choice with ``delta: {"role": "assistant", "content": ""}``, then chunks with
  ``delta: {"content": ...}``; the last chunk of a choice carries its ``finish_reason`` (``stop`` or
  ``length``) and whatever text arrived with it (``delta: {}`` when none).
* completions: chunks with ``text``; the last one of a choice carries ``finish_reason``.
* a choice's last chunk (and each choice of a whole response) also says what stopped it: vLLM's
  ``stop_reason`` and SGLang's ``matched_stop`` (``stop_fields``).
* every chunk has ``id`` and ``created`` (the same on all chunks), ``object``, ``model`` and ``choices``
  (one choice per chunk, ``index`` = its position); with ``stream_options.include_usage`` every chunk has
  ``"usage": null`` and a final chunk with ``"choices": []`` carries the totals; with
  ``continuous_usage_stats`` every chunk carries its choice's usage so far.
* an error (the engine failed or shut down, the request timed out in the queue) is an event
  ``{"error": {"message", "type", "param", "code"}}``, then ``[DONE]``.

Streamed ``echo`` (completions): a choice's first chunk starts with its prompt (and, with ``logprobs``, its
logprobs with the prompt's tokens, as in the whole response). Chat ``echo`` (vLLM's): the reply's text starts
with the final message's content when that message is the assistant's (a prefill), in its own chunk after the
role chunk when streamed. ``min_characters`` (vLLM's): a choice's streamed text is held until at least that many
characters are buffered, then sent in one chunk; the last chunk carries the rest.

vLLM's token-id extensions (``OutputOptions``): ``return_token_ids`` adds ``token_ids`` to each choice (to
each chunk's choice when streaming: that chunk's ids) and ``prompt_token_ids`` (on each completion choice, on
its first chunk when streaming; at the top level of a chat response and of its first chunk);
``return_tokens_as_token_ids`` writes every logprobs token as ``token_id:N``.

Logprobs: completions give ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``
(each ``top_logprobs`` dict holds the top-n and the sampled token); chat gives ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``, where ``bytes`` are the token's own
(OpenAI's contract: a character split over byte tokens is their ``bytes`` joined, though each ``token`` alone
reads U+FFFD). Logprobs are those of the raw model distribution (before temperature and penalties), as vLLM
returns them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from inference_server.actors.request_streams import merge
from inference_server.http.chat_output import ChatOutput, ChatOutputSpec, join_deltas
from inference_server.http.errors import ApiError, from_unsuccessful_finish
from inference_server.http.sse import dumps, event, json_string, raw_event
from inference_server.http.state import AppState
from inference_server.http.usage import usage
from inference_server.records.requests import PromptTokenLogprob, RequestUpdate, TokenOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@attrs.frozen
class OutputOptions:
    """vLLM's per-request output extensions (see the module docstring)."""

    token_ids: bool = False
    tokens_as_ids: bool = False
    prompt_token_ids: tuple[tuple[int, ...], ...] = ()  # per choice
    chat_output: ChatOutputSpec | None = None
    """Chat: the tool-call and reasoning parsers the reply goes through (None: plain ``content``)."""

    def token_text(self, state: AppState) -> Callable[[int], str]:
        """How a logprobs entry names a token."""
        return _as_id if self.tokens_as_ids else state.token_text

    def token_bytes(self, state: AppState) -> Callable[[int], list[int]]:
        """A chat logprobs entry's ``bytes``: the token's own (a byte token's byte, not U+FFFD's UTF-8), or
        those of its ``token_id:N`` name."""
        return _as_id_bytes if self.tokens_as_ids else state.token_text.bytes


NO_OPTIONS = OutputOptions()


def _as_id(token_id: int) -> str:
    return f"token_id:{token_id}"


def _as_id_bytes(token_id: int) -> list[int]:
    return list(_as_id(token_id).encode())


# -- logprobs ----------------------------------------------------------------------------------------------


def completion_logprobs(tokens: Sequence[TokenOutput], state: AppState, offset: int,
                        options: OutputOptions = NO_OPTIONS) -> dict[str, Any]:
    """The completions ``logprobs`` object for ``tokens``, whose text starts at ``offset`` in the output."""
    text = options.token_text(state)
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    top = []
    for token in tokens:
        ranked = {text(token_id): logprob for token_id, logprob in token.top_logprobs}
        ranked.setdefault(text(token.token_id), token.logprob)
        top.append(ranked)
    return {"tokens": [text(t.token_id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": top, "text_offset": offsets}


def _echoed_logprobs(prompt: Sequence[PromptTokenLogprob], tokens: Sequence[TokenOutput],
                     state: AppState, options: OutputOptions = NO_OPTIONS) -> dict[str, Any]:
    """The completions ``logprobs`` object with the prompt's tokens first (OpenAI's ``echo``): the first
    prompt token's logprob and top dict are ``null``; each other top dict holds the top-n and the prompt
    token. ``text_offset`` counts every token's string from 0, prompt then output (vLLM's rule); tokens are
    named as ``options`` say (``token_id:N`` with ``return_tokens_as_token_ids``)."""
    name = options.token_text(state)
    tokens_out, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for entry in prompt:
        tokens_out.append(name(entry.token_id))
        token_logprobs.append(entry.logprob)
        ranked: dict[str, float] | None = None
        if entry.logprob is not None:
            ranked = {name(token_id): logprob for token_id, logprob in entry.top_logprobs}
            ranked.setdefault(name(entry.token_id), entry.logprob)
        top.append(ranked)
        offsets.append(offset)
        offset += len(state.token_text(entry.token_id))
    completion = completion_logprobs(tokens, state, offset, options)
    return {"tokens": tokens_out + completion["tokens"],
            "token_logprobs": token_logprobs + completion["token_logprobs"],
            "top_logprobs": top + completion["top_logprobs"], "text_offset": offsets + completion["text_offset"]}


def vllm_prompt_logprobs(prompt: Sequence[PromptTokenLogprob], state: AppState) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: ``null`` for the first token, then ``{token id: {"logprob",
    "decoded_token"}}`` with the prompt token and the top-n."""
    out: list[dict[str, Any] | None] = []
    for entry in prompt:
        if entry.logprob is None:
            out.append(None)
            continue
        pairs = dict(entry.top_logprobs)
        pairs.setdefault(entry.token_id, entry.logprob)
        out.append({str(i): {"logprob": lp, "decoded_token": state.token_text(i)} for i, lp in pairs.items()})
    return out


def _chat_token(token_id: int, logprob: float, name: Callable[[int], str],
                token_bytes: Callable[[int], list[int]]) -> dict[str, Any]:
    return {"token": name(token_id), "logprob": logprob, "bytes": token_bytes(token_id)}


def chat_logprobs(tokens: Sequence[TokenOutput], state: AppState,
                  options: OutputOptions = NO_OPTIONS) -> list[dict[str, Any]]:
    """The chat ``logprobs.content`` entries for ``tokens``."""
    name, token_bytes = options.token_text(state), options.token_bytes(state)
    return [{**_chat_token(t.token_id, t.logprob, name, token_bytes),
             "top_logprobs": [_chat_token(i, lp, name, token_bytes) for i, lp in t.top_logprobs]} for t in tokens]


def stop_fields(update: RequestUpdate) -> dict[str, Any]:
    """What ended a finished choice, as both peers name it (neither is OpenAI's; its SDK keeps unknown fields):
    vLLM's ``stop_reason``, the matched stop string or stop token id (null for EOS and for ``length``), and
    SGLang's ``matched_stop``, the same but the EOS token's id for an EOS finish."""
    matched = update.stop_reason
    if matched is None and update.finish_reason == "stop" and update.tokens:
        matched = update.tokens[-1].token_id
    return {"stop_reason": update.stop_reason, "matched_stop": matched}


# -- shared bookkeeping ------------------------------------------------------------------------------------


class _Choices:
    """Per-choice token counts and text offsets, and the request's usage totals."""

    def __init__(self, prompt_tokens: Sequence[int], n: int) -> None:
        self.prompt_tokens = list(prompt_tokens)
        self.n = n
        self.completion_tokens = [0] * len(prompt_tokens)
        self.text_offsets = [0] * len(prompt_tokens)
        self.cached_tokens = [0] * len(prompt_tokens)

    def record(self, index: int, update: RequestUpdate) -> int:
        """Count ``update``'s tokens; returns the text offset they start at."""
        offset = self.text_offsets[index]
        self.completion_tokens[index] += len(update.tokens)
        self.text_offsets[index] += sum(len(t.text) for t in update.tokens)
        if update.finished:
            self.cached_tokens[index] = update.cached_prompt_tokens
        return offset

    def choice_usage(self, index: int) -> dict[str, Any]:
        return usage(self.prompt_tokens[index], self.completion_tokens[index], self.cached_tokens[index])

    def total_usage(self) -> dict[str, Any]:
        """Prompt tokens count once per prompt (not once per choice), as in the OpenAI API."""
        firsts = range(0, len(self.prompt_tokens), self.n)
        return usage(sum(self.prompt_tokens[i] for i in firsts), sum(self.completion_tokens),
                     sum(self.cached_tokens[i] for i in firsts))


class _ChunkEncoder:
    """What chat and completion chunk encoders share: the fixed head, usage, errors."""

    object_name = ""

    def __init__(self, state: AppState, response_id: str, prompt_tokens: Sequence[int], n: int, *,
                 with_logprobs: bool, include_usage: bool, continuous_usage: bool,
                 options: OutputOptions = NO_OPTIONS, min_characters: int = 0) -> None:
        self.state = state
        self.min_characters = min_characters
        self._held: list[RequestUpdate | None] = [None] * len(prompt_tokens)
        self.options = options
        self._prompt_ids_sent = [False] * len(prompt_tokens)
        self.choices = _Choices(prompt_tokens, n)
        self.with_logprobs = with_logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        head = dumps({"id": response_id, "object": self.object_name, "created": int(time.time()),
                      "model": state.model_name})
        self._head = head[:-1] + ',"choices":['  # every chunk starts the same way
        # The common chunk (text only, no logprobs, token ids or finish) is spliced from these pre-encoded
        # parts around the text: no dict and no ``dumps`` per event.
        self._plain = not (with_logprobs or continuous_usage or options.token_ids or options.chat_output)
        self._plain_tail = "]" + (',"usage":null' if include_usage else "") + "}"

    def _release(self, index: int, update: RequestUpdate) -> RequestUpdate | None:
        """``update`` with whatever ``min_characters`` held of choice ``index`` before it, once the text
        reaches ``min_characters`` or the choice finishes; ``None`` while it is held (nothing to send)."""
        if not self.min_characters:
            return update
        held = self._held[index]
        if held is not None:
            update = merge(held, update)
        if update.finished or sum(len(t.text) for t in update.tokens) >= self.min_characters:
            self._held[index] = None
            return update
        self._held[index] = update
        return None

    def _chunk(self, choice: dict[str, Any] | None, index: int) -> bytes:
        tail = "]"
        if self.continuous_usage:
            tail += ',"usage":' + dumps(self.choices.choice_usage(index))
        elif self.include_usage:
            tail += ',"usage":null'
        return raw_event(self._head + ("" if choice is None else dumps(choice)) + tail + "}")

    def failure(self, index: int, update: RequestUpdate) -> bytes:
        failed = self.state.engine.failed
        return event(from_unsuccessful_finish(update, engine_failed=failed).body())

    def closing(self) -> bytes:
        if not self.include_usage:
            return b""
        return raw_event(self._head + '],"usage":' + dumps(self.choices.total_usage()) + "}")

    def error(self, error: ApiError) -> bytes:
        return event(error.body())


class CompletionEncoder(_ChunkEncoder):
    """``text_completion`` chunks for ``/v1/completions``."""

    object_name = "text_completion"

    def __init__(self, *args: Any, echo_prompts: Sequence[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.echo_prompts = echo_prompts
        self._echo_pending = [echo_prompts is not None] * len(self.choices.prompt_tokens)
        self._echo_offset = [0] * len(self.choices.prompt_tokens)  # the prompt's token strings, for text_offset

    def opening(self) -> bytes:
        return b""

    def update(self, index: int, update: RequestUpdate) -> bytes:
        released = self._release(index, update)
        if released is None:
            return b""
        update = released
        offset = self.choices.record(index, update)
        if not update.tokens and not update.finished:
            return b""
        if self._echo_pending[index]:
            return self._echo_chunk(index, update)
        offset += self._echo_offset[index]
        if self._plain and not update.finished:
            text = json_string("".join([t.text for t in update.tokens]))
            return raw_event(f'{self._head}{{"index":{index},"text":{text},"logprobs":null,"finish_reason":null}}'
                             f'{self._plain_tail}')
        logprobs = completion_logprobs(update.tokens, self.state, offset, self.options) if self.with_logprobs \
            else None
        choice = {"index": index, "text": "".join(t.text for t in update.tokens), "logprobs": logprobs,
                  "finish_reason": update.finish_reason}
        if update.finished:
            choice |= stop_fields(update)
        if self.options.token_ids:
            choice["token_ids"] = [t.token_id for t in update.tokens]
            if not self._prompt_ids_sent[index]:
                self._prompt_ids_sent[index] = True
                choice["prompt_token_ids"] = list(self.options.prompt_token_ids[index])
        return self._chunk(choice, index)

    def _echo_chunk(self, index: int, update: RequestUpdate) -> bytes:
        """A choice's first chunk under ``echo``: its prompt, then its text (and logprobs, prompt first)."""
        assert self.echo_prompts is not None
        self._echo_pending[index] = False
        prompt = update.prompt_logprobs or ()
        self._echo_offset[index] = sum(len(self.state.token_text(entry.token_id)) for entry in prompt)
        logprobs = _echoed_logprobs(prompt, update.tokens, self.state, self.options) if self.with_logprobs \
            else None
        choice = {"index": index, "text": self.echo_prompts[index] + "".join(t.text for t in update.tokens),
                  "logprobs": logprobs, "finish_reason": update.finish_reason}
        if update.finished:
            choice |= stop_fields(update)
        if self.options.token_ids:
            choice["token_ids"] = [t.token_id for t in update.tokens]
            self._prompt_ids_sent[index] = True
            choice["prompt_token_ids"] = list(self.options.prompt_token_ids[index])
        return self._chunk(choice, index)


class ChatEncoder(_ChunkEncoder):
    """``chat.completion.chunk`` chunks for ``/v1/chat/completions``."""

    object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, echo: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo
        self._outputs: dict[int, ChatOutput] = {}  # per choice, with ``options.chat_output``

    def opening(self) -> bytes:
        chunks = []
        for index in range(len(self.choices.prompt_tokens)):
            chunk = self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}, index)
            if self.options.token_ids and index == 0 and self.options.prompt_token_ids:
                ids = dumps(list(self.options.prompt_token_ids[0]))
                chunk = chunk.replace(b',"choices":[', b',"prompt_token_ids":' + ids.encode() + b',"choices":[', 1)
            chunks.append(chunk)
            if self.echo:  # vLLM's echo: the continued message's text, before anything generated
                chunks.append(self._chunk({"index": index, "delta": {"content": self.echo}, "logprobs": None,
                                           "finish_reason": None}, index))
        return b"".join(chunks)

    def update(self, index: int, update: RequestUpdate) -> bytes:
        released = self._release(index, update)
        if released is None:
            return b""
        update = released
        self.choices.record(index, update)
        text = "".join([t.text for t in update.tokens])
        if self.options.chat_output is not None:
            return self._parsed_update(index, update, text)
        if not text and not update.finished and not (self.with_logprobs and update.tokens):
            return b""
        if self._plain and not update.finished:
            return raw_event(f'{self._head}{{"index":{index},"delta":{{"content":{json_string(text)}}}'
                             f',"logprobs":null,"finish_reason":null}}{self._plain_tail}')
        logprobs = {"content": chat_logprobs(update.tokens, self.state, self.options)} if self.with_logprobs \
            else None
        choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                  "finish_reason": update.finish_reason}
        if update.finished:
            choice |= stop_fields(update)
        if self.options.token_ids:
            choice["token_ids"] = [t.token_id for t in update.tokens]
        return self._chunk(choice, index)

    def _parsed_update(self, index: int, update: RequestUpdate, text: str) -> bytes:
        """A chunk whose delta went through the reply's parsers: ``reasoning_content``, ``content`` and
        ``tool_calls`` as they complete; the last chunk says ``tool_calls`` when a call was made."""
        output = self._outputs.get(index)
        if output is None:
            assert self.options.chat_output is not None
            output = self._outputs[index] = self.options.chat_output.processor()
        delta = output.feed(text) if text else {}
        finish_reason: str | None = update.finish_reason
        if update.finished:
            delta = join_deltas(delta, output.finish())
            if finish_reason == "stop" and output.called:
                finish_reason = "tool_calls"
        per_token = not output.spec.hides_reasoning  # hidden reasoning: no logprobs or ids that would show it
        with_logprobs = self.with_logprobs and per_token
        if not delta and not update.finished and not (with_logprobs and update.tokens):
            return b""
        logprobs = {"content": chat_logprobs(update.tokens, self.state, self.options)} if with_logprobs else None
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if update.finished:
            choice |= stop_fields(update)
        if self.options.token_ids and per_token:
            choice["token_ids"] = [t.token_id for t in update.tokens]
        return self._chunk(choice, index)


# -- whole (non-streamed) responses ------------------------------------------------------------------------


def completion_response(state: AppState, response_id: str, results: Sequence[RequestUpdate],
                        prompt_tokens: Sequence[int], n: int, *, with_logprobs: bool,
                        echo_prompts: Sequence[str] | None = None, with_prompt_logprobs: bool = False,
                        options: OutputOptions = NO_OPTIONS) -> dict[str, Any]:
    """The whole completions body; ``echo_prompts`` (one per choice) puts each prompt before its choices'
    text and its tokens before their logprobs; ``with_prompt_logprobs`` adds vLLM's ``prompt_logprobs``;
    ``options`` are vLLM's output extensions (``return_token_ids``, ...)."""
    choices = _Choices(prompt_tokens, n)
    out = []
    for index, result in enumerate(results):
        choices.record(index, result)
        echoed = echo_prompts[index] if echo_prompts is not None else ""
        logprobs = None
        if with_logprobs and echo_prompts is not None:
            logprobs = _echoed_logprobs(result.prompt_logprobs or (), result.tokens, state, options)
        elif with_logprobs:
            logprobs = completion_logprobs(result.tokens, state, 0, options)
        choice = {"index": index, "text": echoed + "".join(t.text for t in result.tokens), "logprobs": logprobs,
                  "finish_reason": result.finish_reason, **stop_fields(result)}
        if with_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(result.prompt_logprobs or (), state)
        if options.token_ids:
            choice["prompt_token_ids"] = list(options.prompt_token_ids[index])
            choice["token_ids"] = [t.token_id for t in result.tokens]
        out.append(choice)
    return {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
            "choices": out, "usage": choices.total_usage()}


def chat_response(state: AppState, response_id: str, results: Sequence[RequestUpdate],
                  prompt_tokens: Sequence[int], n: int, *, with_logprobs: bool,
                  options: OutputOptions = NO_OPTIONS, echo: str = "",
                  with_prompt_logprobs: bool = False) -> dict[str, Any]:
    """The whole chat body; ``echo`` starts every reply's content (vLLM's chat ``echo``);
    ``with_prompt_logprobs`` adds vLLM's top-level ``prompt_logprobs`` (the prompt is the same for every
    choice)."""
    choices = _Choices(prompt_tokens, n)
    out = []
    for index, result in enumerate(results):
        choices.record(index, result)
        per_token = options.chat_output is None or not options.chat_output.hides_reasoning
        logprobs = {"content": chat_logprobs(result.tokens, state, options)} if with_logprobs and per_token \
            else None
        text = "".join(t.text for t in result.tokens)
        finish_reason: str | None = result.finish_reason
        if options.chat_output is not None:
            output = options.chat_output.processor()
            message = output.message(text)
            if finish_reason == "stop" and output.called:
                finish_reason = "tool_calls"
            if echo:  # the continued message's text comes first, as it was sent
                message["content"] = echo + (message.get("content") or "")
        else:
            message = {"role": "assistant", "content": echo + text}
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                  **stop_fields(result)}
        if options.token_ids and per_token:
            choice["token_ids"] = [t.token_id for t in result.tokens]
        out.append(choice)
    body = {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
            "choices": out, "usage": choices.total_usage()}
    if options.token_ids and options.prompt_token_ids:
        body["prompt_token_ids"] = list(options.prompt_token_ids[0])
    if with_prompt_logprobs:
        body["prompt_logprobs"] = vllm_prompt_logprobs(results[0].prompt_logprobs or (), state) if results else []
    return body
