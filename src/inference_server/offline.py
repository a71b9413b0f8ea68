"""Offline Python API (vLLM's ``LLM``; docs/offline.md): ``LLM(settings).generate(prompts, sampling_params)`` and
``LLM(settings).chat(conversations, sampling_params)``, through the same actors as the server.

Each call runs the engine under its own ``trio.run``, submits one engine request per sample of every prompt
(``SamplingParams.samples``; again, as others end, those the engine refused as overloaded), collects each stream
to its terminal update, shuts the engine down cleanly and groups the samples back into one ``Completion`` per
prompt. Calls on one ``LLM`` take turns; one ended by an exception leaves the next to rebuild
the engine parts.
"""

from __future__ import annotations

import importlib
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, TypeVar

import attrs
import trio

from inference_server.actors.request_handle import RequestHandle
from inference_server.config import Settings
from inference_server.engine_factory import BuiltEngine, build_engine_parts
from inference_server.models.chat_templates import ChatStops
from inference_server.models.tokenizer import Tokenizer
from inference_server.records.errors import RequestError
from inference_server.records.requests import ChatMessage, GenerationRequest, PromptTokenLogprob
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import Engine, EngineParts

T = TypeVar("T")


@attrs.frozen
class CompletionOutput:
    """One sample of a prompt (vLLM's ``CompletionOutput``): its text, tokens and why it ended."""

    index: int
    """Which of the prompt's ``SamplingParams.n`` samples this is (0-based; ``Completion.outputs`` is in order)."""
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    """``stop``, ``length``, or ``error`` (a refused request, or an engine failure: ``error`` says which)."""
    stop_reason: str | int | None = None
    """What ended a ``stop`` finish (vLLM's ``stop_reason``): the stop string, or the stop token id (one of
    ``SamplingParams.stop_token_ids``, or a chat turn marker that is not an EOS id); None for an EOS token, a
    ``length`` finish and any other end."""
    error: str | None = None
    logprobs: tuple[float, ...] = ()
    """Each output token's logprob."""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    """Per output token, the ``SamplingParams.logprobs`` best (token id, logprob) pairs, best first (what the
    HTTP routes return as ``top_logprobs``)."""

    @property
    def cumulative_logprob(self) -> float:
        """The sum of the output tokens' logprobs (vLLM's ``cumulative_logprob``: ranks a prompt's samples)."""
        return math.fsum(self.logprobs)


@attrs.frozen
class Completion:
    """One prompt's result (vLLM's ``RequestOutput``): its samples and its prompt.

    ``outputs`` holds ``SamplingParams.n`` samples, by ``index``. ``text``, ``token_ids``, ``finish_reason``,
    ``stop_reason``, ``error``, ``logprobs`` and ``top_logprobs`` are the first sample's (all of it when ``n`` is
    1, the default)."""

    outputs: tuple[CompletionOutput, ...]
    prompt_tokens: int
    prompt_token_ids: tuple[int, ...] = ()
    """The prompt as the model saw it (after the chat template and truncation); empty for a refused request."""
    prompt_logprobs: tuple[PromptTokenLogprob, ...] | None = None  # with ``SamplingParams.prompt_logprobs``

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def error(self) -> str | None:
        return self.outputs[0].error

    @property
    def logprobs(self) -> tuple[float, ...]:
        return self.outputs[0].logprobs

    @property
    def top_logprobs(self) -> tuple[tuple[tuple[int, float], ...], ...]:
        return self.outputs[0].top_logprobs


def refused(error: RequestError) -> Completion:
    """The completion of a request refused before it produced anything: no tokens, ``error`` as ``code: message``."""
    return Completion((CompletionOutput(0, "", (), "error", error=f"{error.code}: {error.message}"),), 0)


async def collect(handle: RequestHandle) -> Completion:
    """Read a request to its end through its handle (closing it): a completion of one output."""
    async with handle:
        try:
            prompt_tokens = await handle.admission()
            result = await handle.result()
        except RequestError as error:
            return refused(error)
    output = CompletionOutput(0, "".join(t.text for t in result.tokens), tuple(t.token_id for t in result.tokens),
                              result.finish_reason or "error", result.stop_reason, result.error,
                              tuple(t.logprob for t in result.tokens), tuple(t.top_logprobs for t in result.tokens))
    return Completion((output,), prompt_tokens, handle.prompt_token_ids, result.prompt_logprobs)


def grouped(completions: Sequence[Completion], counts: Sequence[int]) -> list[Completion]:
    """The completions of consecutive requests, ``counts[i]`` of them for prompt ``i``, as one completion per
    prompt whose outputs are its samples in order (each indexed by its place); the prompt's fields come from its
    first admitted sample (all samples share the prompt)."""
    out, start = [], 0
    for count in counts:
        samples = completions[start:start + count]
        start += count
        admitted = next((c for c in samples if c.prompt_tokens), samples[0])
        outputs = tuple(attrs.evolve(c.outputs[0], index=j) for j, c in enumerate(samples))
        out.append(attrs.evolve(admitted, outputs=outputs))
    return out


class Turnover:
    """A batch's requests in the engine now, and those refused as ``overloaded`` that wait for a place.

    Each request that ends (or gives up) hands its place to the longest waiter, one at a time: waking every
    waiter at each end would resubmit them all, to be refused again, at every one of the batch's ends."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.waiting: deque[trio.Event] = deque()

    def submit(self, engine: Engine, request: GenerationRequest) -> RequestHandle:
        """``engine.submit(request)``, counted in flight until its ``collect_through_overload`` reads its end."""
        self.in_flight += 1
        return engine.submit(request)

    def hand_on(self) -> None:
        """Wake the longest waiter, if any, to submit again."""
        if self.waiting:
            self.waiting.popleft().set()

    async def wait_for_a_place(self) -> None:
        place = trio.Event()
        self.waiting.append(place)
        await place.wait()


def is_overloaded(completion: Completion) -> bool:
    """Whether the engine refused the request as ``overloaded`` (a full admission queue, the queued-token cap
    or the KV backlog): a refusal that a later submission can change."""
    return completion.error is not None and completion.error.partition(":")[0] == "overloaded"


async def collect_through_overload(engine: Engine, request: GenerationRequest, handle: RequestHandle,
                                   turnover: Turnover) -> Completion:
    """Read ``request`` (submitted as ``handle`` by ``turnover.submit``) to its end; refused as ``overloaded``
    while other requests of the batch are in flight, submit it again once one of them ends. The engine's caps
    (``MAX_QUEUE_SIZE``, ``MAX_QUEUED_TOKENS``, the admission timeout) are a server's backpressure for its
    clients; an offline batch is one client that waits, so a batch larger than the queue completes whole (as
    vLLM's ``LLM.generate`` does) instead of its excess ending ``overloaded``."""
    while True:
        try:
            completion = await collect(handle)
        finally:
            turnover.in_flight -= 1
        if is_overloaded(completion) and turnover.in_flight > 0:
            # a later end of one of those in flight hands this request a place (the last of them to end or be
            # refused always hands one on, so no waiter is left behind)
            await turnover.wait_for_a_place()
            handle = turnover.submit(engine, request)
            continue
        turnover.hand_on()  # an end, or a refusal with nothing else in the engine (it cannot fit): a place
        return completion


async def run_engine(parts: EngineParts, requests: Sequence[GenerationRequest],
                     on_done: Callable[[int], None] | None = None) -> tuple[Engine, list[Completion]]:
    """Start an engine on ``parts``, run ``requests`` concurrently (submitted in order; those refused as
    ``overloaded`` again as the batch's others end, ``collect_through_overload``), stop the engine; returns the
    stopped engine (for inspection) and one completion per request, in order. ``on_done(i)`` is called as
    request ``i`` ends (in the order they end: a progress bar's tick).

    A request's structured-output constraint is compiled in a worker thread before it is submitted
    (``Engine.compile_constraints``, as the HTTP routes do): admission would otherwise compile it on the event loop
    that also plans the engine's steps (milliseconds to a second a schema, each distinct one once). One that does
    not compile is that request's error completion, and it is not submitted."""
    results: list[Completion | None] = [None] * len(requests)
    turnover = Turnover()
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        async with trio.open_nursery() as clients:
            for index, request in enumerate(requests):
                try:
                    await engine.compile_constraints([request])  # no checkpoint without a constraint to compile
                except RequestError as error:
                    results[index] = refused(error)
                    if on_done is not None:
                        on_done(index)
                    continue
                handle = turnover.submit(engine, request)

                async def consume(i: int = index, r: GenerationRequest = request, h: RequestHandle = handle) -> None:
                    results[i] = await collect_through_overload(engine, r, h, turnover)
                    if on_done is not None:
                        on_done(i)

                clients.start_soon(consume)
        engine.close()
    return engine, [r for r in results if r is not None]


async def generate_with(parts: EngineParts, requests: Sequence[GenerationRequest],
                        on_done: Callable[[int], None] | None = None) -> list[Completion]:
    """The completions of ``requests``, in order, on a fresh engine over ``parts`` (``run_engine``'s, with its
    ``on_done``)."""
    _, completions = await run_engine(parts, requests, on_done)
    return completions


Prompt: TypeAlias = str | Sequence[int] | Mapping[str, Any]
"""One prompt of the offline API: text, token ids, or vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``."""


def one_prompt(item: object) -> str | tuple[int, ...]:
    """``item`` as text or token ids; raises ``TypeError`` naming anything else (without it, a dict was
    iterated as its keys: ``{"prompt": "Hi"}`` completed the text "prompt")."""
    if isinstance(item, Mapping):
        if set(item) == {"prompt"} and isinstance(item["prompt"], str):
            return item["prompt"]
        if set(item) != {"prompt_token_ids"}:
            raise TypeError(f"a prompt dict is {{'prompt': text}} or {{'prompt_token_ids': ids}}, got {item!r:.100}")
        item = item["prompt_token_ids"]
    if isinstance(item, str):
        return item
    if isinstance(item, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        return tuple(item)
    raise TypeError(f"a prompt is text, token ids or a dict of either, got {item!r:.100}")


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | tuple[int, ...]]:
    """``prompts`` as a list of prompts: one text, one token-id list or one prompt dict is a batch of one
    (vLLM's ``LLM.generate`` takes either). Without this a string was iterated into one prompt per character
    and a token-id list into one prompt per id."""
    if isinstance(prompts, str | Mapping) or not isinstance(prompts, Iterable):
        return [one_prompt(prompts)]  # one prompt, or a TypeError naming what is not one
    items = list(prompts)
    if items and all(isinstance(item, int) for item in items):
        return [one_prompt(items)]  # a list of ints is one token-id prompt
    return [one_prompt(item) for item in items]


def params_per_item(params: SamplingParams | Sequence[SamplingParams] | None, count: int,
                    items: str) -> list[SamplingParams]:
    """One ``SamplingParams`` for each of ``count`` prompts or conversations (``items`` names them in the
    error): one for all, one each, or None for ``SamplingParams()``."""
    if params is None:
        params = SamplingParams()
    per_item = list(params) if isinstance(params, Sequence) else [params] * count
    if len(per_item) != count:
        raise ValueError(f"{count} {items} but {len(per_item)} SamplingParams: give one for every "
                         f"{items.removesuffix('s')} or one per {items.removesuffix('s')}")
    return per_item


Conversation: TypeAlias = Sequence[Mapping[str, Any]]
"""One chat of the offline API: OpenAI-style message dicts (``{"role": "user", "content": "Hi"}``)."""


def conversation_list(messages: Conversation | Sequence[Conversation]) -> list[Sequence[object]]:
    """``messages`` as a list of conversations: a list of message dicts is one conversation, a list of such
    lists a batch (vLLM's rule: the first item decides; an empty list is an empty batch)."""
    if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence):
        raise TypeError(f"messages is a list of message dicts or a list of such lists, got {messages!r:.100}")
    items = list(messages)
    if not items or (isinstance(items[0], Sequence) and not isinstance(items[0], str | Mapping)):
        for item in items:
            if isinstance(item, str | Mapping) or not isinstance(item, Sequence):
                raise TypeError(f"a batch of conversations holds lists of message dicts, got {item!r:.100}")
        return [list(item) for item in items]
    return [items]


def http_checked(check: Callable[[], T]) -> T:
    """``check()``, an ``ApiError`` of the HTTP chat route's own checks raised as the ``ValueError`` a Python
    caller expects, naming the field (``messages[0].role: ...``)."""
    from inference_server.http.errors import ApiError

    try:
        return check()
    except ApiError as error:
        raise ValueError(f"{error.param}: {error.message}" if error.param else error.message) from None


def conversation_messages(conversation: Sequence[object]) -> tuple[ChatMessage, ...]:
    """One conversation's messages, read as ``/v1/chat/completions`` reads its ``messages`` (the same parser and
    rules: roles, text content parts joined by newlines, an agent loop's ``tool_calls`` / ``tool_call_id`` /
    ``name`` / ``reasoning_content``, unknown keys refused); raises ``ValueError`` naming the field."""
    from inference_server.http.body_parser import structure
    from inference_server.http.openai import chat_messages
    from inference_server.http.schemas import ChatCompletionRequest

    body = {"messages": [dict(m) if isinstance(m, Mapping) else m for m in conversation]}
    return http_checked(lambda: chat_messages(structure(body, ChatCompletionRequest).messages))


def chat_options(tools: object, chat_template_kwargs: object
                 ) -> tuple[tuple[dict[str, Any], ...] | None, dict[str, Any] | None]:
    """``tools`` and ``chat_template_kwargs`` checked as the HTTP chat route checks them (function tools with
    valid, unique names; no template variable the server sets itself): the template's ``tools`` (None for none
    or an empty list) and extra variables; raises ``ValueError`` naming the field."""
    from inference_server.http.body_parser import structure
    from inference_server.http.chat_tools import check_tools, template_kwargs
    from inference_server.http.schemas import ChatCompletionRequest

    body: dict[str, Any] = {"messages": []}
    if tools is not None:
        body["tools"] = [dict(t) if isinstance(t, Mapping) else t for t in tools] \
            if isinstance(tools, Sequence) and not isinstance(tools, str) else tools
    if chat_template_kwargs is not None:
        body["chat_template_kwargs"] = dict(chat_template_kwargs) if isinstance(chat_template_kwargs, Mapping) \
            else chat_template_kwargs

    def check() -> tuple[tuple[dict[str, Any], ...] | None, dict[str, Any] | None]:
        fields = structure(body, ChatCompletionRequest)
        return check_tools(fields.tools) or None, template_kwargs(fields.chat_template_kwargs)

    return http_checked(check)


def chat_flags(add_generation_prompt: bool | None, continue_final_message: bool,
               last_role: str) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final_message)`` by the HTTP chat route's rules: the first defaults to
    ``not continue_final_message``, both true is an error, and only an assistant's final message is continued;
    raises ``ValueError`` naming the argument."""
    from inference_server.http.convert import chat_prompt_flags

    return http_checked(lambda: chat_prompt_flags(add_generation_prompt, continue_final_message, last_role))


class ProgressBar(Protocol):
    """What the offline API needs of a progress bar (``tqdm``'s ``update`` and ``close``)."""

    def update(self, n: int = 1) -> object: ...

    def close(self) -> object: ...


UseTqdm: TypeAlias = bool | Callable[..., ProgressBar]
"""vLLM's ``use_tqdm``: whether to show a progress bar over completed prompts, or a callable that builds one
as ``tqdm`` does (called with ``total=``, ``desc=`` and ``dynamic_ncols=``)."""


def progress_bar(use_tqdm: UseTqdm, total: int) -> ProgressBar | None:
    """The progress bar ``use_tqdm`` asks for over ``total`` prompts: the callable's, ``tqdm``'s for a true value
    (None when ``tqdm`` is not installed: the bar is a nicety, not a dependency), None for a false one or an
    empty batch."""
    if total == 0 or not (callable(use_tqdm) or use_tqdm):
        return None
    if callable(use_tqdm):
        factory: Callable[..., ProgressBar] = use_tqdm
    else:
        try:
            factory = importlib.import_module("tqdm").tqdm
        except ImportError:
            return None
    return factory(total=total, desc="Processed prompts", dynamic_ncols=True)


def prompt_ticks(bar: ProgressBar, counts: Sequence[int]) -> Callable[[int], None]:
    """The ``on_done`` of ``run_engine`` over the requests of prompts that have ``counts[i]`` samples each (in
    order): it ticks ``bar`` once a prompt's last sample ends, so the bar counts prompts, as vLLM's does."""
    owner = [prompt for prompt, count in enumerate(counts) for _ in range(count)]
    left = list(counts)

    def done(request: int) -> None:
        prompt = owner[request]
        left[prompt] -= 1
        if left[prompt] == 0:
            bar.update(1)

    return done


def no_lora(lora_request: object) -> None:
    """Refuse vLLM's ``lora_request`` unless None: this engine serves no LoRA adapters."""
    if lora_request is not None:
        raise ValueError("LoRA adapters are not supported: lora_request must be None (this engine serves the "
                         "base model's weights only)")


def template_tokenizer(template: str, tokenizer: Tokenizer | None) -> Tokenizer:
    """The model's tokenizer rendering with ``template`` (vLLM's per-call ``chat_template``, a Jinja string);
    a ``ValueError`` for a model without a tokenizer."""
    if tokenizer is None:
        raise ValueError("chat_template needs the model's tokenizer (this model has none: send token ids)")
    return tokenizer.with_chat_template(template)


def rendered_with(tokenizer: Tokenizer, request: GenerationRequest) -> GenerationRequest:
    """A chat ``request`` rendered by ``tokenizer``'s template (``template_tokenizer``) instead of the model's:
    the same request with the rendering's token ids as its prompt (``tokenized_from`` messages, as a front
    process sends a rendered chat), through admission's own rendering (``validation.tokenize``). A template
    that does not parse or raises is a ``ValueError``, before anything runs."""
    from inference_server.core.validation import tokenize

    try:
        ids = tokenize(request, tokenizer)
    except RequestError as error:  # admission's message: "cannot apply the chat template: ..."
        raise ValueError(f"chat_template: {error.message}") from None
    return attrs.evolve(request, messages=None, prompt_ids=ids, tokenized_from="messages")


def interrupt_of(error: BaseException) -> KeyboardInterrupt | None:
    """The ``KeyboardInterrupt`` inside ``error`` (trio wraps a Ctrl-C that reached a task in its nurseries'
    exception groups, where a caller's ``except KeyboardInterrupt`` cannot see it), or None."""
    if isinstance(error, KeyboardInterrupt):
        return error
    if isinstance(error, BaseExceptionGroup):
        interrupts, _ = error.split(KeyboardInterrupt)
        if interrupts is not None:
            return KeyboardInterrupt()
    return None


def in_trio_run() -> bool:
    """Whether this thread is inside a running ``trio.run`` (where another ``trio.run`` cannot start)."""
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


class LLM:
    """Load a model once; ``generate`` runs batches of prompts through the actor engine."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.built: BuiltEngine = build_engine_parts(self.settings)
        self.running = threading.Lock()
        """Held by a ``generate`` call: every call runs an engine over the same KV manager and runner, so calls
        from several threads take turns (two engines at once would both number their requests from 1)."""
        self.stale = False
        """Whether a ``generate`` ended by an exception (Ctrl-C, an actor crash): its engine was cancelled
        mid-step, so the KV manager, the step pipeline and the runner may still hold its requests, and the
        next call rebuilds the engine parts (reloading the model) instead of reusing them."""
        self.chat_stops = ChatStops.of(self.built.loaded.tokenizer, self.built.parts.eos_token_ids)
        """The chat template's turn markers, added to chat requests' stops as the HTTP chat route does."""

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None for a preset with dummy weights: token-id prompts only)."""
        return self.built.loaded.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: UseTqdm = False, lora_request: object = None,
                 *, chat: bool = False) -> list[Completion]:
        """Complete each prompt (text, token ids, or a user message when ``chat``); one prompt (a string or
        one token-id list) is a batch of one, an empty list an empty batch. ``sampling_params`` (vLLM's name) is
        one for every prompt or one per prompt; None:
        ``SamplingParams()`` (vLLM's defaults, as vLLM's ``LLM.generate`` without sampling params). Returns one
        completion per prompt, in order, each with its ``SamplingParams.n`` samples in ``outputs``.

        ``use_tqdm`` (vLLM's; default False: no bar): True shows a ``tqdm`` bar over completed prompts (nothing
        when ``tqdm`` is not installed), a callable builds the bar itself (``progress_bar``). ``lora_request``
        (vLLM's) must be None: anything else is a ``ValueError`` (no LoRA adapters here)."""
        no_lora(lora_request)
        batch = prompt_list(prompts)
        per_prompt = params_per_item(sampling_params, len(batch), "prompts")
        requests = []
        for prompt, p in zip(batch, per_prompt, strict=True):
            if chat:
                if not isinstance(prompt, str):  # str() of token ids would send "[5, 6, 7]" as the message
                    raise ValueError("chat=True takes text prompts (each one user message), not token ids")
                requests.append(GenerationRequest(params=self.chat_stops.apply(p),
                                                  messages=(ChatMessage("user", prompt),)))
            elif isinstance(prompt, str):
                requests.append(GenerationRequest(params=p, prompt=prompt))
            else:
                requests.append(GenerationRequest(params=p, prompt_ids=prompt))
        return self._complete(requests, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: UseTqdm = False, lora_request: object = None, chat_template: str | None = None, *,
             add_generation_prompt: bool | None = None, continue_final_message: bool = False,
             tools: Sequence[Mapping[str, Any]] | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[Completion]:
        """Reply to each conversation (vLLM's ``LLM.chat``): one conversation (a list of OpenAI-style message
        dicts) or a list of them; ``sampling_params`` as ``generate``'s. Each
        conversation is rendered by the model's chat template exactly as ``/v1/chat/completions`` renders it (its
        message rules, ``tools`` as function definitions, ``chat_template_kwargs`` as extra template variables),
        and each reply ends at the template's turn markers as there. ``add_generation_prompt`` defaults to
        ``not continue_final_message``; ``continue_final_message`` leaves the final message (the assistant's)
        open for the model to continue. A conversation or field the HTTP route would refuse raises ``ValueError``
        naming it, before anything runs; a refusal by the engine (a template error, a prompt too long) is that
        completion's ``error``.

        ``use_tqdm`` and ``lora_request`` as ``generate``'s. ``chat_template`` (vLLM's): a Jinja template
        rendering every conversation instead of the model's (its turn markers still end the replies); one that
        does not parse or raises on a conversation is a ``ValueError`` before anything runs."""
        no_lora(lora_request)
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template is the Jinja template's text, got {chat_template!r:.100}")
        conversations = conversation_list(messages)
        per_conversation = params_per_item(sampling_params, len(conversations), "conversations")
        renderer = None if chat_template is None else template_tokenizer(chat_template, self.tokenizer)
        checked_tools, kwargs = chat_options(tools, chat_template_kwargs)
        requests = []
        for conversation, p in zip(conversations, per_conversation, strict=True):
            chat_messages = conversation_messages(conversation)
            generation_prompt, continue_final = chat_flags(add_generation_prompt, continue_final_message,
                                                           chat_messages[-1].role)
            request = GenerationRequest(params=self.chat_stops.apply(p), messages=chat_messages,
                                        add_generation_prompt=generation_prompt,
                                        continue_final_message=continue_final, tools=checked_tools,
                                        chat_template_kwargs=kwargs)
            if renderer is not None:  # compiled once, at its first conversation
                request = rendered_with(renderer, request)
            requests.append(request)
        return self._complete(requests, use_tqdm)

    def _complete(self, requests: Sequence[GenerationRequest], use_tqdm: UseTqdm = False) -> list[Completion]:
        """Run each request's samples (``SamplingParams.samples``: ``n`` engine requests, seeds derived) and
        group them back into one completion per request; with ``use_tqdm``, a progress bar over the requests
        (``progress_bar``), ticked as each one's last sample ends."""
        samples = [[attrs.evolve(r, params=p) for p in r.params.samples()] for r in requests]
        counts = [len(group) for group in samples]
        if in_trio_run():  # before trio.run refuses it: that refusal would mark the engine stale for nothing
            raise RuntimeError("LLM.generate and LLM.chat run their own trio.run: call them from a thread "
                               "(trio.to_thread.run_sync), not from inside a running trio loop")
        with self.running:
            bar = progress_bar(use_tqdm, len(requests))
            try:
                completions = self._run([sample for group in samples for sample in group],
                                        None if bar is None else prompt_ticks(bar, counts))
            finally:
                if bar is not None:
                    bar.close()
        return grouped(completions, counts)

    def _run(self, requests: Sequence[GenerationRequest],
             on_done: Callable[[int], None] | None = None) -> list[Completion]:
        """One engine run over the shared parts (the caller holds ``running``); ``on_done`` as ``run_engine``'s."""
        if self.stale:
            # the old model's memory goes before the new one loads; popped, not deleted: after a rebuild that
            # raised (it stays stale) there is no old one left, and the next call must try again, not fail here
            vars(self).pop("built", None)
            self.built = build_engine_parts(self.settings)
            self.stale = False
        try:
            return trio.run(generate_with, self.built.parts, requests, on_done)
        except BaseException as error:
            self.stale = True
            interrupt = interrupt_of(error)
            if interrupt is None or interrupt is error:
                raise
            raise interrupt from error
