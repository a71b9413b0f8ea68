"""What every route shares: the engine, the settings, the draining flag and the open-response tracker."""

from __future__ import annotations

import time

import attrs

from inference_server.config import Settings
from inference_server.engine_surface import ServingEngine
from inference_server.http.chat_output import resolve_parsers
from inference_server.http.errors import model_not_found, unavailable
from inference_server.http.generation import ResponseTracker
from inference_server.http.reasoning_parsers import ReasoningFormat
from inference_server.http.token_text import TokenText
from inference_server.http.tool_parsers import ToolCallFormat
from inference_server.models.chat_templates import ChatStops
from inference_server.telemetry.observability import Observability


@attrs.define(eq=False)
class AppState:
    """Owned by the app; ``server.serve`` flips ``draining`` on SIGTERM/SIGINT."""

    engine: ServingEngine
    settings: Settings
    observability: Observability
    tracker: ResponseTracker = attrs.Factory(ResponseTracker)
    token_text: TokenText = attrs.field(init=False)
    chat_stops: ChatStops = attrs.field(init=False)
    """The served chat template's turn markers, added to every chat request's stops."""
    tool_format: ToolCallFormat | None = attrs.field(init=False)
    reasoning_format: ReasoningFormat | None = attrs.field(init=False)
    """The tool-call and reasoning parsers of chat replies (``TOOL_CALL_PARSER``, ``REASONING_PARSER``)."""
    started_at: int = attrs.Factory(lambda: int(time.time()))
    draining: bool = False
    coalesce: bool = True
    """Merge buffered tokens into one SSE event (off only to measure what coalescing buys)."""

    def __attrs_post_init__(self) -> None:
        info = self.engine.info
        self.token_text = TokenText(info.tokenizer)
        self.chat_stops = ChatStops.of(info.tokenizer, info.eos_token_ids)
        self.tool_format, self.reasoning_format = resolve_parsers(
            self.settings.tool_call_parser, self.settings.reasoning_parser,
            getattr(info.tokenizer, "chat_template", None))

    @property
    def model_name(self) -> str:
        """The one name ``/v1/models`` lists and the OpenAI routes accept."""
        return self.engine.info.model_name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the routes accept: the reported one first, then ``SERVED_MODEL_NAME``'s aliases."""
        return tuple(dict.fromkeys([self.model_name, *self.settings.served_model_names()]))

    def check_model(self, model: str | None) -> None:
        """404 ``model_not_found`` unless ``model`` is absent or one of ``model_names``."""
        if model is not None and model not in self.model_names:
            raise model_not_found(model)

    def begin_drain(self) -> None:
        """New generation requests get 503 from now on and readiness turns 503."""
        self.draining = True

    def check_accepting(self) -> None:
        """Raise 503 ``draining`` once shutdown has begun (before anything is parsed or submitted)."""
        if self.draining:
            raise unavailable("the server is shutting down; retry shortly or on another instance", "draining")
