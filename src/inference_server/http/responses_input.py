"""The request side of ``POST /v1/responses``: ``input`` items as chat messages, and the Responses API's tool
fields as chat's, so that both routes share one template path (``chat_tools``) and one output parser.

Input items, in order, become chat messages:

* a message (``type`` absent or ``message``): its role (``developer`` is ``system``) and its text parts joined
  with newlines;
* ``function_call`` (an earlier call passed back): a call in an assistant message's ``tool_calls``;
  consecutive calls, and the assistant message just before them, make one assistant turn;
* ``function_call_output``: a ``tool`` message with its ``call_id`` (and the called function's ``name`` when
  an earlier item names it); ``output`` is a string or ``input_text`` parts;
* ``reasoning``: its ``reasoning_text`` content becomes the ``reasoning_content`` of the assistant turn that
  follows it (templates that render earlier reasoning get it back; ``encrypted_content`` is ignored).

Tools: ``{"type": "function", "name", "description", "parameters", "strict"}`` (flat, where chat nests them
under ``function``); ``tool_choice`` ``none`` / ``auto`` / ``required`` / ``{"type": "function", "name"}``.
They are checked by ``chat_tools.tool_request`` and its errors name this API's fields (``tools[0].name``,
``tool_choice.name``).
"""

from __future__ import annotations

from typing import Any

import attrs

from inference_server.http.chat_tools import ToolRequest, decoded_arguments, tool_request
from inference_server.http.errors import ApiError, invalid_request
from inference_server.http.reasoning_parsers import ReasoningFormat
from inference_server.http.responses_schema import InputContentPart, ResponseInput, ResponseInputItem, ResponseTool
from inference_server.http.schemas import FunctionDefinition, ToolDefinition
from inference_server.http.tool_parsers import ToolCallFormat
from inference_server.records.requests import ChatMessage

INPUT_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PART_TYPES = frozenset({"input_text", "output_text"})


def responses_tool_request(tools: list[ResponseTool] | None, choice: Any, parallel: bool | None,
                           tool_format: ToolCallFormat | None, reasoning: ReasoningFormat | None) -> ToolRequest:
    """The Responses API's tool fields, checked as chat's (``chat_tools.tool_request``), except that
    ``tool_choice: "auto"`` without ``tools`` is no tools, as ``tools: []`` is: ``auto`` is this API's default,
    which OpenAI's SDKs and SGLang's and vLLM's clients send whether or not there are tools (on chat, OpenAI
    refuses ``tool_choice`` without ``tools``, and so does chat here)."""
    if tools is None and choice == "auto":
        tools = []
    definitions = None if tools is None else [_chat_tool(tool, index) for index, tool in enumerate(tools)]
    try:
        return tool_request(definitions, _chat_tool_choice(choice), parallel, tool_format, reasoning)
    except ApiError as error:
        if error.param:
            error.param = error.param.replace(".function.", ".")
        raise


def _chat_tool(tool: ResponseTool, index: int) -> ToolDefinition:
    if tool.type != "function":
        raise invalid_request(f"tool type {tool.type!r} is not supported; only \"function\" tools are",
                              f"tools[{index}].type", "unsupported_parameter")
    if tool.name is None:
        raise invalid_request("a function tool needs a name", f"tools[{index}].name", "missing_field")
    return ToolDefinition(type="function", function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict))


def _chat_tool_choice(choice: Any) -> Any:
    """``{"type": "function", "name": ...}`` as chat's ``{"type": "function", "function": {"name": ...}}``."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str) \
                or set(choice) != {"type", "name"}:
            raise invalid_request("tool_choice must be none, auto, required or {\"type\": \"function\", "
                                  "\"name\": ...}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


@attrs.define
class _Conversation:
    """Messages built so far, and the reasoning waiting for the next assistant turn."""

    messages: list[ChatMessage] = attrs.Factory(list)
    reasoning: str | None = None
    call_names: dict[str, str] = attrs.Factory(dict)
    calls_open: bool = False
    """The last message is an assistant turn that later ``function_call`` items join."""

    def add(self, message: ChatMessage, *, joins_calls: bool = False) -> None:
        if message.role == "assistant" and self.reasoning is not None:
            message = attrs.evolve(message, reasoning_content=self.reasoning)
            self.reasoning = None
        self.messages.append(message)
        self.calls_open = joins_calls


def input_messages(items: ResponseInput) -> list[ChatMessage]:
    """``input`` as chat messages (a string is one user message; see the module docstring)."""
    if isinstance(items, str):
        return [ChatMessage("user", items)]
    talk = _Conversation()
    for index, item in enumerate(items):
        kind = item.type or "message"
        if kind == "message":
            role = INPUT_ROLES.get(item.role or "")
            if role is None:
                raise invalid_request(f"unknown role {item.role!r}; expected one of {', '.join(INPUT_ROLES)}",
                                      f"input[{index}].role")
            talk.add(ChatMessage(role, _text(item.content, f"input[{index}].content")), joins_calls=role == "assistant")
        elif kind == "function_call":
            _function_call(talk, item, index)
        elif kind == "function_call_output":
            call_id = _required(item.call_id, index, "call_id")
            talk.add(ChatMessage("tool", _output_text(item.output, index), tool_call_id=call_id,
                                 name=talk.call_names.get(call_id)))
        elif kind == "reasoning":
            text = _text(item.content, f"input[{index}].content")
            talk.reasoning = text if talk.reasoning is None else f"{talk.reasoning}\n{text}"
        else:
            raise invalid_request(f"input items of type {kind!r} are not supported; only message, function_call, "
                                  "function_call_output and reasoning items are", f"input[{index}].type",
                                  "unsupported_parameter")
    return talk.messages


def _function_call(talk: _Conversation, item: ResponseInputItem, index: int) -> None:
    call_id = _required(item.call_id, index, "call_id")
    name = _required(item.name, index, "name")
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": decoded_arguments(item.arguments)}}
    talk.call_names[call_id] = name
    if talk.calls_open:
        last = talk.messages[-1]
        talk.messages[-1] = attrs.evolve(last, tool_calls=(*last.tool_calls, call))
    else:
        talk.add(ChatMessage("assistant", "", tool_calls=(call,)), joins_calls=True)


def _required(value: str | None, index: int, name: str) -> str:
    if value is None:
        raise invalid_request(f"input[{index}] needs {name}", f"input[{index}].{name}", "missing_field")
    return value


def _text(content: str | list[InputContentPart] | None, field: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part_index, part in enumerate(content):
        if part.type not in (*TEXT_PART_TYPES, "reasoning_text") or part.text is None:
            raise invalid_request(f"content part of type {part.type!r} is not supported; only text parts are",
                                  f"{field}[{part_index}]", "unsupported_parameter")
        texts.append(part.text)
    return "\n".join(texts)


def _output_text(output: Any, index: int) -> str:
    """A ``function_call_output``'s ``output``: a string, or ``input_text`` parts."""
    field = f"input[{index}].output"
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text"
                                        and isinstance(p.get("text"), str) for p in output):
        return "\n".join(p["text"] for p in output)
    raise invalid_request("output must be a string or a list of input_text parts", field)
