"""Prompt logprobs from the real CPU runner equal a direct full forward's log-softmax, whatever the chunking
and whether or not the prefix cache holds the prompt; ``max_tokens=0`` only scores the prompt."""

from __future__ import annotations

import pytest
import torch
import trio
from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch

from inference_server.backends import model_runner
from inference_server.core.scheduler import SchedulerConfig
from inference_server.offline import Completion, collect, run_engine
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import Engine, EngineParts

from .conftest import tiny_model_parts

PROMPT = tuple((7 * i + 3) % 500 + 3 for i in range(23))


def direct_log_softmax(parts: EngineParts, prompt: tuple[int, ...]) -> torch.Tensor:
    """[len(prompt), V] log-softmax of one full contiguous forward over ``prompt`` (fp32)."""
    runner = parts.step.runner  # type: ignore[attr-defined]
    if hasattr(runner, "hf_model"):  # the Hugging Face runner: transformers' own forward and attention
        implementation = runner.hf_model.config._attn_implementation
        runner.hf_model.set_attn_implementation("eager")
        try:
            with torch.no_grad():
                logits = runner.hf_model(torch.tensor([prompt])).logits[0]
        finally:
            runner.hf_model.set_attn_implementation(implementation)
        return torch.log_softmax(logits.float(), dim=-1)
    model, spec = runner.model, runner.spec
    batch = ForwardBatch(seq_ids=(0,), cached_lens=(0,), query_lens=(len(prompt),))
    with torch.no_grad():
        hidden = model(torch.tensor(prompt), ContiguousKVCache(spec).context(batch, "cpu"))
        return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def assert_matches_forward(completion: Completion, expected: torch.Tensor, prompt: tuple[int, ...], k: int) -> None:
    scored = completion.prompt_logprobs
    assert scored is not None and len(scored) == len(prompt)
    assert [p.token_id for p in scored] == list(prompt)
    assert scored[0].logprob is None and scored[0].top_logprobs == ()
    for position in range(1, len(prompt)):
        row = expected[position - 1]
        entry = scored[position]
        assert entry.logprob == pytest.approx(row[prompt[position]].item(), abs=1e-4)
        best = row.topk(k)
        assert [i for i, _ in entry.top_logprobs] == best.indices.tolist()
        assert [lp for _, lp in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [5, 8, 64])
async def test_prompt_logprobs_equal_full_forward_across_chunks(budget: int, backend: str) -> None:
    parts = tiny_model_parts(num_blocks=64, backend=backend, scheduler_config=SchedulerConfig(max_batch_size=4,
                                                                             max_num_batched_tokens=budget))
    expected = direct_log_softmax(parts, PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    other = GenerationRequest(params=SamplingParams(temperature=0.0, max_tokens=4), prompt_ids=PROMPT[3:15])
    _, (scored, plain) = await run_engine(parts, [GenerationRequest(params=params, prompt_ids=PROMPT), other])
    assert_matches_forward(scored, expected, PROMPT, 2)
    assert plain.prompt_logprobs is None
    assert len(scored.token_ids) == 3


async def test_prompt_logprobs_in_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's log-softmax in blocks of rows (bounded memory) gives the same values."""
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 4)
    parts = tiny_model_parts(num_blocks=64)
    expected = direct_log_softmax(parts, PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    _, (scored,) = await run_engine(parts, [GenerationRequest(params=params, prompt_ids=PROMPT)])
    assert_matches_forward(scored, expected, PROMPT, 2)


async def test_prefix_cache_hit_does_not_lose_prompt_logprobs() -> None:
    """The second request's prompt is cached by the first; it is computed from position 0 instead, and the
    third (no prompt logprobs) still uses the cache."""
    parts = tiny_model_parts(num_blocks=64)
    expected = direct_log_softmax(parts, PROMPT)
    plain = GenerationRequest(params=SamplingParams(temperature=0.0, max_tokens=2), prompt_ids=PROMPT)
    scored = GenerationRequest(params=SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
                               prompt_ids=PROMPT)
    outputs = []
    async with trio.open_nursery() as nursery:
        engine: Engine = await nursery.start(Engine(parts).run)
        for request in (plain, scored, plain):
            before = parts.step.runner.tokens_computed  # type: ignore[attr-defined]
            outputs.append(await collect(engine.submit(request)))
            outputs.append(parts.step.runner.tokens_computed - before)  # type: ignore[attr-defined]
        engine.close()
    first, first_cost, second, second_cost, third, third_cost = outputs
    assert second_cost == first_cost  # the whole prompt again: no cached block used
    assert third_cost < first_cost  # the cache still serves requests that do not score the prompt
    assert_matches_forward(second, expected, PROMPT, 1)
    assert first.token_ids == second.token_ids == third.token_ids


async def test_max_tokens_zero_only_scores_the_prompt(backend: str) -> None:
    parts = tiny_model_parts(num_blocks=64, backend=backend)
    expected = direct_log_softmax(parts, PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0)
    _, (result,) = await run_engine(parts, [GenerationRequest(params=params, prompt_ids=PROMPT)])
    assert result.finish_reason == "length" and result.token_ids == () and result.text == ""
    scored = result.prompt_logprobs
    assert scored is not None and all(p.top_logprobs == () for p in scored)
    assert [p.logprob for p in scored[1:]] == pytest.approx(
        [expected[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))], abs=1e-4)


async def test_one_token_prompt_has_only_the_null_entry() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    _, (result,) = await run_engine(tiny_model_parts(num_blocks=16),
                                    [GenerationRequest(params=params, prompt_ids=(42,))])
    assert result.prompt_logprobs is not None
    assert [(p.token_id, p.logprob) for p in result.prompt_logprobs] == [(42, None)]
    assert len(result.token_ids) == 1
