"""Cross-origin access (``ALLOWED_ORIGINS``, ``http/cors.py``) over real sockets, as a browser exercises it:
the preflight ``OPTIONS`` of a JSON POST, then the real request, its stream and its errors."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from http_testkit import RawConnection, SocketServer, assert_engine_clean, serving_on_socket

from inference_server.config import Settings, SettingsError, load_settings
from inference_server.models.tokenizer import Tokenizer

APP = "https://app.example.com"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "content-type, authorization"}
STREAM_BODY = json.dumps({"prompt": "hello", "max_tokens": 3, "stream": True}).encode()


@pytest.fixture(scope="module")
def listed(tokenizer: Tokenizer) -> Iterator[SocketServer]:
    with serving_on_socket(tokenizer=tokenizer, settings=Settings(allowed_origins=f"{APP},http://localhost:3000")) as s:
        yield s


def test_a_listed_origin_gets_its_preflight_answered_and_its_stream_readable(listed: SocketServer) -> None:
    with RawConnection(listed) as connection:
        connection.request("OPTIONS", "/v1/completions", headers=PREFLIGHT)
        preflight = connection.response()
        assert preflight is not None and preflight.status == 204, preflight
        assert preflight.headers["access-control-allow-origin"] == APP
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert preflight.headers["access-control-allow-headers"] == "content-type, authorization"
        assert preflight.headers["vary"] == "Origin"
        # The same connection carries the real request: the preflight left it usable.
        connection.request("POST", "/v1/completions", STREAM_BODY,
                           {"Origin": APP, "Content-Type": "application/json"})
        streamed = connection.response()
        assert streamed is not None and streamed.status == 200, streamed
        assert streamed.headers["access-control-allow-origin"] == APP
        assert "X-Trace-Id" in streamed.headers["access-control-expose-headers"]
        assert streamed.body.endswith(b"data: [DONE]\n\n")
        connection.request("POST", "/v1/completions", b"{", {"Origin": APP, "Content-Type": "application/json"})
        refused = connection.response()
        assert refused is not None and refused.status == 400
        assert refused.headers["access-control-allow-origin"] == APP  # the page can read why it failed
    listed.call(assert_engine_clean, listed.engine)


def test_an_unlisted_origin_and_a_plain_client_get_no_cors_headers(listed: SocketServer) -> None:
    with RawConnection(listed) as connection:
        connection.request("OPTIONS", "/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        refused = connection.response()
        assert refused is not None and refused.status == 200  # the app's own OPTIONS answer (Quart's: Allow)
        assert "OPTIONS" in refused.headers["allow"]
        assert not any(name.startswith("access-control-") for name in refused.headers)
        connection.request("GET", "/health", headers={"Origin": "https://evil.example"})
        health = connection.response()
        assert health is not None and health.status == 200
        assert "access-control-allow-origin" not in health.headers
        connection.request("GET", "/health")
        plain = connection.response()
        assert plain is not None and plain.status == 200 and "access-control-allow-origin" not in plain.headers


def test_any_origin_and_the_default_none(tokenizer: Tokenizer) -> None:
    with serving_on_socket(tokenizer=tokenizer, settings=Settings(allowed_origins="*")) as served, \
            RawConnection(served) as connection:
        connection.request("OPTIONS", "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://other:8080"})
        preflight = connection.response()
        assert preflight is not None and preflight.status == 204
        assert preflight.headers["access-control-allow-origin"] == "*" and "vary" not in preflight.headers
    with serving_on_socket(tokenizer=tokenizer) as served, RawConnection(served) as connection:
        connection.request("OPTIONS", "/v1/completions", headers=PREFLIGHT)
        default = connection.response()
        assert default is not None and default.status == 200 and "allow" in default.headers
        assert "access-control-allow-origin" not in default.headers


@pytest.mark.parametrize("value", ["app.example.com", "https://app.example.com/", "ftp://x", "*,https://a.b"])
def test_a_malformed_origin_stops_start_up(value: str) -> None:
    with pytest.raises(SettingsError, match="ALLOWED_ORIGINS"):
        load_settings(environ={"ALLOWED_ORIGINS": value}, dotenv_path=None)
