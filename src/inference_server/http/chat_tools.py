"""The request side of tool calling and reasoning on chat: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``chat_template_kwargs`` and an agent loop's history, checked and turned into what the template and the
output parsers need.

Semantics (docs/api.md):

* ``tools``: function tools only; names are 1-64 of ``[A-Za-z0-9_-]`` and unique; ``parameters`` a JSON
  Schema object. They are passed to the chat template as ``tools=`` (each as ``{"type": "function",
  "function": {...}}``), as transformers' ``apply_chat_template`` does. An empty list is no tools.
* ``tool_choice``: absent means ``auto`` with tools, ``none`` without. ``none``: the tools are *not*
  rendered and the reply is not parsed for calls (the model is not told of tools it may not call; vLLM's
  ``--exclude-tools-when-tool-choice-none``). ``auto``: rendered, and calls the model makes are parsed.
  ``required`` and ``{"type": "function", "function": {"name": ...}}`` (the name must be one of ``tools``)
  must produce a call: they need the grammar (``tool_constraint``). Any ``tool_choice`` but ``none`` needs
  ``tools``, except ``auto`` with ``tools: []``: no tools, as ``none`` (vLLM accepts it; SDK wrappers send
  ``tool_choice: "auto"`` whatever their tool list holds).
* ``parallel_tool_calls: false``: at most one call is returned.
* ``chat_template_kwargs``: an object of extra template variables (``{"enable_thinking": false}``); the
  names the server itself passes (``messages``, ``tools``, ``add_generation_prompt``, ...) are refused.
* ``chat_template`` (vLLM's request-level Jinja template, also as ``chat_template_kwargs.chat_template``): a
  400 unless null. vLLM refuses it too unless started with ``--trust-request-chat-template``; this server has
  no such switch: a request's template would run client Jinja in the server and render prompts the served
  model's reply parsers and stop markers were not chosen for.
* History: an assistant message's ``tool_calls`` (``arguments`` JSON text is decoded to an object for the
  template, as vLLM does: the templates write objects), a ``tool`` message's ``tool_call_id`` and ``name``,
  and an assistant's ``reasoning_content`` (or ``reasoning``, vLLM's newer name) reach the template. What the
  OpenAI SDK adds to a reply appended to ``messages`` as it came back (``refusal``, ``annotations``,
  ``parsed``, a call's ``index`` and ``parsed_arguments``) is accepted and left out of it. Other keys are
  400s naming them, as OpenAI's (vLLM and SGLang drop them unread: a misspelt key would vanish silently).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

from inference_server.http.body_parser import check_unsupported
from inference_server.http.chat_output import ChatOutputSpec
from inference_server.http.errors import invalid_request
from inference_server.http.gemma4_tool_grammar import gemma4_calls_lark
from inference_server.http.reasoning_parsers import ReasoningFormat
from inference_server.http.schemas import ChatMessageInput, ToolCallInput, ToolDefinition
from inference_server.http.tool_parsers import GEMMA4, HERMES, ToolCallFormat
from inference_server.records.constraints import Constraint, TaggedJson, json_schema_text

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "chat_template", "tokenize"})
TOOL_CHOICE_MODES = ("none", "auto", "required")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@attrs.frozen
class ToolRequest:
    """What a chat request asks of tools: the definitions for the template (None: not rendered), the output
    parsing, and the call a grammar must force (``forced``: ``required``, or a tool's name)."""

    template_tools: tuple[dict[str, Any], ...] | None
    output: ChatOutputSpec
    forced: str | None
    tools: tuple[dict[str, Any], ...] = ()

    def forced_tools(self) -> tuple[dict[str, Any], ...]:
        """The function definitions a forced call may use (all for ``required``, the named one otherwise)."""
        if self.forced is None:
            return ()
        return tuple(t for t in self.tools if self.forced == "required" or t["function"]["name"] == self.forced)


def _tool_dict(tool: ToolDefinition, index: int) -> dict[str, Any]:
    field = f"tools[{index}]"
    if tool.type != "function":
        raise invalid_request(f"tool type {tool.type!r} is not supported; only \"function\" tools are",
                              f"{field}.type", "unsupported_parameter")
    if tool.function is None:
        raise invalid_request("a function tool needs a function object", f"{field}.function")
    function = tool.function
    if not TOOL_NAME.fullmatch(function.name):
        raise invalid_request(f"tool name {function.name[:70]!r} must be 1 to 64 letters, digits, _ or -",
                              f"{field}.function.name")
    if function.parameters is not None and not isinstance(function.parameters, dict):
        raise invalid_request("parameters must be a JSON Schema object", f"{field}.function.parameters")
    out: dict[str, Any] = {"name": function.name}
    if function.description is not None:
        out["description"] = function.description
    if function.parameters is not None:
        out["parameters"] = function.parameters
    if function.strict is not None:
        out["strict"] = function.strict
    return {"type": "function", "function": out}


def check_tools(tools: list[ToolDefinition] | None) -> tuple[dict[str, Any], ...]:
    defined = tuple(_tool_dict(tool, i) for i, tool in enumerate(tools or ()))
    names = [t["function"]["name"] for t in defined]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise invalid_request(f"tool name {name!r} is defined twice", f"tools[{index}].function.name")
    return defined


def tool_choice_mode(choice: Any, names: frozenset[str]) -> str:
    """``none``, ``auto``, ``required`` or the forced tool's name; a 400 naming the field otherwise."""
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise invalid_request(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                                  f"{choice[:40]!r}", "tool_choice")
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str) and set(choice) == {"type", "function"}:
        mode = choice["function"]["name"]
        if names and mode not in names:
            raise invalid_request(f"tool_choice names {mode[:70]!r}, which is not one of tools",
                                  "tool_choice.function.name")
    else:
        raise invalid_request("tool_choice must be a string (none, auto, required) or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", "tool_choice")
    if mode != "none" and not names:
        raise invalid_request(f"tool_choice {mode!r} needs tools", "tool_choice")
    return mode


def tool_request(tools: list[ToolDefinition] | None, choice: Any, parallel: bool | None,
                 tool_format: ToolCallFormat | None, reasoning: ReasoningFormat | None) -> ToolRequest:
    """The checked tool fields of a chat (or Responses) request against the served parsers. ``tools`` None is
    the field absent; an empty list with ``tool_choice`` ``auto`` is no tools (as ``none``)."""
    if choice == "auto" and tools is not None and not tools:
        choice = "none"
    if tool_format is None and tools and choice != "none":
        raise invalid_request("tool calling is off on this server (TOOL_CALL_PARSER=none, or the served chat "
                              "template has no tool-call format)", "tools", "unsupported_parameter")
    defined = check_tools(tools)
    names = frozenset(t["function"]["name"] for t in defined)
    mode = tool_choice_mode(choice, names)
    if mode == "none":
        return ToolRequest(None, ChatOutputSpec(reasoning=reasoning), None, defined)
    if tool_format is None:
        raise invalid_request("tool calling is off on this server (TOOL_CALL_PARSER=none, or the served chat "
                              "template has no tool-call format)", "tools", "unsupported_parameter")
    forced = None if mode == "auto" else mode
    allowed = names if forced in (None, "required") else frozenset({mode})
    output = ChatOutputSpec(tools=tool_format, tool_names=allowed, parallel=parallel is not False,
                            reasoning=reasoning)
    return ToolRequest(defined, output, forced, defined)


def forced_call_constraint(tools: ToolRequest) -> Constraint | None:
    """The grammar of a forced call (``required`` or a named tool), None when nothing is forced.

    Hermes: ``<tool_call>\\n{"name": <one of the tools>, "arguments": <matching its parameters>}\\n</tool_call>``,
    one call (a named tool, or ``parallel_tool_calls: false``) or one or more separated by newlines; ``name``
    is generated before ``arguments``. Gemma 4: its own call syntax, from each tool's ``parameters``
    (``gemma4_tool_grammar``; a schema keyword it cannot enforce is a 400). With a reasoning parser the call
    may follow a reasoning section (``constraint_fields.after_reasoning``)."""
    if tools.forced is None:
        return None
    several = tools.forced == "required" and tools.output.parallel
    if tools.output.tools is GEMMA4:
        lark = gemma4_calls_lark(list(tools.forced_tools()), several=several)
        return Constraint.from_grammar(lark, syntax="lark", field="tool_choice")
    calls = []
    for tool in tools.forced_tools():
        function = tool["function"]
        schema = {"type": "object", "properties": {"name": {"const": function["name"]},
                                                   "arguments": function.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
        calls.append(TaggedJson(begin=HERMES.start + "\n", schema=json_schema_text(schema, "tools"),
                                end="\n" + HERMES.end))
    return Constraint.tool_calls(calls, min_calls=1, max_calls=None if several else 1, separator="\n",
                                 field="tool_choice")


REQUEST_TEMPLATE_REFUSED = ("a request-level chat template is not accepted: chats are rendered with the served "
                            "model's template (vLLM refuses it too unless started with "
                            "--trust-request-chat-template); send chat_template_kwargs for template variables")


def refuse_request_template(chat_template: str | None) -> None:
    """vLLM's ``chat_template`` field: a 400 ``unsupported_parameter`` unless null (see the module docstring)."""
    if chat_template is not None:
        raise invalid_request(REQUEST_TEMPLATE_REFUSED, "chat_template", "unsupported_parameter")


def template_kwargs(value: Any) -> dict[str, Any] | None:
    """``chat_template_kwargs``: an object whose names the server does not pass itself."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_request("chat_template_kwargs must be an object of template variables", "chat_template_kwargs")
    if value.get("chat_template") is not None:
        raise invalid_request(REQUEST_TEMPLATE_REFUSED, "chat_template_kwargs.chat_template", "unsupported_parameter")
    for key in value:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise invalid_request(f"chat_template_kwargs may not set {key!r}: it is a request field or set by "
                                  "the server", f"chat_template_kwargs.{key}")
    return dict(value)


def effort_template_kwargs(effort: str | None, param: str) -> dict[str, Any] | None:
    """A reasoning effort (chat's ``reasoning_effort``, the Responses API's ``reasoning.effort``) as the
    template's ``enable_thinking``: ``none`` turns thinking off, any other level on (the served templates have
    no graded budget); absent, nothing (the template's default)."""
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise invalid_request(f"{param} must be one of {', '.join(REASONING_EFFORTS)}, got {effort[:40]!r}", param)
    return {"enable_thinking": effort != "none"}


def with_effort(kwargs: dict[str, Any] | None, effort: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs`` with a reasoning effort's ``enable_thinking`` added; a request whose two
    fields disagree is a 400 (neither silently wins)."""
    if effort is None:
        return kwargs
    if kwargs is None:
        return effort
    if "enable_thinking" in kwargs and kwargs["enable_thinking"] != effort["enable_thinking"]:
        raise invalid_request("reasoning_effort and chat_template_kwargs.enable_thinking disagree; send one of them",
                              "reasoning_effort")
    return {**kwargs, **effort}


def decoded_arguments(arguments: Any) -> Any:
    """An earlier call's ``arguments`` as the template gets them: JSON text decoded when it is an object; absent
    or empty text (a call without parameters, as some clients and stream accumulators write it) is ``{}``, as
    vLLM passes it: templates write a string verbatim, and ``""`` would render ``"arguments": }``."""
    if isinstance(arguments, str) and not arguments.strip():
        return {}
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments if arguments is not None else {}


def history_calls(calls: list[ToolCallInput] | None, index: int) -> tuple[Mapping[str, Any], ...]:
    out = []
    for call_index, call in enumerate(calls or ()):
        if call.type not in (None, "function"):
            raise invalid_request(f"tool call type {call.type!r} is not supported",
                                  f"messages[{index}].tool_calls[{call_index}].type", "unsupported_parameter")
        entry: dict[str, Any] = {"type": "function", "function": {
            "name": call.function.name, "arguments": decoded_arguments(call.function.arguments)}}
        if call.id is not None:
            entry["id"] = call.id
        out.append(entry)
    return tuple(out)


def message_extras(message: ChatMessageInput, role: str, index: int) -> dict[str, Any]:
    """The optional ``ChatMessage`` fields of ``message`` (see the module docstring). A reply's ``audio`` or
    legacy ``function_call`` written back into the history is refused unless empty, as on the request itself;
    its other SDK-echoed fields (``refusal``, ``annotations``, ``parsed``) do not reach the template."""
    check_unsupported("audio", message.audio, f"messages[{index}].audio")
    check_unsupported("function_call", message.function_call, f"messages[{index}].function_call")
    extras: dict[str, Any] = {}
    if message.tool_calls:
        if role != "assistant":
            raise invalid_request("only assistant messages carry tool_calls", f"messages[{index}].tool_calls")
        extras["tool_calls"] = history_calls(message.tool_calls, index)
    if message.tool_call_id is not None:
        extras["tool_call_id"] = message.tool_call_id
    if message.name is not None and role == "tool":
        extras["name"] = message.name
    reasoning = message_reasoning(message, index)
    if reasoning is not None and role == "assistant":
        extras["reasoning_content"] = reasoning
    return extras


def message_reasoning(message: ChatMessageInput, index: int) -> str | None:
    """An earlier reply's reasoning: ``reasoning_content``, or ``reasoning`` (vLLM's newer name, OpenRouter's);
    both sent must agree (neither silently wins)."""
    if message.reasoning is not None and message.reasoning_content is not None \
            and message.reasoning != message.reasoning_content:
        raise invalid_request("reasoning and reasoning_content disagree; send one of them",
                              f"messages[{index}].reasoning")
    return message.reasoning_content if message.reasoning_content is not None else message.reasoning
