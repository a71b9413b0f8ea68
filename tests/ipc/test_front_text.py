"""``RequestText`` (the front's detokenisation and stop strings) against one process's scheduler: whatever the
tokens, stop strings and the way the engine groups tokens into updates, the client gets the same text, finish,
stop reason and token count as when one ``IncrementalDetokenizer`` and one full ``StopChecker`` run per token."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from inference_server.core.detokenizer import IncrementalDetokenizer
from inference_server.core.stop_checker import StopChecker
from inference_server.ipc.front_text import RequestText
from inference_server.ipc.messages import Tokens
from inference_server.records.requests import RequestUpdate, TokenOutput
from inference_server.records.sampling_params import SamplingParams

EOS = 0
PIECES = ["<eos>", "a", "b", "ab", " ", "c", "ba", "x"]  # id -> text


class CharDecoder:
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(PIECES[i] for i in ids if not (skip_special_tokens and i == EOS))


def one_process(params: SamplingParams, tokens: list[int]) -> tuple[str, str | None, object, int]:
    detokenizer = IncrementalDetokenizer(CharDecoder(), (1,), skip_special_tokens=params.skip_special_tokens)
    checker = StopChecker.from_params(params, {EOS})
    text = ""
    for token in tokens:
        update = checker.update(token, detokenizer.add_token(token))
        text += update.text
        if update.finished:
            return text, update.finish_reason, update.stop_reason, checker.num_tokens
    return text, None, None, checker.num_tokens


def split(params: SamplingParams, tokens: list[int], sizes: list[int]) -> tuple[str, str | None, object, int]:
    engine = StopChecker.from_params(params, {EOS}, stop_strings=False)
    updates: list[RequestUpdate] = []
    batch: list[TokenOutput] = []
    for token in tokens:
        stop = engine.update(token, "")
        batch.append(TokenOutput(token, "", -0.5))
        if stop.finished or len(batch) >= sizes[len(updates) % len(sizes)]:
            updates.append(RequestUpdate(7, tuple(batch), stop.finish_reason, stop.stop_reason,
                                         prompt_tokens=1, completion_tokens=engine.num_tokens))
            batch = []
        if stop.finished:
            break
    if batch:
        updates.append(RequestUpdate(7, tuple(batch)))
    front = RequestText(params, (1,), CharDecoder(), {EOS})
    text = ""
    for update in updates:
        out, _ = front.apply(Tokens.of(update, 7))
        assert all(t.logprob == -0.5 for t in out.tokens)
        text += "".join(t.text for t in out.tokens)
        if out.finished:
            return text, out.finish_reason, out.stop_reason, out.completion_tokens
    return text, None, None, front.checker.num_tokens


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, len(PIECES) - 1), max_size=30),
       stop=st.lists(st.sampled_from(["ab", "b a", "abc", "x", "cab", " "]), max_size=3),
       max_tokens=st.integers(1, 25), min_tokens=st.integers(0, 5), include=st.booleans(),
       stop_ids=st.lists(st.integers(1, 7), max_size=1), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_the_front_makes_the_text_one_process_makes(tokens: list[int], stop: list[str], max_tokens: int,
                                                    min_tokens: int, include: bool, stop_ids: list[int],
                                                    sizes: list[int]) -> None:
    params = SamplingParams(max_tokens=max_tokens, stop=tuple(stop), include_stop_str_in_output=include,
                            min_tokens=min(min_tokens, max_tokens), stop_token_ids=tuple(stop_ids))
    assert split(params, tokens, sizes) == one_process(params, tokens)


def test_a_stop_string_ends_the_request_in_the_front_before_the_engine() -> None:
    params = SamplingParams(max_tokens=20, stop=("ab",))
    front = RequestText(params, (1,), CharDecoder(), {EOS})
    out, ended_here = front.apply(Tokens(7, [5, 3, 1], [0.0, 0.0, 0.0]))
    assert ended_here and out.finish_reason == "stop" and out.stop_reason == "ab"
    assert [t.text for t in out.tokens] == ["c", ""] and out.completion_tokens == 2  # ends at the match
