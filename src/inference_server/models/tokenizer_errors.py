"""The errors of tokenizer loading, conversion and chat templates (``models.tokenizer`` re-exports them)."""

from __future__ import annotations

__all__ = ["ChatTemplateError", "TokenizerError"]


class TokenizerError(Exception):
    """A tokenizer cannot be loaded or converted; the message names the file or folder."""


class ChatTemplateError(TokenizerError):
    """The model has no chat template (or it failed to render)."""
