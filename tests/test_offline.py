"""The offline ``LLM`` API as vLLM's users call it: one prompt or a batch, one SamplingParams or one each."""

from __future__ import annotations

import io
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise

import attrs
import pytest
import trio

from inference_server import offline
from inference_server.actors.request_handle import RequestHandle
from inference_server.config import Settings
from inference_server.offline import LLM, Completion
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import EngineParts

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture(scope="module")
def tiny_llm() -> Iterator[LLM]:
    """A tiny dummy-weight model (no tokenizer: token-id prompts; text prompts end with a request error)."""
    yield LLM(Settings(model="gemma-4-31b-tiny", dummy_weights=True, device="cpu", kv_cache_tokens=1024))


def test_one_token_id_prompt_is_a_batch_of_one(tiny_llm: LLM) -> None:
    [single] = tiny_llm.generate([5, 6, 7], GREEDY)
    [batched] = tiny_llm.generate([[5, 6, 7]], GREEDY)
    assert single.prompt_tokens == 3 and single.finish_reason == "length"
    assert single.token_ids == batched.token_ids


def test_one_text_prompt_is_a_batch_of_one(tiny_llm: LLM) -> None:
    completions = tiny_llm.generate("hello", GREEDY)  # not one prompt per character
    assert len(completions) == 1


def test_generate_takes_vllms_keyword_and_an_empty_batch(tiny_llm: LLM) -> None:
    [by_keyword] = tiny_llm.generate([5, 6, 7], sampling_params=GREEDY)  # vLLM's LLM.generate keyword
    [by_position] = tiny_llm.generate([5, 6, 7], GREEDY)
    assert by_keyword.token_ids == by_position.token_ids and len(by_keyword.token_ids) == 3
    assert tiny_llm.generate([], GREEDY) == []  # an empty batch, as vLLM's


def test_params_of_another_length_than_the_prompts_is_a_clear_error(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        tiny_llm.generate([[5, 6], [7, 8]], [GREEDY])


def test_an_interrupted_generate_raises_keyboard_interrupt_and_the_llm_stays_usable(
        tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C mid-generate (KeyboardInterrupt raised in a task while the request holds KV and the runner's
    state): the caller's ``except KeyboardInterrupt`` sees it, and the next call completes as a fresh one."""
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    [expected] = tiny_llm.generate([[5, 6, 7]], long)

    async def interrupted(handle: RequestHandle) -> Completion:
        async with handle:
            await handle.admission()
            await anext(handle)  # a first token: the request is scheduled and holds KV
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(offline, "collect", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tiny_llm.generate([[5, 6, 7], [8, 9]], long)
    [again] = tiny_llm.generate([[5, 6, 7]], long)
    assert again == expected


def test_a_token_id_prompt_as_a_chat_message_is_an_error(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match="chat=True takes text prompts"):
        tiny_llm.generate([[5, 6, 7]], GREEDY, chat=True)


def test_logprobs_return_the_top_alternatives_of_every_token(tiny_llm: LLM) -> None:
    [completion] = tiny_llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2))
    assert len(completion.top_logprobs) == len(completion.token_ids) == 3
    for token_id, logprob, top in zip(completion.token_ids, completion.logprobs, completion.top_logprobs,
                                      strict=True):
        assert len(top) == 2
        assert top[0][0] == token_id and top[0][1] == pytest.approx(logprob)  # greedy: the best one
        assert top[0][1] >= top[1][1]


def test_max_tokens_none_is_capped_at_default_max_tokens() -> None:
    """As ``SamplingParams.max_tokens`` and ``DEFAULT_MAX_TOKENS`` document: not the rest of the context."""
    llm = LLM(Settings(model="gemma-4-31b-tiny", dummy_weights=True, device="cpu", kv_cache_tokens=1024,
                       default_max_tokens=5))
    [completion] = llm.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(completion.token_ids) == 5 and completion.finish_reason == "length"


def test_calls_from_two_threads_take_turns(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call's request holds KV while a second thread calls generate: the second waits for the first
    (both engines would use the same KV manager and runner) and both complete."""
    [expected] = tiny_llm.generate([[5, 6, 7]], GREEDY)
    runs: list[int] = []
    second_run = threading.Event()
    real_generate_with, real_collect = offline.generate_with, offline.collect

    async def counted(parts: EngineParts, requests: Sequence[GenerationRequest],
                      on_done: Callable[[int], None] | None = None) -> list[Completion]:
        runs.append(len(runs))
        if len(runs) == 2:
            second_run.set()
        return await real_generate_with(parts, requests, on_done)

    async def first_waits(handle: RequestHandle) -> Completion:
        if len(runs) == 1:  # the first run, its request submitted: give the other thread its chance to start
            await trio.to_thread.run_sync(second_run.wait, 1.0)
        return await real_collect(handle)

    monkeypatch.setattr(offline, "generate_with", counted)
    monkeypatch.setattr(offline, "collect", first_waits)
    results: list[list[Completion] | BaseException] = []

    def call() -> None:
        try:
            results.append(tiny_llm.generate([[5, 6, 7]], GREEDY))
        except BaseException as error:  # the assertion below shows it
            results.append(error)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results == [[expected], [expected]]


def test_without_params_a_prompt_samples_with_the_defaults(tiny_llm: LLM) -> None:
    [completion] = tiny_llm.generate([5, 6, 7])  # vLLM's LLM.generate(prompts): SamplingParams()
    assert completion.error is None and completion.prompt_tokens == 3
    assert 1 <= len(completion.token_ids) <= 16  # SamplingParams().max_tokens


def test_a_batch_larger_than_the_admission_queue_completes_whole() -> None:
    """MAX_QUEUE_SIZE and MAX_QUEUED_TOKENS are a server's backpressure; an offline batch past them waits."""
    llm = LLM(Settings(model="gemma-4-31b-tiny", dummy_weights=True, device="cpu", kv_cache_tokens=1024,
                       max_queue_size=4, max_queued_tokens=8))
    prompts = [[5, 6, 7 + i] for i in range(12)]
    completions = llm.generate(prompts, GREEDY)
    assert [c.error for c in completions] == [None] * 12
    assert [c.prompt_tokens for c in completions] == [3] * 12
    [alone] = llm.generate(prompts[-1], GREEDY)
    assert completions[-1].token_ids == alone.token_ids


def test_vllm_prompt_dicts_are_prompts_and_anything_else_is_a_type_error(tiny_llm: LLM) -> None:
    [by_ids] = tiny_llm.generate([5, 6, 7], GREEDY)
    [single] = tiny_llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)
    [listed, text] = tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt": "hi"}], GREEDY)
    assert single.token_ids == listed.token_ids == by_ids.token_ids
    assert text.error is not None and "no tokenizer" in text.error  # a text prompt, not the text "prompt"
    for bad in ({"prompt": "hi", "multi_modal_data": {}}, [1.5, 2.0], [[5, None]], 7):
        with pytest.raises(TypeError, match="a prompt"):
            tiny_llm.generate(bad, GREEDY)  # type: ignore[arg-type]


def test_a_call_from_inside_a_trio_loop_is_refused_without_a_reload(tiny_llm: LLM) -> None:
    async def inside() -> list[Completion]:
        return tiny_llm.generate([5, 6, 7], GREEDY)

    with pytest.raises(RuntimeError, match="from inside a running trio loop"):
        trio.run(inside)
    assert not tiny_llm.stale  # the engine never ran: the next call reuses it
    [completion] = trio.run(trio.to_thread.run_sync, lambda: tiny_llm.generate([5, 6, 7], GREEDY))
    assert completion.error is None


def test_a_rebuild_that_fails_is_tried_again_at_the_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(Settings(model="gemma-4-31b-tiny", dummy_weights=True, device="cpu", kv_cache_tokens=1024))
    llm.stale = True  # as after an interrupted call
    real_build = offline.build_engine_parts

    def out_of_memory(settings: Settings) -> object:
        raise MemoryError("injected: the reload failed")

    monkeypatch.setattr(offline, "build_engine_parts", out_of_memory)
    with pytest.raises(MemoryError):
        llm.generate([5, 6, 7], GREEDY)
    monkeypatch.setattr(offline, "build_engine_parts", real_build)
    [completion] = llm.generate([5, 6, 7], GREEDY)
    assert completion.error is None and not llm.stale


# -- stop_reason ----------------------------------------------------------------------------------------------


def test_stop_reason_is_the_stop_token_id_and_none_for_eos_and_length(tiny_llm: LLM) -> None:
    """vLLM's ``CompletionOutput.stop_reason``: the stop token id that ended the output, None for EOS or length."""
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [free_run] = tiny_llm.generate([5, 6, 7], free)
    assert free_run.finish_reason == "length" and free_run.stop_reason is None
    stop_id = free_run.token_ids[2]
    first = free_run.token_ids.index(stop_id)
    [stopped] = tiny_llm.generate([5, 6, 7], attrs.evolve(free, stop_token_ids=(stop_id,)))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert stopped.token_ids == free_run.token_ids[:first + 1]
    eos = min(tiny_llm.built.parts.eos_token_ids)
    [ended] = tiny_llm.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, logit_bias=((eos, 100.0),)))
    assert ended.token_ids == (eos,) and ended.finish_reason == "stop" and ended.stop_reason is None
    assert ended.outputs[0].stop_reason is None


# -- n samples ------------------------------------------------------------------------------------------------


def test_n_gives_each_prompt_n_indexed_samples_each_seeded_seed_plus_its_index(tiny_llm: LLM) -> None:
    """vLLM's ``SamplingParams(n=...)``: ``outputs`` holds n samples indexed 0..n-1; seeded, sample j is what the
    same request alone with seed ``seed + j`` gives (the HTTP routes' ``n``), so the samples differ."""
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=11, n=3)
    first, second = tiny_llm.generate([[5, 6, 7], [8, 9]], params)
    for completion, prompt in ((first, [5, 6, 7]), (second, [8, 9])):
        assert [o.index for o in completion.outputs] == [0, 1, 2]
        assert completion.prompt_token_ids == tuple(prompt) and completion.prompt_tokens == len(prompt)
        for j, output in enumerate(completion.outputs):
            [alone] = tiny_llm.generate(prompt, attrs.evolve(params, n=1, seed=11 + j))
            assert output.token_ids == alone.token_ids and output.finish_reason == "length"
        assert len({o.token_ids for o in completion.outputs}) > 1
        assert completion.text == completion.outputs[0].text  # the shortcuts are the first sample's
        assert completion.outputs[0].cumulative_logprob == pytest.approx(sum(completion.outputs[0].logprobs))


def test_n_is_per_prompt_and_an_invalid_n_is_that_prompt_s_error(tiny_llm: LLM) -> None:
    greedy_two = attrs.evolve(GREEDY, n=2)
    one, two, bad = tiny_llm.generate([[5, 6, 7], [5, 6, 7], [5, 6, 7]],
                                      [GREEDY, greedy_two, attrs.evolve(GREEDY, n=0)])
    assert len(one.outputs) == 1 and [o.token_ids for o in two.outputs] == [one.token_ids] * 2  # greedy: equal
    assert len(bad.outputs) == 1 and bad.error is not None and "n must be an integer >= 1" in bad.error


def test_use_tqdm_true_shows_a_bar_over_the_prompts_and_false_shows_none(
        tiny_llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's ``use_tqdm`` (lm-eval's vLLM backend passes it): a bar over completed prompts, or nothing."""
    pytest.importorskip("tqdm")
    [quiet] = tiny_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    shown = tiny_llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    assert shown[0].token_ids == quiet.token_ids  # the bar changes nothing else


def test_use_tqdm_without_tqdm_installed_shows_nothing(
        tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # ``import tqdm`` raises ImportError
    [completion] = tiny_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=True)
    assert completion.finish_reason == "length" and "Processed prompts" not in capsys.readouterr().err


def test_use_tqdm_a_callable_builds_the_bar_ticked_once_per_prompt_whatever_its_n(tiny_llm: LLM) -> None:
    """A callable builds the bar as vLLM calls it (``total=``, ``desc=``, ...); a prompt with ``n=3`` samples
    ticks it once, when its last sample ends."""
    tqdm = pytest.importorskip("tqdm").tqdm
    out, bars = io.StringIO(), []

    def build(**kwargs: object) -> object:
        bars.append(tqdm(**kwargs, file=out))
        return bars[-1]

    tiny_llm.generate([[5, 6, 7], [8, 9]], [GREEDY, attrs.evolve(GREEDY, n=3)], use_tqdm=build)
    [bar] = bars
    assert (bar.total, bar.n, bar.desc) == (2, 2, "Processed prompts") and "2/2" in out.getvalue()
    assert tiny_llm.generate([], GREEDY, use_tqdm=build) == [] and len(bars) == 1  # no bar for nothing


def test_lora_request_none_is_accepted_and_any_adapter_is_a_clear_error(tiny_llm: LLM) -> None:
    [plain] = tiny_llm.generate([[5, 6, 7]], GREEDY)
    [none] = tiny_llm.generate([[5, 6, 7]], GREEDY, lora_request=None)
    assert none.token_ids == plain.token_ids
    for call in (lambda: tiny_llm.generate([[5, 6, 7]], GREEDY, lora_request=object()),
                 lambda: tiny_llm.chat(HELLO, GREEDY, lora_request=("adapter", 1, "/path"))):
        with pytest.raises(ValueError, match="LoRA adapters are not supported"):
            call()


# -- chat -----------------------------------------------------------------------------------------------------

TOOLS_TEMPLATE = (
    "{{ bos_token }}{% for tool in tools or [] %}{{ tool['function']['name'] }} {% endfor %}"
    "{% if greet %}hello {% endif %}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""The test tokenizer's turns, plus each tool's name and a ``greet`` variable (``chat_template_kwargs``)."""
HELLO = [{"role": "user", "content": "hello world"}]
TOOL = {"type": "function", "function": {"name": "paris", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def text_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """A tiny random-weight checkpoint with the tests' word-level tokenizer, served with ``TOOLS_TEMPLATE``."""
    import json

    import torch
    from safetensors.torch import save_file
    from tests.test_http.http_testkit import write_tokenizer_folder

    from inference_server.models.loading.loader import build_model, init_dummy_weights
    from inference_server.models.loading.presets import preset_config
    from inference_server.models.spec import parse_model_spec

    folder = tmp_path_factory.mktemp("offline-chat")
    config = preset_config("gemma-4-31b-tiny")
    model = build_model(parse_model_spec(config), torch.float32, "cpu")
    init_dummy_weights(model, seed=0)
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer_folder(folder)
    (folder / "template.jinja").write_text(TOOLS_TEMPLATE)
    yield LLM(Settings(model=str(folder), device="cpu", kv_cache_tokens=1024,
                       chat_template=str(folder / "template.jinja")))


def test_stop_reason_is_the_stop_string_that_ended_the_text(text_llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [free_run] = text_llm.generate("hello world", free)
    stop = free_run.text.split()[1]
    [stopped] = text_llm.generate("hello world", attrs.evolve(free, stop=[stop]))  # a list, as in vLLM
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free_run.text[:free_run.text.index(stop)]


def test_chat_renders_the_conversation_with_the_model_template_as_the_http_route(text_llm: LLM) -> None:
    """One conversation (a list of message dicts) is a batch of one; its prompt is the served template's
    rendering, the same ids as the tokenizer's ``apply_chat_template``; a batch of conversations keeps order."""
    tokenizer = text_llm.tokenizer
    assert tokenizer is not None
    [reply] = text_llm.chat(HELLO, GREEDY)
    assert reply.error is None and reply.prompt_token_ids == tuple(tokenizer.apply_chat_template(HELLO))
    [as_generate] = text_llm.generate(list(reply.prompt_token_ids), GREEDY)
    assert reply.token_ids == as_generate.token_ids
    other = [{"role": "system", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"},
                                                                              {"type": "text", "text": "c"}]}]
    first, second = text_llm.chat([HELLO, other], GREEDY)
    assert first.token_ids == reply.token_ids
    assert second.prompt_token_ids == tuple(tokenizer.apply_chat_template(
        [{"role": "system", "content": "a"}, {"role": "user", "content": "b\nc"}]))  # text parts joined
    assert text_llm.chat([], GREEDY) == []  # an empty batch, as vLLM's


def test_chat_passes_tools_and_template_kwargs_to_the_template(text_llm: LLM) -> None:
    tokenizer = text_llm.tokenizer
    assert tokenizer is not None
    [reply] = text_llm.chat(HELLO, GREEDY, tools=[TOOL], chat_template_kwargs={"greet": True})
    expected = tokenizer.apply_chat_template(HELLO, tools=[TOOL], greet=True)
    assert reply.prompt_token_ids == tuple(expected)
    assert tokenizer.token_to_id("paris") in expected and tokenizer.token_to_id("hello") in expected[:4]


def test_chat_continues_the_final_assistant_message(text_llm: LLM) -> None:
    tokenizer = text_llm.tokenizer
    assert tokenizer is not None
    prefill = [*HELLO, {"role": "assistant", "content": "paris is"}]
    [reply] = text_llm.chat(prefill, GREEDY, continue_final_message=True)
    expected = tokenizer.apply_chat_template(prefill, add_generation_prompt=False, continue_final_message=True)
    assert reply.error is None and reply.prompt_token_ids == tuple(expected)
    assert expected[-2:] == [tokenizer.token_to_id("paris"), tokenizer.token_to_id("is")]


@pytest.mark.parametrize(("call", "message"), [
    (lambda llm: llm.chat([{"role": "bot", "content": "hi"}]), "messages[0].role: unknown role 'bot'"),
    (lambda llm: llm.chat([{"role": "user", "contnt": "hi"}]), "messages[0].contnt: unknown field"),
    (lambda llm: llm.chat([[]]), "messages: messages must not be empty"),
    (lambda llm: llm.chat(HELLO, add_generation_prompt=True, continue_final_message=True),
     "continue_final_message: continue_final_message and add_generation_prompt cannot both be true"),
    (lambda llm: llm.chat(HELLO, continue_final_message=True), "needs the last message to be the assistant's"),
    (lambda llm: llm.chat(HELLO, tools=[{"type": "function", "function": {"name": "a b"}}]),
     "tools[0].function.name: tool name 'a b' must be"),
    (lambda llm: llm.chat(HELLO, chat_template_kwargs={"tools": []}), "chat_template_kwargs may not set 'tools'"),
    (lambda llm: llm.chat([HELLO, HELLO], [GREEDY]), "2 conversations but 1 SamplingParams"),
])
def test_a_conversation_the_http_route_refuses_is_a_value_error_naming_the_field(
        text_llm: LLM, call: Callable[[LLM], object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call(text_llm)


def test_a_chat_reply_ends_at_a_turn_marker_with_its_id_as_stop_reason(text_llm: LLM) -> None:
    """The template's turn markers end a chat reply as on the HTTP route: one that is not an EOS id is reported
    as the stop token id (vLLM reports Gemma's ``<end_of_turn>`` so, a stop id from its generation config); an
    EOS id (here ``<end_of_turn>``) as None."""
    tokenizer = text_llm.tokenizer
    assert tokenizer is not None
    start, end = tokenizer.token_to_id("<start_of_turn>"), tokenizer.token_to_id("<end_of_turn>")
    assert start is not None and end is not None and end in text_llm.built.parts.eos_token_ids
    for marker, reason in ((start, start), (end, None)):
        [reply] = text_llm.chat(HELLO, SamplingParams(temperature=0.0, max_tokens=5, logit_bias=((marker, 100.0),)))
        assert reply.finish_reason == "stop" and reply.stop_reason == reason and reply.text == ""


def test_chat_with_n_samples_each_reply(text_llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=3, n=2)
    [reply] = text_llm.chat(HELLO, params)
    assert [o.index for o in reply.outputs] == [0, 1]
    [second] = text_llm.chat(HELLO, attrs.evolve(params, n=1, seed=4))
    assert reply.outputs[1].token_ids == second.token_ids


PLAIN_TEMPLATE = ("{% for message in messages %}{{ message['role'] }} {{ message['content'] }} {% endfor %}"
                  "{% if add_generation_prompt %}model {% endif %}")
"""A per-call template (vLLM's ``LLM.chat(chat_template=...)``) other than the served ``TOOLS_TEMPLATE``."""


def test_chat_renders_with_a_per_call_chat_template_instead_of_the_model_s(text_llm: LLM) -> None:
    tokenizer = text_llm.tokenizer
    assert tokenizer is not None
    [reply] = text_llm.chat(HELLO, GREEDY, chat_template=PLAIN_TEMPLATE, use_tqdm=False)
    expected = tokenizer.with_chat_template(PLAIN_TEMPLATE).apply_chat_template(HELLO)
    assert reply.error is None and reply.prompt_token_ids == tuple(expected)
    assert expected != tokenizer.apply_chat_template(HELLO)  # not the served template
    prefill = [*HELLO, {"role": "assistant", "content": "paris is"}]
    [continued] = text_llm.chat(prefill, GREEDY, chat_template=PLAIN_TEMPLATE, continue_final_message=True)
    assert continued.prompt_token_ids == tuple(tokenizer.with_chat_template(PLAIN_TEMPLATE).apply_chat_template(
        prefill, add_generation_prompt=False, continue_final_message=True))
    [served] = text_llm.chat(HELLO, GREEDY)  # the next call without one: the model's template again
    assert served.prompt_token_ids == tuple(tokenizer.apply_chat_template(HELLO))


def test_a_per_call_chat_template_needs_the_model_s_tokenizer(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match="chat_template needs the model's tokenizer"):
        tiny_llm.chat(HELLO, GREEDY, chat_template=PLAIN_TEMPLATE)


@pytest.mark.parametrize("template", ["{% for m in messages %}", "{{ raise_exception('no') }}"])
def test_a_per_call_chat_template_that_fails_is_a_value_error(text_llm: LLM, template: str) -> None:
    with pytest.raises(ValueError, match="chat_template: cannot apply the chat template"):
        text_llm.chat(HELLO, GREEDY, chat_template=template)


def test_messages_that_are_not_conversations_are_a_type_error(text_llm: LLM) -> None:
    for bad in ("hello", HELLO[0], [HELLO, "hello"]):
        with pytest.raises(TypeError, match="message dicts"):
            text_llm.chat(bad, GREEDY)  # type: ignore[arg-type]


def test_bad_words_and_stop_regex_through_the_real_runner(text_llm: LLM) -> None:
    """vLLM's ``SamplingParams.bad_words`` and SGLang's ``stop_regex`` on a real model runner and tokenizer: a
    banned word is not written (a two-word one only right after its first word), and a pattern ends the text
    before its first match, naming it. (The random-weight model repeats one word.)"""
    import regex

    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [plain] = text_llm.generate("hello world", free)
    word = plain.text.split()[0]
    [one] = text_llm.generate("hello world", attrs.evolve(free, bad_words=[word]))
    assert word not in one.text.split() and len(one.token_ids) == 6
    [pair] = text_llm.generate("hello world", attrs.evolve(free, bad_words=f"{word} {plain.text.split()[1]}"))
    assert pair.token_ids[0] == plain.token_ids[0] and pair.token_ids[1] != plain.token_ids[1]
    assert all((a, b) != tuple(plain.token_ids[:2]) for a, b in pairwise(pair.token_ids))
    pattern = r"(?<=(w\d+ ){2})w\d+"  # the third word (a variable-width lookbehind: the regex module's)
    [stopped] = text_llm.generate("hello world", attrs.evolve(free, stop_regex=[pattern]))
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", pattern)
    match = regex.search(pattern, plain.text)
    assert match is not None and stopped.text == plain.text[:match.start()] and stopped.text.count("w") == 2


def test_bans_that_leave_no_token_do_not_fail_the_step(text_llm: LLM) -> None:
    """``bad_words`` banning the one id ``allowed_token_ids`` allows left the row nothing to sample: the CPU draw
    indexed past the vocabulary and the step failed, with every request in it. The row now samples without its
    edits at that step, and the batch's other request is served as usual."""
    free = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=1)
    [plain] = text_llm.generate("hello world", free)
    word, token = plain.text.split()[0], plain.token_ids[0]  # the test tokenizer: one token a word
    stuck = attrs.evolve(free, allowed_token_ids=[token], bad_words=[word])
    outputs = text_llm.generate(["hello world", "hello world"], [stuck, free])
    assert [len(o.token_ids) for o in outputs] == [3, 3] and outputs[1].token_ids == plain.token_ids
