"""The request/response examples of a Markdown document, and a structural comparison of responses.

Convention (docs/api.md follows it): an example is an HTML comment ``<!-- example -->`` (optionally with
``status=404`` and ``maps=key,key``) directly followed by a ```` ```sh ```` block holding one ``curl`` command,
then the documented response in the next fenced block: ```` ```json ```` for a JSON body, or a plain
```` ``` ```` block for a server-sent-event stream. Every ``curl`` in a ``sh`` block must belong to an example.

Comparison is structural: the same keys, and the same JSON types (numbers are one type) at every path.
Values are ignored (ids, timestamps, generated text and token ids vary), except for keys whose value is a
fixed vocabulary (``CONSTANT_KEYS``: ``object``, ``type``, ``finish_reason``, ``code``, ...), which must be
equal; ``stop_reason`` and ``matched_stop`` (``STOP_KEYS``) are compared by presence only. A list's structure
is the sequence of its items' structures with consecutive repeats collapsed, so a stream of 3 or 5 text
chunks has the same structure; the same holds for the events of a stream. ``maps``
names keys whose objects are maps from data to values (legacy ``top_logprobs``: token string -> logprob):
their keys are ignored and only the values' structures count.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import attrs

MARKER = re.compile(r"<!--\s*example\b([^>]*)-->\s*\n```sh\n(.*?)```\s*\n```(\w*)\n(.*?)```", re.DOTALL)
SH_BLOCK = re.compile(r"```sh\n(.*?)```", re.DOTALL)
CONSTANT_KEYS = frozenset({"object", "type", "role", "status", "finish_reason", "code", "param", "reason"})
STOP_KEYS = frozenset({"stop_reason", "matched_stop"})
"""What stopped a choice: a stop string, a token id or null, which depends on the generated text (the test's
fake model cannot write the real model's stop strings), so only the key's presence is compared."""


@attrs.frozen
class Example:
    """One documented request and its documented response."""

    line: int
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    status: int
    maps: frozenset[str]
    stream: bool
    response: Any  # a JSON value, or a list of stream events (JSON values, and the string "[DONE]")

    @property
    def name(self) -> str:
        return f"line{self.line}-{self.method}-{self.path.strip('/').replace('/', '-') or 'index'}"


def _options(text: str) -> dict[str, str]:
    return dict(option.split("=", 1) for option in text.split())


def parse_curl(command: str) -> tuple[str, str, dict[str, str], Any]:
    """Method, path, headers and JSON body of one ``curl`` command line (continuations and comments allowed)."""
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    assert words[0] == "curl", command
    method, url, headers, body = None, None, {}, None
    iterator = iter(words[1:])
    for word in iterator:
        if word in ("-H", "--header"):
            name, value = next(iterator).split(":", 1)
            headers[name.strip()] = value.strip()
        elif word in ("-d", "--data"):
            body = json.loads(next(iterator))
        elif word in ("-X", "--request"):
            method = next(iterator)
        elif word.startswith("-"):
            assert word in ("-N", "-s", "-sS"), f"unsupported curl flag {word}"
        else:
            url = word
    assert url is not None, command
    path = "/" + re.sub(r"^(https?://)?[^/]+/?", "", url)
    return method or ("POST" if body is not None else "GET"), path, headers, body


def parse_events(text: str) -> list[Any]:
    """A server-sent-event stream: each event's ``data`` (JSON, or ``[DONE]``)."""
    events = []
    for block in text.strip().split("\n\n"):
        data = [line.removeprefix("data: ") for line in block.split("\n") if line.startswith("data: ")]
        assert len(data) == 1, block
        events.append(data[0] if data[0] == "[DONE]" else json.loads(data[0]))
    return events


def examples(markdown: str) -> list[Example]:
    found = []
    for match in MARKER.finditer(markdown):
        options, command, language, response = match.groups()
        method, path, headers, body = parse_curl(command.strip())
        settings = _options(options)
        stream = language == ""
        maps = frozenset(filter(None, settings.get("maps", "").split(",")))
        found.append(Example(
            line=markdown.count("\n", 0, match.start()) + 1, method=method, path=path, headers=headers, body=body,
            status=int(settings.get("status", "200")), maps=maps,
            stream=stream, response=parse_events(response) if stream else json.loads(response)))
    return found


def curl_count(markdown: str) -> int:
    """``curl`` commands in ``sh`` blocks (each must be an example)."""
    return sum(len(re.findall(r"^\s*curl\b", block, re.MULTILINE)) for block in SH_BLOCK.findall(markdown))


def _collapse(items: list[Any]) -> tuple[Any, ...]:
    out: list[Any] = []
    for item in items:
        if not out or out[-1] != item:
            out.append(item)
    return tuple(out)


def shape(value: Any, maps: frozenset[str] = frozenset(), key: str | None = None) -> Any:
    """The structure of a JSON value (see the module docstring); equal structures compare equal."""
    if isinstance(value, dict):
        if key in maps:
            return ("map", _collapse([shape(v, maps) for v in value.values()]))
        return ("object", tuple(sorted((k, shape(v, maps, k)) for k, v in value.items())))
    if isinstance(value, list):
        return ("array", _collapse([shape(v, maps, key) for v in value]))
    if key in STOP_KEYS and not isinstance(value, (dict, list)):
        return "stop"
    if isinstance(value, str) and key in CONSTANT_KEYS:
        return ("=", value)
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__
