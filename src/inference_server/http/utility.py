"""vLLM's utility routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``, ``GET /version``.

Shapes are vLLM's, so its clients and scripts work unchanged:

* ``/tokenize`` takes a ``prompt`` (``add_special_tokens`` default true) or chat ``messages`` rendered with
  the served chat template as chat renders them (an agent history's ``tool_calls``, ``tool_call_id``, ``name``
  and ``reasoning_content`` included; ``tools`` and ``chat_template_kwargs`` as on chat with ``tool_choice``
  ``auto``; ``add_generation_prompt`` default true unless ``continue_final_message``,
  ``add_special_tokens`` default false, since the template writes them; ``continue_final_message`` as on chat:
  the final message is the assistant's and stays open, and both flags true is a 400); it answers
  ``{"count", "max_model_len", "tokens", "token_strs"}``, where
  ``token_strs`` (each id's vocabulary string, e.g. ``▁Paris``) is null unless ``return_token_strs``. The ids
  equal what a generation request with that prompt would run on.
* ``/detokenize`` takes ``tokens`` and answers ``{"prompt": text}``; an id outside the vocabulary is a 400
  naming the value, its index and the vocabulary size.
* ``/tokenizer_info`` describes the tokenizer (not where its exported folder lies: no route reports a server
  path; the operator sees it in the start-up log).
* ``/version`` is ``{"version": <package version>}``.

Bodies are parsed as strictly as every other route (``http/schemas.py``); ``model``, when given, must be a
served name. A model without a tokenizer (dummy presets) answers 400 on the tokenizer routes.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from quart import Response

from inference_server.http.chat_tools import refuse_request_template, template_kwargs, tool_request
from inference_server.http.convert import chat_prompt_flags
from inference_server.http.errors import invalid_request, model_not_found
from inference_server.http.openai import _chat_message
from inference_server.http.responses import json_response, read_body
from inference_server.http.schemas import DetokenizeRequest, TokenizeRequest
from inference_server.http.state import AppState

PACKAGE = "inference_server"


def package_version() -> str:
    try:
        return version(PACKAGE)
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "unknown"


class UtilityRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state

    def _template_kwargs(self, body: TokenizeRequest) -> dict[str, Any]:
        """The template variables chat would pass for these ``tools`` (checked as on chat, ``tool_choice``
        ``auto``) and ``chat_template_kwargs``."""
        kwargs = template_kwargs(body.chat_template_kwargs) or {}
        tools = tool_request(body.tools, None, None, self.state.tool_format, self.state.reasoning_format)
        if tools.template_tools is not None:
            kwargs["tools"] = [dict(tool) for tool in tools.template_tools]
        return kwargs

    async def tokenize(self) -> Response:
        """``POST /tokenize``."""
        body = await read_body(TokenizeRequest)
        self._check_model(body.model)
        tokenizer = self._tokenizer()
        refuse_request_template(body.chat_template)
        if (body.prompt is None) == (body.messages is None):
            raise invalid_request("send exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            messages = [_chat_message(m, i) for i, m in enumerate(body.messages)]
            if not messages:
                raise invalid_request("messages must not be empty", "messages")
            add_generation_prompt, continue_final = chat_prompt_flags(
                body.add_generation_prompt, body.continue_final_message, messages[-1].role)
            kwargs = self._template_kwargs(body)
            try:
                text = tokenizer.apply_chat_template([m.template_dict() for m in messages],
                                                     add_generation_prompt=add_generation_prompt, tokenize=False,
                                                     continue_final_message=continue_final, **kwargs)
            except Exception as error:  # a template error is the request's problem, as on chat
                raise invalid_request(f"cannot apply the chat template: {error}", "messages") from None
            add_special_tokens = body.add_special_tokens is True
        else:
            for field in ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs"):
                if getattr(body, field) is not None:
                    raise invalid_request(f"{field} applies to messages only", field)
            assert body.prompt is not None
            text, add_special_tokens = body.prompt, body.add_special_tokens is not False
        tokens = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        token_strs = [tokenizer.id_to_token(t) for t in tokens] if body.return_token_strs else None
        return json_response({"count": len(tokens), "max_model_len": self.state.engine.info.max_model_len,
                              "tokens": tokens, "token_strs": token_strs})

    async def detokenize(self) -> Response:
        """``POST /detokenize``."""
        body = await read_body(DetokenizeRequest)
        self._check_model(body.model)
        tokenizer = self._tokenizer()
        vocab_size = self.state.engine.info.vocab_size
        for index, token in enumerate(body.tokens):
            if not 0 <= token < vocab_size:
                raise invalid_request(f"token id {token} at tokens[{index}] is outside the vocabulary "
                                      f"[0, {vocab_size})", f"tokens[{index}]")
        return json_response({"prompt": tokenizer.decode(body.tokens)})

    async def tokenizer_info(self) -> Response:
        """``GET /tokenizer_info``."""
        info = self.state.engine.info
        tokenizer = self._tokenizer()
        payload: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "vocab_size": tokenizer.vocab_size,
            "model_vocab_size": info.vocab_size,
            "model_max_length": info.max_model_len,
            **{key: value for key, value in tokenizer.special_tokens.items()},
            "eos_token_ids": sorted(info.eos_token_ids),
            "chat_template": tokenizer.chat_template,
            "turn_markers": list(self.state.chat_stops.strings),
        }  # not the exported folder's path: no route tells clients the server's file layout
        return json_response(payload)

    async def version(self) -> Response:
        """``GET /version``."""
        return json_response({"version": package_version()})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.state.model_names:
            raise model_not_found(model)

    def _tokenizer(self) -> Any:
        tokenizer = self.state.engine.info.tokenizer
        if tokenizer is None:
            raise invalid_request("this model has no tokenizer: send and read token ids", "model")
        return tokenizer
