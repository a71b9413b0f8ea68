"""The reasoning section of a chat reply, split from its answer (``reasoning_content``, vLLM's and SGLang's field).

Formats (``REASONING_PARSER``; ``auto`` reads the served chat template, see ``chat_output.resolve_parsers``):

* ``qwen3``: ``<think>…</think>`` at the start of the output (Qwen3 writes it itself; with
  ``chat_template_kwargs: {"enable_thinking": false}`` its template closes an empty one in the prompt, and
  the output is all answer).
* ``gemma4``: ``<|channel>thought…<channel|>`` at the start (the template enables it with
  ``enable_thinking: true``; otherwise it closes an empty channel in the prompt).

Rules: the section counts only where the output starts with its marker (after whitespace); everything else
is answer. The reasoning text and the answer are each stripped of surrounding whitespace. An output that
ends inside the section (``max_tokens``) is all reasoning, with an empty answer. Markers inside the answer
are left alone. Streamed and whole replies go through the same ``ReasoningStream``.
"""

from __future__ import annotations

import attrs

REASONING_PARSERS = ("qwen3", "gemma4")


@attrs.frozen
class ReasoningFormat:
    name: str
    start: str
    end: str


FORMATS = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>"),
    "gemma4": ReasoningFormat("gemma4", "<|channel>thought", "<channel|>"),
}


class _Trimmed:
    """A stream of text with its leading and trailing whitespace removed (trailing whitespace is held back
    until more text follows it)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return body


class ReasoningStream:
    """Feed the output's text in pieces; get (reasoning, answer) text back."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._state = "undecided"  # -> "reasoning" -> "answer", or "undecided" -> "answer"
        self._buffer = ""
        self._reasoning = _Trimmed()
        self._answer = _Trimmed()
        self._raw = False  # no reasoning section: the answer is the output as it is

    @property
    def open(self) -> bool:
        """Whether the output may still be in its reasoning section (undecided, or inside it)."""
        return self._state != "answer"

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        answer: list[str] = []
        self._buffer += text
        if self._state == "undecided":
            head = self._buffer.lstrip()
            if head.startswith(self.fmt.start):
                self._state, self._buffer = "reasoning", head[len(self.fmt.start):]
            elif not self.fmt.start.startswith(head):  # not a reasoning section
                self._state, self._raw = "answer", True
            else:
                return "", ""  # the start marker may still be arriving
        if self._state == "reasoning":
            end = self._buffer.find(self.fmt.end)
            if end < 0:
                keep = _held_prefix(self._buffer, self.fmt.end)
                reasoning.append(self._reasoning.push(self._buffer[:len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return "".join(reasoning), ""
            reasoning.append(self._reasoning.push(self._buffer[:end]))
            self._buffer = self._buffer[end + len(self.fmt.end):]
            self._state = "answer"
        answer.append(self._buffer if self._raw else self._answer.push(self._buffer))
        self._buffer = ""
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """The end of the output: a start marker that never completed is answer text."""
        if self._state == "undecided":
            self._state, self._raw = "answer", True
            text, self._buffer = self._buffer, ""
            return "", text
        if self._state == "reasoning":
            return self._reasoning.push(self._buffer), ""
        return "", ""



def _held_prefix(text: str, marker: str) -> int:
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
