"""The HTTP surface: a Quart-Trio app serving a running engine (native ``/generate`` and the OpenAI routes).

Importable only as ``inference_server.http``. ``create_app(engine, settings)`` builds the app;
``server.serve`` runs it under Hypercorn beside the engine.
"""

from inference_server.http.app import app_state, create_app

__all__ = ["app_state", "create_app"]
