"""The paged step runner equals the contiguous reference forward for random mixes of chunks and decodes."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
import torch
from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch

from inference_server.backends.model_runner import ModelRunner
from inference_server.backends.paged_kv import PagedKVStorage, group_of
from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import parse_model_spec
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
MODELS = ["gemma-4-e2b-tiny", "gemma-4-26b-a4b-tiny", "gemma-4-31b-tiny", "qwen3-30b-a3b-tiny", "gemma-3-tiny"]
GEMMA3_TINY = dict(model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                   query_pre_attn_scalar=16, sliding_window=4, layer_types=["sliding_attention"] * 5 +
                   ["full_attention"], max_position_embeddings=256, rope_theta=1_000_000.0,
                   rope_local_base_freq=10_000.0, tie_word_embeddings=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(name: str):
    spec = parse_model_spec(GEMMA3_TINY if name == "gemma-3-tiny" else preset_config(name))
    model = build_model(spec, torch.float32, "cpu")
    init_dummy_weights(model, seed=3)
    groups = {group_of(layer) for layer in spec.cache_layers}
    storage = PagedKVStorage(spec.cache_layers, {g: 64 for g in groups}, BLOCK, torch.float32, "cpu")
    return spec, model, ModelRunner(model, spec, storage, torch.device("cpu"))


def contiguous_logits(model, spec, prompts: list[list[int]]) -> list[torch.Tensor]:
    cache = ContiguousKVCache(spec)
    batch = ForwardBatch(seq_ids=tuple(range(len(prompts))), cached_lens=(0,) * len(prompts),
                         query_lens=tuple(len(p) for p in prompts))
    with torch.no_grad():
        hidden = model(torch.tensor([t for p in prompts for t in p]), cache.context(batch, "cpu"))
        logits = model.compute_logits(hidden)
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_chunks_equal_contiguous_forward(name: str, seed: int) -> None:
    """Feed each sequence in random chunk sizes, interleaved across steps; the last logits of every chunk
    equal the contiguous full forward's logits at that position."""
    spec, model, runner = make(name)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    expected = contiguous_logits(model, spec, prompts)
    num_groups = runner.num_groups
    tables = [tuple(tuple(range(i * 16, i * 16 + 8)) for _ in range(num_groups)) for i in range(3)]
    done = [0] * 3
    captured: list[tuple[int, int, torch.Tensor]] = []
    original = model.compute_logits
    model.compute_logits = lambda h: captured_logits(original, h, captured)
    step = 0
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        sequences, pending = [], []
        for i, prompt in enumerate(prompts):
            if done[i] >= len(prompt) or rng.random() < 0.3:
                continue
            n = min(rng.choice([1, 1, 2, 3, 7]), len(prompt) - done[i])
            sequences.append(ScheduledSequence(request_id=i, token_ids=tuple(prompt[done[i]:done[i] + n]),
                                               cached_len=done[i], block_tables=tables[i], sample=True,
                                               sampling=GREEDY, reset=done[i] == 0, prompt_len=len(prompt)))
            pending.append((i, done[i] + n - 1))
            done[i] += n
        if not sequences:
            continue
        captured.clear()
        runner.execute(StepPlan(step_id=step, sequences=tuple(sequences)))
        step += 1
        logits = captured[0][2]
        for row, (i, pos) in enumerate(pending):
            torch.testing.assert_close(logits[row], expected[i][pos], atol=2e-4, rtol=0)


def captured_logits(original, hidden: torch.Tensor, sink: list) -> torch.Tensor:
    logits = original(hidden)
    sink.append((0, 0, logits))
    return logits


def test_greedy_token_is_argmax_and_tokens_are_counted() -> None:
    spec, model, runner = make("gemma-4-31b-tiny")
    prompt = list(range(10, 22))
    expected = contiguous_logits(model, spec, [prompt])[0][-1]
    tables = tuple(tuple(range(8)) for _ in range(runner.num_groups))
    result = runner.execute(StepPlan(step_id=0, sequences=(ScheduledSequence(
        request_id=7, token_ids=tuple(prompt), cached_len=0, block_tables=tables, sample=True,
        sampling=GREEDY, reset=True, prompt_len=len(prompt)),)))
    assert [t.token_id for t in result.tokens] == [int(expected.argmax())]
    assert runner.tokens_computed == len(prompt)


def test_runner_applies_logit_edits_and_counts_outputs_for_min_tokens() -> None:
    """The runner hands the sampler each row's output count: an EOS favoured by logit_bias is held back
    on the first output token (min_tokens=1) and allowed on the second (a decode step)."""
    _, _, runner = make("gemma-4-31b-tiny")
    prompt = list(range(10, 22))
    eos = 5
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=1, logit_bias=((eos, 100.0),),
                            eos_token_ids=(eos,))
    tables = tuple(tuple(range(8)) for _ in range(runner.num_groups))
    first = runner.execute(StepPlan(step_id=0, sequences=(ScheduledSequence(
        request_id=1, token_ids=tuple(prompt), cached_len=0, block_tables=tables, sample=True,
        sampling=params, reset=True, prompt_len=len(prompt)),)))
    (token,) = first.tokens
    assert token.token_id != eos
    second = runner.execute(StepPlan(step_id=1, sequences=(ScheduledSequence(
        request_id=1, token_ids=(token.token_id,), cached_len=len(prompt), block_tables=tables, sample=True,
        sampling=params, prompt_len=len(prompt)),)))
    assert [t.token_id for t in second.tokens] == [eos]


def run_steps(runner: ModelRunner, params: SamplingParams, prompt: list[int], steps: int, *,
              overlap: bool) -> list[int]:
    """One request's greedy outputs over ``steps`` steps (a prefill, then decodes); with ``overlap`` each decode
    is launched before the previous step is collected, its token ``PENDING_TOKEN``."""
    from inference_server.records.steps import PENDING_TOKEN

    tables = tuple(tuple(range(16)) for _ in range(runner.num_groups))
    outputs: list[int] = []

    def plan(step: int) -> StepPlan:
        ids = tuple(prompt) if step == 0 else ((PENDING_TOKEN,) if overlap else (outputs[-1],))
        return StepPlan(step_id=step, sequences=(ScheduledSequence(
            request_id=1, token_ids=ids, cached_len=0 if step == 0 else len(prompt) + step - 1, block_tables=tables,
            sample=True, sampling=params, reset=step == 0, prompt_len=len(prompt)),))

    if not overlap:
        for step in range(steps):
            outputs += [t.token_id for t in runner.execute(plan(step)).tokens]
        return outputs
    launched = runner.launch(plan(0))
    for step in range(1, steps + 1):
        following = runner.launch(plan(step)) if step < steps else None
        outputs += [t.token_id for t in runner.collect(launched).tokens]
        launched = following  # type: ignore[assignment]
    return outputs


def test_a_step_without_bad_words_does_not_ask_each_row_about_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner asks every sampled row, every step, whether its bad words follow its output: a property walking
    the row's (empty) word sequences cost 82 us a step at 256 rows. Rows without bad words are not asked."""
    asked: list[SamplingParams] = []

    def counted(params: SamplingParams) -> bool:
        asked.append(params)
        return any(len(ids) > 1 for ids in params.bad_words_token_ids)

    monkeypatch.setattr(SamplingParams, "bans_after_prefixes", property(counted))
    _, _, runner = make("gemma-4-31b-tiny")
    run_steps(runner, SamplingParams(temperature=1.0, max_tokens=16, seed=3), list(range(10, 22)), 3, overlap=True)
    assert not asked


@pytest.mark.parametrize("overlap", [False, True])
def test_runner_bans_bad_words_after_their_prefix(overlap: bool) -> None:
    """vLLM's bad words through the runner: a one-token word is never sampled; a two-token word's last token is
    banned only right after its first (the runner hands the sampler each row's outputs, reading an in-flight
    token back first when steps overlap)."""
    _, _, runner = make("gemma-4-31b-tiny")
    prompt = list(range(10, 22))
    plain = run_steps(runner, GREEDY, prompt, 6, overlap=overlap)
    first, second = plain[0], plain[1]
    assert first != second, plain
    pair = SamplingParams(temperature=0.0, max_tokens=16, bad_words_token_ids=((first, second),))
    _, _, runner = make("gemma-4-31b-tiny")
    out = run_steps(runner, pair, prompt, 6, overlap=overlap)
    assert out[0] == first and out[1] != second  # banned right after its first token
    assert all((a, b) != (first, second) for a, b in pairwise(out))
    one = SamplingParams(temperature=0.0, max_tokens=16, bad_words_token_ids=((second,),))
    _, _, runner = make("gemma-4-31b-tiny")
    out = run_steps(runner, one, prompt, 6, overlap=overlap)
    assert out[0] == first and second not in out  # banned everywhere
