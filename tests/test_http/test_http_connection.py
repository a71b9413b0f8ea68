"""The HTTP transport edge over real sockets (a real Hypercorn on 127.0.0.1): a refused or unread body
never leaves a keep-alive connection hanging, and a connection the server will close says so.

Each response either keeps the connection usable for the next request, or carries ``Connection: close``
and is followed by the server closing the connection. Never: a response that keeps the connection open
without answering the next request (the 413 keep-alive hang), or a close the client was not told about
(the drain's "server disconnected without sending a response").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from http_testkit import RawConnection, SocketServer, assert_engine_clean, serving_on_socket

from inference_server.config import Settings
from inference_server.http.body import DISCARD_LIMIT_BYTES
from inference_server.models.tokenizer import Tokenizer

MAX_BODY = 1000
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tokenizer: Tokenizer) -> Iterator[SocketServer]:
    with serving_on_socket(tokenizer=tokenizer, settings=Settings(max_body_bytes=MAX_BODY),
                           app_config={"BODY_TIMEOUT": 1}) as served:
        yield served


def assert_health(connection: RawConnection) -> None:
    connection.request("GET", "/health")
    response = connection.response()
    assert response is not None and response.status == 200, response


def assert_answered_then_closed(connection: RawConnection, status: int, code: str) -> None:
    response = connection.response()
    assert response is not None and response.status == status, response
    assert response.error()["code"] == code
    assert response.closes, response.headers
    assert connection.closed_by_server()


def test_oversized_body_is_413_and_the_connection_answers_the_next_request(server: SocketServer) -> None:
    """Many 64 KiB reads of a body over MAX_BODY_BYTES used to fill Hypercorn's queue to the app and leave the
    connection hanging; the body is now read and discarded, then the 413 is sent and the connection is
    reused."""
    body = json.dumps({"prompt": "hello " * 60_000}).encode()
    with RawConnection(server) as connection:
        connection.request("POST", "/generate", body, JSON)
        response = connection.response()
        assert response is not None and response.status == 413, response
        assert response.error()["code"] == "request_too_large"
        assert not response.closes
        assert_health(connection)
        connection.request("POST", "/generate", json.dumps({"prompt": "hello", "max_tokens": 2}).encode(), JSON)
        assert connection.response().status == 200


def test_body_beyond_the_discard_limit_is_413_and_closes(server: SocketServer) -> None:
    with RawConnection(server) as connection:
        connection.request("POST", "/v1/completions", b'{"prompt": "', JSON, content_length=DISCARD_LIMIT_BYTES + 1)
        assert_answered_then_closed(connection, 413, "request_too_large")


@pytest.mark.parametrize(("method", "path", "headers", "status", "code"), [
    ("POST", "/generate", {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    ("POST", "/v1/chat/completions", {"Content-Type": "application/x-www-form-urlencoded"}, 415,
     "unsupported_media_type"),
    ("POST", "/no/such/route", JSON, 404, "not_found"),
    ("POST", "/health", JSON, 405, "method_not_allowed"),
    ("POST", "/generate", {**JSON, "X-Trace-Id": "bad id"}, 400, "invalid_value"),
])
def test_an_error_before_the_body_is_read_says_close_and_closes(server: SocketServer, method: str, path: str,
                                                                headers: dict[str, str], status: int,
                                                                code: str) -> None:
    """The head arrives, the body does not (yet): the error is sent at once, says ``Connection: close``, and
    the connection is closed, so the client never reuses a connection the server is closing."""
    with RawConnection(server) as connection:
        connection.request(method, path, headers=headers, content_length=100)
        assert_answered_then_closed(connection, status, code)


def test_a_body_that_never_ends_is_408_and_closes(server: SocketServer) -> None:
    with RawConnection(server) as connection:
        connection.request("POST", "/generate", b'{"prompt": "hel', JSON, content_length=100)
        assert_answered_then_closed(connection, 408, "request_timeout")


def test_ordinary_errors_keep_the_connection(server: SocketServer) -> None:
    with RawConnection(server) as connection:
        for body in (b"{", b'{"prompt": 5}', b'{"prompt": "\\ud800"}', b'{"prompt": "x", "n": 0}'):
            connection.request("POST", "/v1/completions", body, JSON)
            response = connection.response()
            assert response is not None and response.status == 400 and not response.closes, response
            response.error()
        assert_health(connection)
    server.call(assert_engine_clean, server.engine)


def test_draining_responses_say_close(tokenizer: Tokenizer) -> None:
    """Once draining, every response says ``Connection: close`` (clients and load balancers then open fresh
    connections), also on a connection kept alive from before; ``/health`` still answers 200, ``/ready``
    and new work answer 503 ``draining``."""
    with serving_on_socket(tokenizer=tokenizer) as server, RawConnection(server) as kept, \
            RawConnection(server) as posting:
        assert_health(kept)
        server.run_sync(server.state.begin_drain)
        kept.request("GET", "/health")
        response = kept.response()
        assert response is not None and response.status == 200 and response.closes, response
        assert kept.closed_by_server()
        with RawConnection(server) as ready:
            ready.request("GET", "/ready")
            assert_answered_then_closed(ready, 503, "draining")
        posting.request("POST", "/v1/completions", json.dumps({"prompt": "x"}).encode(), JSON)
        assert_answered_then_closed(posting, 503, "draining")
        server.call(assert_engine_clean, server.engine)


def test_a_client_that_leaves_right_after_an_early_error_logs_no_server_error(
        server: SocketServer, caplog: pytest.LogCaptureFixture) -> None:
    """A client that reads the early error (the body never sent) and closes at once makes Hypercorn close the
    connection (its ``send_eof``, outside its send lock) while the app's final send is still writing the end
    of the response: that send used to raise ``trio.BusyResourceError``, logged as "Error in ASGI
    Framework" with a traceback for each such client. The race is hit on most tries, so a few dozen show it."""
    caplog.set_level(logging.ERROR)
    for _ in range(40):
        with RawConnection(server) as connection:
            connection.request("POST", "/generate", headers={"Content-Type": "text/plain"}, content_length=100)
            response = connection.response()
            assert response is not None and response.status == 415, response
    with RawConnection(server) as connection:  # every earlier connection was handled to its end
        assert_health(connection)
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert not errors, [record.getMessage() for record in errors]
