"""The output items of a ``/v1/responses`` reply, in the shapes of openai-python's ``openai.types.responses``
(``ResponseReasoningItem``, ``ResponseOutputMessage``, ``ResponseFunctionToolCall``), whole and as stream events.

The reply's text goes through the chat route's parsers (``chat_output.ChatOutput``: the reasoning section,
then tool calls), and what they return becomes items, in the order the model wrote them:

* ``reasoning`` (only with a reasoning parser, when the reply has a reasoning section): ``content`` is one
  ``reasoning_text`` part holding the reasoning; ``summary`` is empty (no summaries are written), as vLLM's;
* ``message``: an assistant message with one ``output_text`` part (absent when the reply is only calls);
* ``function_call``: one per call, ``call_id`` (``call_...``, what a ``function_call_output`` answers),
  ``name``, ``arguments`` (JSON text), ``id`` (``fc_...``) and ``status``.

Streamed, each item is opened (``response.output_item.added``) when its first text arrives and closed
(``response.output_item.done``) when the next item opens or the reply ends. A message's and a reasoning
item's text arrive in a content part (``response.content_part.added`` / ``.done``) as
``response.output_text.delta`` / ``.done`` and ``response.reasoning_text.delta`` / ``.done``; a call's
arguments as ``response.function_call_arguments.delta`` / ``.done``. A reply with no text at all still has
one (empty) message. Items closed before the end are ``completed``; the last one has the response's status.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import attrs

from inference_server.http.chat_output import ChatOutput

Emit = Callable[[str, dict[str, Any]], None]
"""Sends one stream event: its type and its fields (``sequence_number`` is added by the sender)."""


def new_item_id(prefix: str = "msg") -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def output_message(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def function_call(item_id: str, status: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def whole_output(parser: ChatOutput, text: str, status: str) -> list[dict[str, Any]]:
    """The output items of a whole reply whose text is ``text``."""
    message = parser.message(text)
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_item_id("rs"), status, [reasoning_text(message["reasoning_content"])]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(output_message(new_item_id(), status, [output_text(message.get("content") or "")]))
    for call in calls:
        items.append(function_call(new_item_id("fc"), status, call["id"], call["function"]["name"],
                                   call["function"]["arguments"]))
    return items


@attrs.define
class _OpenItem:
    kind: str  # "reasoning", "message" or "call"
    item_id: str
    output_index: int
    text: list[str] = attrs.Factory(list)
    call_id: str = ""
    name: str = ""

    def located(self) -> dict[str, Any]:
        located = {"item_id": self.item_id, "output_index": self.output_index}
        return located if self.kind == "call" else {**located, "content_index": 0}

    def item(self, status: str) -> dict[str, Any]:
        text = "".join(self.text)
        if self.kind == "reasoning":
            return reasoning_item(self.item_id, status, [reasoning_text(text)] if status != "in_progress" else [])
        if self.kind == "message":
            return output_message(self.item_id, status, [output_text(text)] if status != "in_progress" else [])
        return function_call(self.item_id, status, self.call_id, self.name, text)


class OutputItemStream:
    """A streamed reply's items: fed the parser's deltas, it emits the events that open, fill and close them."""

    def __init__(self, parser: ChatOutput, emit: Emit) -> None:
        self.parser = parser
        self.emit = emit
        self.done: list[dict[str, Any]] = []
        self._open: _OpenItem | None = None

    def feed(self, text: str) -> None:
        self._delta(self.parser.feed(text))

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the reply: the rest the parsers held, then the last item. Returns every item."""
        self._delta(self.parser.finish())
        if self._open is None and not self.done:
            self._start("message")
        self._close(status)
        return self.done

    def abandon(self) -> list[dict[str, Any]]:
        """The items so far, the open one ``incomplete`` (a failure mid-stream); no events."""
        return [*self.done, *([self._open.item("incomplete")] if self._open is not None else [])]

    def _delta(self, delta: dict[str, Any]) -> None:
        if delta.get("reasoning_content"):
            self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            self._text("message", delta["content"])
        for entry in delta.get("tool_calls", ()):
            if "id" in entry:
                self._start("call", call_id=entry["id"], name=entry["function"]["name"])
            arguments = entry["function"].get("arguments")
            if arguments and self._open is not None and self._open.kind == "call":
                self._open.text.append(arguments)
                self.emit("response.function_call_arguments.delta", {**self._open.located(), "delta": arguments})

    def _text(self, kind: str, text: str) -> None:
        if self._open is None or self._open.kind != kind:
            self._start(kind)
        assert self._open is not None
        self._open.text.append(text)
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        self.emit(event, {**self._open.located(), "delta": text, **extra})

    def _start(self, kind: str, *, call_id: str = "", name: str = "") -> None:
        self._close("completed")
        prefix = {"reasoning": "rs", "message": "msg", "call": "fc"}[kind]
        item = self._open = _OpenItem(kind, new_item_id(prefix), len(self.done), call_id=call_id, name=name)
        self.emit("response.output_item.added", {"output_index": item.output_index, "item": item.item("in_progress")})
        if kind != "call":
            part = reasoning_text("") if kind == "reasoning" else output_text("")
            self.emit("response.content_part.added", {**item.located(), "part": part})

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        text, whole = "".join(item.text), item.item(status)
        if item.kind == "call":
            self.emit("response.function_call_arguments.done", {**item.located(), "arguments": text,
                                                                 "name": item.name})
        else:
            kind = "reasoning_text" if item.kind == "reasoning" else "output_text"
            extra: dict[str, Any] = {} if item.kind == "reasoning" else {"logprobs": []}
            self.emit(f"response.{kind}.done", {**item.located(), "text": text, **extra})
            self.emit("response.content_part.done", {**item.located(), "part": whole["content"][0]})
        self.emit("response.output_item.done", {"output_index": item.output_index, "item": whole})
        self.done.append(whole)
