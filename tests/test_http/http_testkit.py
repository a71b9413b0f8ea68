"""Test kit for the HTTP tests (imported by them; ``conftest.py`` puts this folder on ``sys.path``): a tiny
word-level tokenizer, a fake in-loop step function, an engine + app served through the Quart test client or
through a real Hypercorn on a loopback socket, the engine leak check, and SSE helpers.

The step is the tests' fake engine (``tests/fake_engine.py``) as ``word_engine`` configures it: it answers each
sampled sequence with a word chosen by its length, so outputs are deterministic and readable ("w3 w4 w5 ...");
it can sleep per step, block, fail from a given step on, or emit EOS. With pytest-trio's ``autojump_clock`` the
sleeps cost no real time.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import attrs
import h11
import trio
from tests.fake_engine import FakeEngine
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from inference_server.config import Settings
from inference_server.core.grammar_compiler import GrammarCompiler
from inference_server.core.kv_manager import KVManager
from inference_server.core.scheduler import SchedulerConfig
from inference_server.engine_surface import ServingEngine
from inference_server.http import app_state, create_app
from inference_server.ipc.channel import open_socket_channel
from inference_server.ipc.engine_server import serve_engine
from inference_server.ipc.messages import ENGINE_TO_FRONT, FRONT_TO_ENGINE
from inference_server.ipc.remote_engine import RemoteEngine
from inference_server.models.tokenizer import Tokenizer
from inference_server.records.steps import PromptLogprobsChunk, StepPlan
from inference_server.server import _hypercorn_config, supervise_engine
from inference_server.supervisor import Engine, EngineParts

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
BASE_WORDS = ["user", "model", "system", "the", "capital", "of", "france", "is", "paris", "hello", "world",
              "a", "b", "c", ".", ",", "?", "!", "stop", "here", "and", "what", "said"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
EOS_ID = 1
MODEL_NAME = "tiny-test"

# Every Prometheus family /metrics exposes -> the sample suffix whose value must grow during a run ("": a gauge,
# which must be seen above 0 during the run). Shared by the fake-engine and embedded-model tests.
MOVING_FAMILIES = {
    "vllm:num_requests_running": "", "vllm:num_requests_waiting": "", "vllm:kv_cache_usage_perc": "",
    "vllm:prompt_tokens": "_total", "vllm:generation_tokens": "_total", "vllm:request_success": "_total",
    "vllm:num_preemptions": "_total", "vllm:prefix_cache_queries": "_total", "vllm:prefix_cache_hits": "_total",
    "vllm:time_to_first_token_seconds": "_count", "vllm:inter_token_latency_seconds": "_count",
    "vllm:request_time_per_output_token_seconds": "_count", "vllm:e2e_request_latency_seconds": "_count",
    "vllm:request_queue_time_seconds": "_count", "vllm:request_inference_time_seconds": "_count",
    "vllm:request_prefill_time_seconds": "_count", "vllm:request_decode_time_seconds": "_count",
    "vllm:iteration_tokens_total": "_count", "vllm:request_prompt_tokens": "_count",
    "vllm:request_generation_tokens": "_count", "vllm:request_num_preemptions": "_count",
    "inference_server:kv_cache_usage_perc": "", "inference_server:num_requests_preempted": "",
    "inference_server:rejections": "_total", "inference_server:session_tokens": "_total",
    "inference_server:session_requests": "_total", "inference_server:step_phase_seconds": "_count",
    "inference_server:steps": "_total",
}


def write_tokenizer_folder(folder: Path, vocab_size: int = 512) -> Path:
    """A word-level tokenizer of exactly ``vocab_size`` ids (specials, a few words, then ``w0``, ``w1``, ...),
    saved as tokenizer.json + tokenizer_config.json with a chat template."""
    words = SPECIAL_TOKENS + BASE_WORDS
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    backend = BackendTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


FIRST_WORD_ID = len(SPECIAL_TOKENS) + len(BASE_WORDS)  # "w0"
NUM_WORDS = 100


def fake_token(length: int) -> int:
    """The fake model's next token for a sequence of ``length`` tokens: ``w<length mod 100>``."""
    return FIRST_WORD_ID + length % NUM_WORDS


def fake_prompt_logprob(position: int) -> float:
    """The fake model's logprob of the prompt token at ``position`` (>= 1)."""
    return -position / 8


def fake_prompt_top(position: int, k: int) -> tuple[tuple[int, float], ...]:
    """The fake model's top-k at prompt position ``position``: the tokens it would have sampled there."""
    return tuple((fake_token(position + j), -0.5 * (j + 1)) for j in range(k))


def fake_prompt_logprobs(plan: StepPlan) -> tuple[PromptLogprobsChunk, ...]:
    """Deterministic prompt logprobs for every chunk that asks for them (positions as the real runner's)."""
    chunks = []
    for seq in plan.sequences:
        if seq.prompt_logprob_targets:
            positions = range(seq.cached_len + 1, seq.cached_len + 1 + len(seq.prompt_logprob_targets))
            chunks.append(PromptLogprobsChunk(
                seq.request_id, seq.cached_len + 1, tuple(fake_prompt_logprob(p) for p in positions),
                tuple(fake_prompt_top(p, seq.prompt_logprobs_top) for p in positions)))
    return tuple(chunks)


def word_engine(**fields: Any) -> FakeEngine:
    """The fake engine as the routes see it: words by length (``fake_token``), EOS id ``EOS_ID``, logprob -0.25,
    deterministic prompt logprobs; it keeps no plans and does not check contiguity (servers run long). ``fields``
    are ``FakeEngine``'s (``step_seconds``, ``gate``, ``fail_at``, ``eos_at_length``, ``use_sampler``, ...)."""
    defaults: dict[str, Any] = dict(token=lambda length, _last: fake_token(length), logprob=-0.25,
                                    eos_token_id=EOS_ID, prompt_logprobs=fake_prompt_logprobs,
                                    vocab_size=FAKE_VOCAB_SIZE, check_contiguous=False, keep_plans=False)
    return FakeEngine(**(defaults | fields))


FAKE_VOCAB_SIZE = 512


def byte_level_tokenizer_json(vocab_size: int = FAKE_VOCAB_SIZE) -> str:
    """A byte-level BPE ``tokenizer.json`` of ``vocab_size`` ids (``<pad>``, ``<eos>``, ``<bos>``, the 256
    byte symbols, then fillers): one llguidance can read, for the fake engine's grammar compiler (the word-level
    test tokenizer has a decoder llguidance does not know). The fake model never reads a mask (see
    ``FakeEngine``): structured outputs on it check fields and errors; the embedded model's tests check output."""
    vocab = {"<pad>": 0, "<eos>": EOS_ID, "<bos>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"filler{len(vocab)}"] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    return backend.to_str()


def make_parts(model: FakeEngine, tokenizer: Tokenizer | None, **overrides: Any) -> EngineParts:
    """Engine parts around ``model``: 512-id vocabulary, 128-token context, 4-token KV blocks; a grammar
    compiler over a byte-level vocabulary of the same size when there is a tokenizer."""
    scheduler = SchedulerConfig(max_batch_size=overrides.pop("max_batch_size", 8), max_num_batched_tokens=512)
    values: dict[str, Any] = dict(
        step=model, kv=KVManager(block_size=4, num_full_blocks=overrides.pop("num_blocks", 512)),
        tokenizer=tokenizer, max_model_len=128, vocab_size=512, eos_token_ids=frozenset({EOS_ID}),
        scheduler_config=scheduler, model_name=MODEL_NAME,
        grammar=GrammarCompiler(byte_level_tokenizer_json(), FAKE_VOCAB_SIZE, {EOS_ID}) if tokenizer else None)
    values.update(overrides)
    return EngineParts(**values)


def split_word_parts(settings: Settings) -> EngineParts:
    """The engine process's parts in the split-server tests (``run_split_server(engine_factory=
    "http_testkit:split_word_parts")``): the word engine with no tokenizer (token-id prompts), a 256-token
    context, batch and queue sizes from ``settings``. From the environment: ``SPLIT_STEP_SECONDS`` (each step's
    length, default 0.01), ``SPLIT_MAX_MODEL_LEN`` (the context, default 256; the KV cache holds three such
    requests at least), ``SPLIT_GATE_FILE`` (steps wait until that file exists: a stalled engine whose
    queue fills up) and ``SPLIT_START_FILE`` (the factory itself blocks until that file exists: an engine wedged
    in its start-up, outside any event loop)."""
    import os
    import time

    start_file = os.environ.get("SPLIT_START_FILE")
    while start_file and not Path(start_file).exists():
        time.sleep(0.05)  # a poll of another process's signal, not a timing assumption
    step_seconds = float(os.environ.get("SPLIT_STEP_SECONDS", "0.01"))
    max_model_len = int(os.environ.get("SPLIT_MAX_MODEL_LEN", "256"))
    num_blocks = max(512, 3 * max_model_len // 4)  # 4-token blocks
    model = word_engine(step_seconds=step_seconds)
    gate_file = os.environ.get("SPLIT_GATE_FILE")
    if gate_file:
        ungated = model.__call__

        async def gated(plan: StepPlan) -> Any:
            while not Path(gate_file).exists():
                await trio.sleep(0.01)  # a poll of another process's signal, not a timing assumption
            return await ungated(plan)

        return make_parts(gated, None, max_batch_size=settings.max_batch_size,  # type: ignore[arg-type]
                          max_queue_size=settings.max_queue_size, max_model_len=max_model_len, num_blocks=num_blocks)
    return make_parts(model, None, max_batch_size=settings.max_batch_size, max_queue_size=settings.max_queue_size,
                      max_model_len=max_model_len, num_blocks=num_blocks)


@attrs.define
class Served:
    """An engine with its app, and the Quart test client."""

    engine: Engine
    app: Any
    client: Any
    model: FakeEngine
    failures: list[int]
    separate: bool = False

    @property
    def state(self):
        return app_state(self.app)

    def kv_is_idle(self) -> bool:
        """No request holds KV blocks (every path released exactly once)."""
        kv = self.engine.parts.kv
        return not self.engine.scheduler.requests and kv.num_sequences == 0 and kv.full_pool.num_referenced == 0

    async def kv_settles_idle(self, timeout: float = 30.0) -> bool:
        """``kv_is_idle`` at once in one process. With a separate engine the front ends a stream on a stop
        string before the engine ends the request (docs/ipc.md, decision 1): idle once the front's abort has
        reached the engine, waited for up to ``timeout`` seconds (then the answer is False)."""
        if self.separate:
            with trio.move_on_after(timeout):
                while not self.kv_is_idle():
                    await trio.sleep(0.005)
        return self.kv_is_idle()


@asynccontextmanager
async def serving(model: FakeEngine | None = None, tokenizer: Tokenizer | None = None, *,
                  settings: Settings | None = None, coalesce: bool = True, separate: bool = False,
                  **overrides: Any) -> AsyncIterator[Served]:
    """Start an engine on a fake model, serve it with ``create_app`` and yield the test client. ``separate``: the
    app serves a ``RemoteEngine`` joined to the engine's ``serve_engine`` by a SocketChannel over a socketpair (the
    process boundary's code, in this trio run: ``pytest --engine-process=separate``); ``Served.engine`` is then
    the engine side's ``Engine``."""
    model = model or word_engine()
    failures: list[int] = []
    async with trio.open_nursery() as nursery:
        engine = Engine(make_parts(model, tokenizer, **overrides))
        front: ServingEngine
        if separate:
            front = await nursery.start(_split_front, engine, tokenizer, failures)
        else:
            front = await nursery.start(supervise_engine, engine, failures.append)
        app = create_app(front, settings or Settings(), coalesce=coalesce)
        async with app.test_app() as test_app:
            yield Served(engine, app, test_app.test_client(), model, failures, separate)
        if model.gate is not None:
            model.gate.set()
        await front.drain(0)


async def _split_front(engine: Engine, tokenizer: Tokenizer | None, failures: list[int], *,
                       task_status: trio.TaskStatus[RemoteEngine] = trio.TASK_STATUS_IGNORED) -> None:
    """``engine`` behind ``serve_engine`` and a ``RemoteEngine`` (started) on a socketpair; an engine failure
    is recorded in ``failures`` as ``supervise_engine`` does."""
    front_socket, engine_socket = socket.socketpair()
    async with (open_socket_channel(front_socket, 8, receive_type=ENGINE_TO_FRONT) as front_channel,
                trio.open_nursery() as nursery):
        remote = RemoteEngine(front_channel, max_queue_size=engine.parts.max_queue_size, tokenizer=tokenizer)

        async def engine_side() -> None:
            async with open_socket_channel(engine_socket, 16, receive_type=FRONT_TO_ENGINE) as channel:
                if await serve_engine(engine, channel):
                    failures.append(1)

        nursery.start_soon(engine_side)
        await nursery.start(remote.run)
        task_status.started(remote)


# -- a real server on a loopback socket ---------------------------------------------------------------------

SOCKET_SERVER_START_TIMEOUT = 60.0


@attrs.define
class SocketServer:
    """An engine and its app under a real Hypercorn on ``127.0.0.1`` (an ephemeral port), run by a trio
    loop in a background thread; tests talk to it over real sockets from their own thread."""

    host: str
    port: int
    engine: Engine
    app: Any
    model: FakeEngine
    failures: list[int]
    token: trio.lowlevel.TrioToken

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self):
        return app_state(self.app)

    def call(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``async_fn(*args)`` in the server's trio loop and return its result (from the test thread)."""
        return trio.from_thread.run(async_fn, *args, trio_token=self.token)

    def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the server's trio loop (e.g. to flip the app's state) and return its result."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)


_Started = TypeVar("_Started")


def run_trio_in_thread(main: Callable[[], Awaitable[None]], started: queue.Queue[_Started | BaseException], name: str,
                       timeout: float) -> tuple[_Started, threading.Thread]:
    """``trio.run(main)`` in a daemon thread named ``name``; returns the first thing ``main`` puts in ``started``
    (within ``timeout`` seconds) and the thread. An error that ends the thread's loop is put there too, so one
    raised before ``main`` got going is raised here."""

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as error:  # handed to the test thread
            started.put(error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    first = started.get(timeout=timeout)
    if isinstance(first, BaseException):
        raise first
    return first, thread


@contextmanager
def serving_on_socket(model: FakeEngine | None = None, tokenizer: Tokenizer | None = None, *,
                      settings: Settings | None = None, app_config: dict[str, Any] | None = None,
                      **overrides: Any) -> Iterator[SocketServer]:
    """Serve a fake-model engine with ``create_app`` under Hypercorn on 127.0.0.1 (see ``SocketServer``);
    ``app_config`` overrides the Quart config (e.g. ``BODY_TIMEOUT``). On exit Hypercorn stops, the engine
    drains and the thread ends; an error inside the server thread is raised here."""
    model = model or word_engine()
    settings = settings or Settings()
    started: queue.Queue[SocketServer | BaseException] = queue.Queue()
    stop = trio.Event()

    async def main() -> None:
        failures: list[int] = []
        async with trio.open_nursery() as nursery:
            engine = await nursery.start(supervise_engine, Engine(make_parts(model, tokenizer, **overrides)),
                                         failures.append)
            app = create_app(engine, settings)
            app.config.update(app_config or {})
            config = _hypercorn_config(settings)
            config.bind = ["127.0.0.1:0"]
            binds = await nursery.start(_hypercorn, app, config, stop)
            port = int(binds[0].rsplit(":", 1)[1])
            started.put(SocketServer("127.0.0.1", port, engine, app, model, failures,
                                     trio.lowlevel.current_trio_token()))
            await stop.wait()
            if model.gate is not None:
                model.gate.set()
            await engine.drain(0)

    first, thread = run_trio_in_thread(main, started, "socket-server", SOCKET_SERVER_START_TIMEOUT)
    try:
        yield first
    finally:
        trio.from_thread.run_sync(stop.set, trio_token=first.token)
        thread.join(SOCKET_SERVER_START_TIMEOUT)
        assert not thread.is_alive(), "the socket server did not stop"
        if not started.empty():
            raise started.get()


async def _hypercorn(app: Any, config: Any, stop: trio.Event, *,
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    from hypercorn.trio import serve

    await serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)  # type: ignore[arg-type]


class RawConnection:
    """One client TCP connection spoken to byte by byte (for what httpx will not send: bodies cut short,
    lying lengths, headers without a body); responses are parsed with h11."""

    def __init__(self, server: SocketServer, timeout: float = 30.0) -> None:
        self.socket = socket.create_connection((server.host, server.port), timeout=timeout)
        self.buffer = b""

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.socket.close()

    def send(self, data: bytes) -> None:
        self.socket.sendall(data)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None, *,
                content_length: int | None = None) -> None:
        """Send a request head and ``body`` (``content_length`` overrides the declared length)."""
        head = {"Host": "test", **(headers or {})}
        if body is not None or content_length is not None:
            head["Content-Length"] = str(len(body or b"") if content_length is None else content_length)
        lines = "".join(f"{name}: {value}\r\n" for name, value in head.items())
        self.send(f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode() + (body or b""))

    def response(self) -> RawResponse | None:
        """The next response, or None when the server closed the connection before sending one."""
        parser = h11.Connection(h11.CLIENT)
        parser.send(h11.Request(method="GET", target="/", headers=[("Host", "test")]))  # expect one response
        parser.send(h11.EndOfMessage())
        if self.buffer:  # (receive_data(b"") would mean end of stream)
            parser.receive_data(self.buffer)
        self.buffer = b""
        status, headers, body = None, {}, b""
        while True:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                data = self.socket.recv(65536)
                if not data and status is None:
                    return None
                parser.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {name.decode().lower(): value.decode() for name, value in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.buffer = parser.trailing_data[0]
                return RawResponse(status, headers, body)

    def closed_by_server(self) -> bool:
        """Whether the server closed the connection (EOF, or a reset) with nothing more to read."""
        try:
            return not self.buffer and self.socket.recv(65536) == b""
        except ConnectionResetError:
            return True


@attrs.frozen
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def closes(self) -> bool:
        """The response says the server closes the connection after it."""
        return "close" in self.headers.get("connection", "").lower()

    def error(self) -> dict[str, Any]:
        """The OpenAI-shaped error object of a JSON error response (asserted)."""
        assert self.headers["content-type"].startswith("application/json"), self
        payload = json.loads(self.body)
        assert set(payload) == {"error"} or "status" in payload, payload
        error = payload["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
        assert isinstance(error["type"], str) and (error["code"] is None or isinstance(error["code"], str)), error
        assert error["param"] is None or isinstance(error["param"], str), error
        return error


# -- the leak check ------------------------------------------------------------------------------------------


def engine_leaks(engine: Engine) -> list[str]:
    """What an idle engine still holds (``Engine.counts``): requests, stream entries, KV sequences, and KV
    blocks referenced by anything but the prefix cache (whose blocks stay cached with refcount 0)."""
    counts = engine.counts()
    held = {"requests": counts.requests, "stream entries": counts.stream_entries,
            "KV sequences": counts.kv_sequences, "referenced KV blocks": counts.kv_blocks_in_use}
    return [f"{n} {what}" for what, n in held.items() if n]


ENGINE_CLEAN_TIMEOUT = 30.0


async def assert_engine_clean(engine: Engine, timeout: float = ENGINE_CLEAN_TIMEOUT) -> None:
    """Wait (at most ``timeout`` s, polling between trio checkpoints) until ``engine`` is idle, then assert
    it holds nothing: no requests in the scheduler, no stream entries, no KV blocks except the prefix cache's
    (and the KV manager's own integrity check passes). Meant for real-socket tests, where the engine may
    still be finishing a request whose client has just left."""
    with trio.move_on_after(timeout):
        while engine_leaks(engine):
            await trio.sleep(0.01)
    assert not engine_leaks(engine), f"after {timeout} s the engine still holds: {'; '.join(engine_leaks(engine))}"
    engine.check_integrity()


# -- SSE helpers --------------------------------------------------------------------------------------------


def parse_sse(body: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body: decoded JSON objects, and the string ``"[DONE]"``."""
    events = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = [line for line in block.split("\n") if line.startswith("data: ")]
        assert len(lines) == 1, block
        data = lines[0][len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


@attrs.define
class StreamResult:
    status: int
    headers: Any
    chunks: list[bytes]

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def events(self) -> list[Any]:
        return parse_sse(self.body)


async def post_stream(client: Any, path: str, payload: Any, headers: dict[str, str] | None = None) -> StreamResult:
    """POST ``payload`` and read the whole (streamed) response, chunk by chunk as the app sent it."""
    connection = client.request(path, method="POST", headers={"Content-Type": "application/json", **(headers or {})})
    chunks: list[bytes] = []
    async with connection:
        await connection.send(json.dumps(payload).encode())
        await connection.send_complete()
        while True:
            try:
                chunks.append(await connection.receive())
            except trio.EndOfChannel:
                break
    return StreamResult(connection.status_code, connection.headers, chunks)


async def assert_error(response: Any, status: int, code: str | None, param: str | None = None) -> dict[str, Any]:
    """``response`` is a JSON OpenAI-shaped error with this status, code and (when given) param."""
    assert response.status_code == status, await response.get_data()
    assert response.headers["Content-Type"].startswith("application/json")
    payload = await response.get_json()
    assert set(payload) == {"error"} or "status" in payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    if status in (429, 503, 504):
        assert int(response.headers["Retry-After"]) >= 1
    return error
