"""The routing key of a request body: its prompt's token ids (tokenised as the replicas will) hashed into
chained block hashes, and its session.

Mirrors what the single server does with the same body: ``/generate`` reads ``prompt`` or
``prompt_token_ids``, ``session_id`` and ``cache_salt``; ``/v1/completions`` the first ``prompt`` (text or ids)
and ``user``; ``/v1/chat/completions`` ``messages`` through the chat template, and ``user``; the
``X-Session-Id`` header overrides the body's session as it does there. Anything it cannot read (another
route, a malformed body, a text prompt without a tokenizer) gives an empty key: the request is then routed
by load, and the replica answers whatever error the body deserves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from control_plane.router import RoutingKey
from inference_server.core.block_hashes import chain_hashes
from inference_server.core.validation import PromptTokenizer

log = logging.getLogger(__name__)

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")


def routing_key(path: str, body: Any, header_session: str | None, tokenizer: PromptTokenizer | None,
                block_size: int | None) -> RoutingKey:
    """The key of a generation request (``body`` is its parsed JSON); never raises."""
    if not isinstance(body, dict):
        return RoutingKey(session_id=header_session)
    session = header_session or _text(body.get("session_id" if path == "/generate" else "user"))
    if block_size is None:
        return RoutingKey(session_id=session)
    try:
        ids = _prompt_ids(path, body, tokenizer)
    except Exception as error:  # the replica will refuse the body; routing just does without a prefix
        log.debug("no routing key for %s: %r", path, error)
        ids = None
    salt = _text(body.get("cache_salt"))
    hashes = tuple(chain_hashes(ids, block_size, salt)) if ids else ()
    return RoutingKey(hashes, session)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def _prompt_ids(path: str, body: dict[str, Any], tokenizer: PromptTokenizer | None) -> Sequence[int] | None:
    add_special = body.get("add_special_tokens") is not False
    if path == "/generate":
        ids = _ids(body.get("prompt_token_ids"))
        return ids if ids is not None else _encode(body.get("prompt"), tokenizer, add_special)
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # several prompts: route by the first
        ids = _ids(prompt)
        return ids if ids is not None else _encode(prompt, tokenizer, add_special)
    if path == "/v1/chat/completions" and tokenizer is not None:
        messages = [{"role": m["role"], "content": _content(m.get("content"))} for m in body["messages"]]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return None


def _encode(prompt: Any, tokenizer: PromptTokenizer | None, add_special_tokens: bool) -> list[int] | None:
    if not isinstance(prompt, str) or tokenizer is None:
        return None
    return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)


def _content(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part["text"] for part in content if part.get("type") == "text")
