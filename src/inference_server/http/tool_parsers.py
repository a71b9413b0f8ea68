"""Tool calls out of a chat reply's text, into OpenAI's ``tool_calls`` (whole and streamed).

Two formats, the two the served families are trained on (``TOOL_CALL_PARSER``; ``auto`` reads the served chat
template, see ``chat_output.resolve_parsers``):

* ``hermes`` (Qwen2.5/Qwen3, and the embedded Gemma 3 template): ``<tool_call>{"name": "f", "arguments":
  {...}}</tool_call>``, one JSON object per block (``parameters`` is accepted for ``arguments``).
* ``gemma4``: ``<|tool_call>call:f{key:<|"|>text<|"|>,n:42,flag:true,list:[1,2],obj:{k:v}}<tool_call|>``: bare
  keys, strings between ``<|"|>`` quotes, numbers, booleans, arrays and objects as in JSON. It is turned
  into JSON text (``gemma4_to_json``) and parsed as JSON.

``ToolCallStream`` is the one parser: it is fed the reply's text in whatever pieces the engine produced and
gives back content text and tool-call deltas in OpenAI's streaming shape (the first delta of a call has
``index``, ``id``, ``type`` and ``function.name``; later ones add ``function.arguments`` fragments whose
concatenation is the call's ``arguments``, compact JSON re-serialised from what the model wrote). A whole
(non-streamed) reply is the same parser fed once, so both paths agree.

Rules:

* A block that does not parse (bad JSON, no name, a name that is not one of the request's tools, arguments
  that are not an object) stays text in the content, markers included: never an error. Streamed, a call is
  announced only once its name is complete and known; were its body to go bad after that, the call ends
  with the arguments sent so far (as vLLM's streaming parsers do).
* A block cut off by the end of the output (``max_tokens``) counts when its body is complete, else it is text.
* Whitespace around calls is dropped (the templates write newlines between blocks); other text before,
  between or after calls is content.
* ``parallel_tool_calls: false``: blocks after the first call are dropped.
* ``arguments`` fragments are sent only once two successive partial parses agree on them (a number or a
  literal cut mid-token could otherwise change), so what was sent is always a prefix of the final text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import attrs
import partial_json_parser  # type: ignore[import-untyped]
from partial_json_parser import Allow  # type: ignore[import-untyped]

TOOL_CALL_PARSERS = ("hermes", "gemma4")
_NO_STRINGS = Allow.ALL & ~Allow.STR  # a partial string is dropped: a name present is a complete one
_NO_NUMBERS = Allow.ALL & ~Allow.NUM  # a partial number is dropped: it could still grow
_CLOSERS = "\"]}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _partial(text: str, allow: Allow) -> Any:
    try:
        return partial_json_parser.loads(text, allow) if text.strip() else None
    except Exception:  # the library raises its own and json's errors on text it cannot complete
        return None


# -- formats -----------------------------------------------------------------------------------------------


@attrs.frozen
class ToolCallFormat:
    """One model family's call markers and how a block's body gives a name and arguments."""

    name: str
    start: str
    end: str
    complete: Callable[[str], tuple[str, Any] | None]
    """(name, arguments) of a whole body, or None when it does not parse."""
    partial: Callable[[str], tuple[str | None, Any]]
    """(the name once complete, the arguments parsed so far) of a body still arriving."""


def _hermes_complete(body: str) -> tuple[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return value["name"], arguments


def _hermes_partial(body: str) -> tuple[str | None, Any]:
    header = _partial(body, _NO_STRINGS)
    name = header.get("name") if isinstance(header, dict) else None
    value = _partial(body, _NO_NUMBERS)
    arguments = None
    if isinstance(value, dict):
        arguments = value.get("arguments", value.get("parameters"))
    return (name if isinstance(name, str) else None), arguments


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>", _hermes_complete, _hermes_partial)

GEMMA4_QUOTE = '<|"|>'
_BARE_WORD = re.compile(r"[A-Za-z0-9_.+\-]+")
_GEMMA4_HEAD = re.compile(r"\s*call:([A-Za-z0-9_.\-]+)\{", re.DOTALL)


def gemma4_to_json(text: str) -> tuple[str, bool]:
    """Gemma 4's argument syntax as JSON text, and whether ``text`` ended inside a token (an open string
    or a bare word with nothing after it: partial). Strings between ``<|"|>`` become JSON strings; a bare
    word followed by ``:`` is a key (quoted); other bare words (numbers, ``true``, ``false``, ``null``) and
    punctuation pass through."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith(GEMMA4_QUOTE, i):
            close = text.find(GEMMA4_QUOTE, i + len(GEMMA4_QUOTE))
            if close < 0:  # an open string: no closing quote (and not half of one)
                inner = text[i + len(GEMMA4_QUOTE):]
                inner = inner[:len(inner) - _held_prefix(inner, GEMMA4_QUOTE)]
                out.append(_dumps(inner)[:-1])
                return "".join(out), True
            out.append(_dumps(text[i + len(GEMMA4_QUOTE):close]))
            i = close + len(GEMMA4_QUOTE)
            continue
        if GEMMA4_QUOTE.startswith(text[i:]):  # a quote marker cut in half
            return "".join(out), True
        word = _BARE_WORD.match(text, i)
        if word is None:
            out.append(text[i])
            i += 1
            continue
        after = word.end()
        while after < n and text[after].isspace():
            after += 1
        if after >= n:
            return "".join(out), True  # a key or a value still arriving
        out.append(_dumps(word.group()) if text[after] == ":" else word.group())
        i = word.end()
    return "".join(out), False


def _gemma4_complete(body: str) -> tuple[str, Any] | None:
    head = _GEMMA4_HEAD.match(body)
    if head is None or not body.rstrip().endswith("}"):
        return None
    converted, partial = gemma4_to_json(body[head.end() - 1:].rstrip())
    if partial:
        return None
    try:
        return head.group(1), json.loads(converted)
    except ValueError:
        return None


def _gemma4_partial(body: str) -> tuple[str | None, Any]:
    head = _GEMMA4_HEAD.match(body)
    if head is None:
        return None, None
    converted, _ = gemma4_to_json(body[head.end() - 1:])
    return head.group(1), _partial(converted, _NO_NUMBERS)


GEMMA4 = ToolCallFormat("gemma4", "<|tool_call>", "<tool_call|>", _gemma4_complete, _gemma4_partial)
FORMATS = {"hermes": HERMES, "gemma4": GEMMA4}


# -- the streaming parser -------------------------------------------------------------------------------------


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (it may yet become one)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _common_prefix(a: str, b: str) -> str:
    size = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        size += 1
    return a[:size]


@attrs.define
class _Call:
    index: int
    id: str
    name: str | None = None  # set once announced
    sent: str = ""  # arguments text sent so far
    last_candidate: str | None = None


@attrs.define
class ParsedCall:
    """A finished call as the whole (non-streamed) response lists it."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallStream:
    """Content and tool-call deltas out of text fed in pieces (see the module docstring)."""

    def __init__(self, fmt: ToolCallFormat, tool_names: frozenset[str] | None = None,
                 parallel: bool = True) -> None:
        self.fmt = fmt
        self.tool_names = tool_names
        self.parallel = parallel
        self._buffer = ""  # content mode: text held back; call mode: the block's body so far
        self._held_space = ""  # trailing whitespace of the content, sent once more content follows
        self._in_call = False
        self._call: _Call | None = None
        self.calls: list[ParsedCall] = []
        self.streaming = True
        """False for a whole reply: nothing is announced before its block is complete, so a block that goes
        bad is always text."""

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Content text and tool-call deltas that ``text`` completes."""
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        self._buffer += text
        while True:
            if self._in_call:
                end = self._buffer.find(self.fmt.end)
                if end < 0:
                    self._progress(deltas)
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.fmt.end):]
                self._close(body, content, deltas, terminated=True)
                continue
            start = self._buffer.find(self.fmt.start)
            if start < 0:
                keep = _held_prefix(self._buffer, self.fmt.start)
                self._content(self._buffer[:len(self._buffer) - keep], content)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            self._content(self._buffer[:start], content)
            self._buffer = self._buffer[start + len(self.fmt.start):]
            self._held_space = ""  # whitespace before a call is the template's layout, not content
            self._in_call = True
            self._call = None
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What the end of the output releases: a block cut off (a call when its body is complete, else
        text), held-back text; trailing whitespace only when no call was made."""
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        if self._in_call:
            self._close(self._buffer, content, deltas, terminated=False)
        else:
            self._content(self._buffer, content)
        self._buffer = ""
        if not self.calls:
            content.append(self._held_space)
        self._held_space = ""
        return "".join(content), deltas

    # -- content ------------------------------------------------------------------------------------------
    def _content(self, text: str, out: list[str]) -> None:
        """Send ``text``, holding back its trailing whitespace (dropped if a call follows)."""
        if not text:
            return
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        if body:
            out.append(body)

    # -- calls --------------------------------------------------------------------------------------------
    def _accepts(self, name: str) -> bool:
        return self.tool_names is None or name in self.tool_names

    def _skipping(self) -> bool:
        """``parallel_tool_calls: false`` and one call made: later blocks are dropped."""
        return not self.parallel and bool(self.calls)

    def _progress(self, deltas: list[dict[str, Any]]) -> None:
        """Announce the call once its name is complete; send the arguments two parses agree on."""
        if self._skipping() or not self.streaming:
            return
        body = self._buffer[:len(self._buffer) - _held_prefix(self._buffer, self.fmt.end)]
        name, arguments = self.fmt.partial(body)
        call = self._call
        if call is None:
            if name is None or not self._accepts(name):
                return
            call = self._call = _Call(index=len(self.calls), id=new_call_id(), name=name)
            deltas.append({"index": call.index, "id": call.id, "type": "function",
                           "function": {"name": name, "arguments": ""}})
        if not isinstance(arguments, dict):
            return
        candidate = _dumps(arguments).rstrip(_CLOSERS)
        stable = _common_prefix(candidate, call.last_candidate) if call.last_candidate is not None else ""
        call.last_candidate = candidate
        if len(stable) > len(call.sent) and stable.startswith(call.sent):
            deltas.append({"index": call.index, "function": {"arguments": stable[len(call.sent):]}})
            call.sent = stable

    def _close(self, body: str, content: list[str], deltas: list[dict[str, Any]], *, terminated: bool) -> None:
        self._in_call = False
        call, self._call = self._call, None
        if self._skipping():
            return
        parsed = self.fmt.complete(body)
        valid = parsed is not None and self._accepts(parsed[0]) and isinstance(parsed[1], dict) \
            and (call is None or call.name == parsed[0])
        if not valid:
            if call is None:  # never announced: the block stays text
                self._content(self.fmt.start + body + (self.fmt.end if terminated else ""), content)
            else:  # announced: it ends with what was sent
                assert call.name is not None
                self.calls.append(ParsedCall(call.id, call.name, call.sent))
            return
        assert parsed is not None
        name, arguments = parsed
        final = _dumps(arguments)
        if call is None:
            call = _Call(index=len(self.calls), id=new_call_id(), name=name)
            deltas.append({"index": call.index, "id": call.id, "type": "function",
                           "function": {"name": name, "arguments": final}})
        else:
            rest = final[len(call.sent):] if final.startswith(call.sent) else ""
            if rest:
                deltas.append({"index": call.index, "function": {"arguments": rest}})
            final = call.sent + rest
        self.calls.append(ParsedCall(call.id, name, final))


def merge_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deltas of one chunk with one entry per call: a call's header and argument fragments joined."""
    merged: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        entry = merged.get(delta["index"])
        if entry is None:
            merged[delta["index"]] = {**delta, "function": dict(delta["function"])}
        else:
            entry["function"]["arguments"] = entry["function"].get("arguments", "") \
                + delta["function"].get("arguments", "")
    return list(merged.values())
