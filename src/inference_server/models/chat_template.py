"""Chat templates rendered the way transformers renders them: the sandboxed Jinja environment with its
filters and globals, a folder's template, and transformers' rule for leaving the final message open."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from inference_server.models.tokenizer_errors import ChatTemplateError

__all__ = ["folder_chat_template", "open_final_message", "template_environment"]


def open_final_message(text: str, final: Any) -> str:
    """``text`` (a rendered chat) cut right after the final message's content, so that message stays open.

    As transformers does: the content's last occurrence is found; when the template trimmed the content's
    trailing whitespace, the cut keeps the trimmed form."""
    if not isinstance(final, str) or not final.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text to continue")
    stripped = final.strip()
    if stripped not in text:
        raise ChatTemplateError("continue_final_message: the final message does not appear in the rendered chat")
    start = text.rindex(stripped)
    kept = final.lstrip()
    end = start + len(kept) if text[start:start + len(kept)] == kept else start + len(stripped)
    return text[:end]


def folder_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` if present, else ``tokenizer_config.json``'s ``chat_template`` (a string, or
    a list of ``{"name", "template"}`` of which the one named ``default`` is used)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        return named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def template_environment() -> jinja2.Environment:
    """The sandboxed environment transformers renders chat templates in."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
