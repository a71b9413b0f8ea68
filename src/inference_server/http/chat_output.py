"""A chat choice's output text turned into OpenAI's message fields: ``reasoning_content``, ``content`` and
``tool_calls``, whole or as stream deltas.

The text goes first through the reasoning parser (the section at the start), then the answer through the
tool-call parser. Which parsers run (``TOOL_CALL_PARSER`` / ``REASONING_PARSER``, ``auto`` by default) is
decided once at start-up from the served chat template, which follows the model family:

* tool calls: a template that writes ``<|tool_call>`` is Gemma 4's format (``gemma4``); one that writes
  ``<tool_call>`` is Hermes (``hermes``: Qwen2.5/Qwen3, and the embedded Gemma 3 template); otherwise none.
* reasoning: ``<|channel>`` is Gemma 4's thinking channel (``gemma4``), ``<think>`` Qwen3's (``qwen3``);
  otherwise none (the embedded Gemma 3 has no thinking).

Tool calls are parsed only when the request sends ``tools`` and its ``tool_choice`` is not ``none``; the
reasoning parser runs on every chat reply of a model that has one.
"""

from __future__ import annotations

from typing import Any

import attrs

from inference_server.http import reasoning_parsers, tool_parsers
from inference_server.http.errors import invalid_request
from inference_server.http.reasoning_parsers import ReasoningFormat, ReasoningStream
from inference_server.http.tool_parsers import ToolCallFormat, ToolCallStream, merge_deltas


def auto_tool_parser(template: str | None) -> str | None:
    if not template:
        return None
    if tool_parsers.GEMMA4.start in template:
        return "gemma4"
    if tool_parsers.HERMES.start in template:
        return "hermes"
    return None


def auto_reasoning_parser(template: str | None) -> str | None:
    if not template:
        return None
    if "<|channel>" in template:
        return "gemma4"
    if "<think>" in template:
        return "qwen3"
    return None


def resolve_parsers(tool_setting: str, reasoning_setting: str,
                    template: str | None) -> tuple[ToolCallFormat | None, ReasoningFormat | None]:
    """The formats the settings name (``auto``: by the served template; ``none``: off)."""
    tool = auto_tool_parser(template) if tool_setting == "auto" else tool_setting
    reasoning = auto_reasoning_parser(template) if reasoning_setting == "auto" else reasoning_setting
    return (tool_parsers.FORMATS.get(tool) if tool else None,
            reasoning_parsers.FORMATS.get(reasoning) if reasoning else None)


@attrs.frozen
class ChatOutputSpec:
    """What one request's choices parse: the tool format (None: no tool parsing), the names of its tools,
    ``parallel_tool_calls``, the reasoning format (None: none), whether the reasoning section is shown
    (vLLM's ``include_reasoning``: false parses it out of the reply and drops it) and whether it streams as it
    is written (SGLang's ``stream_reasoning``: false holds it back until the section closes, then sends it in
    one delta; whole replies are the same either way)."""

    tools: ToolCallFormat | None = None
    tool_names: frozenset[str] | None = None
    parallel: bool = True
    reasoning: ReasoningFormat | None = None
    include_reasoning: bool = True
    stream_reasoning: bool = True

    def shown(self, *, include: bool | None, separate: bool | None, stream: bool | None) -> ChatOutputSpec:
        """This spec as a chat request's reasoning fields ask: vLLM's ``include_reasoning`` (false: dropped),
        SGLang's ``separate_reasoning`` (false: no reasoning parser, the section stays in ``content`` as the
        model wrote it, and tool calls are parsed from the whole text, as SGLang does) and ``stream_reasoning``.
        Dropping the section and keeping it in ``content`` together is a 400 naming ``separate_reasoning``."""
        if separate is False and include is False:
            raise invalid_request("include_reasoning: false drops the reasoning section and separate_reasoning: "
                                  "false keeps it in content; send one of them", "separate_reasoning")
        if separate is False:
            return attrs.evolve(self, reasoning=None)
        return attrs.evolve(self, include_reasoning=include is not False, stream_reasoning=stream is not False)

    @property
    def active(self) -> bool:
        return self.tools is not None or self.reasoning is not None

    @property
    def hides_reasoning(self) -> bool:
        """Whether a reasoning section is parsed out and dropped: then the choices' per-token fields
        (``logprobs``, ``token_ids``) would show what was dropped, so they are withheld too (vLLM's rule)."""
        return self.reasoning is not None and not self.include_reasoning

    def processor(self) -> ChatOutput:
        return ChatOutput(self)


class ChatOutput:
    """One choice's parsers, fed its text in order."""

    def __init__(self, spec: ChatOutputSpec) -> None:
        self.spec = spec
        self._reasoning = ReasoningStream(spec.reasoning) if spec.reasoning is not None else None
        self._tools = ToolCallStream(spec.tools, spec.tool_names, spec.parallel) if spec.tools is not None \
            else None
        self._held = ""  # reasoning held back under ``stream_reasoning: false``

    @property
    def called(self) -> bool:
        """Whether a tool call was made (the finish reason becomes ``tool_calls``)."""
        return self._tools is not None and self._tools.called

    def feed(self, text: str) -> dict[str, Any]:
        """The stream delta ``text`` completes (``{}`` when it completes nothing yet)."""
        if self._reasoning is None:
            return self._delta("", text, final=False)
        reasoning, answer = self._reasoning.feed(text)
        if not self.spec.stream_reasoning:
            self._held += reasoning
            reasoning = ""
            if not self._reasoning.open:  # the section closed: it goes out whole, before the answer after it
                reasoning, self._held = self._held, ""
        return self._delta(reasoning, answer, final=False)

    def finish(self) -> dict[str, Any]:
        """The delta the end of the output releases (reasoning still held back, where it ended inside the
        section: ``max_tokens``)."""
        reasoning, answer = self._reasoning.finish() if self._reasoning is not None else ("", "")
        reasoning, self._held = self._held + reasoning, ""
        return self._delta(reasoning, answer, final=True)

    def _delta(self, reasoning: str, answer: str, *, final: bool) -> dict[str, Any]:
        calls: list[dict[str, Any]] = []
        if self._tools is not None:
            answer, calls = self._tools.feed(answer) if answer else ("", [])
            if final:
                rest, more = self._tools.finish()
                answer, calls = answer + rest, calls + more
        delta: dict[str, Any] = {}
        if reasoning and self.spec.include_reasoning:
            delta["reasoning_content"] = reasoning
        if answer:
            delta["content"] = answer
        if calls:
            delta["tool_calls"] = merge_deltas(calls)
        return delta

    def message(self, text: str) -> dict[str, Any]:
        """The whole message of a reply whose text is ``text`` (the parsers fed once)."""
        if self._tools is not None:
            self._tools.streaming = False
        first, last = self.feed(text), self.finish()
        content = first.get("content", "") + last.get("content", "")
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if self.called else "")}
        if self._reasoning is not None:
            reasoning = first.get("reasoning_content", "") + last.get("reasoning_content", "")
            message["reasoning_content"] = reasoning or None
        if self.called:
            assert self._tools is not None
            message["tool_calls"] = [call.as_openai() for call in self._tools.calls]
        return message


def join_deltas(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One delta saying what ``first`` then ``second`` say."""
    out = dict(first)
    for key in ("reasoning_content", "content"):
        if key in second:
            out[key] = out.get(key, "") + second[key]
    if "tool_calls" in second:
        out["tool_calls"] = merge_deltas([*out.get("tool_calls", []), *second["tool_calls"]])
    return out
