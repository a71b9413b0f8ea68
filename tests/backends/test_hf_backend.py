"""The Hugging Face backend (``BACKEND=hf``) runs the scheduler's plans with stock transformers models."""

from __future__ import annotations

import pytest
import torch

from inference_server.backends.hf.eviction_config import EvictionConfig
from inference_server.backends.hf.runner import HFModelRunner
from inference_server.config import SettingsError, load_settings
from inference_server.records.steps import ScheduledSequence, StepPlan
from inference_server.runtime import resolve_backend

from .hf_testkit import GREEDY, drive, generate, hf_runner, tiny_models

PROMPTS = [[2, 5, 9, 33, 100, 7, 8, 9, 10, 11, 12, 13], [2, 44, 45], [2, 300, 301, 302, 303, 304, 17]]


@pytest.mark.parametrize("name", ["gemma3-tiny", "gemma-4-e2b-tiny", "qwen3-30b-a3b-tiny"])
def test_greedy_tokens_equal_transformers_generate(name: str, one_torch_thread: None) -> None:
    """Chunked prefill and batched decodes of prompts of different lengths (sliding windows of 8 are passed)
    give the tokens transformers' own ``generate`` gives for each prompt alone."""
    model, reference = tiny_models(name)
    runner = hf_runner(model)
    outputs = drive(runner, PROMPTS, new_tokens=16)
    assert outputs == [generate(reference, prompt, 16) for prompt in PROMPTS]


def test_decodes_of_a_step_share_one_forward(one_torch_thread: None) -> None:
    model, _ = tiny_models("gemma3-tiny")
    runner = hf_runner(model)
    drive(runner, PROMPTS, new_tokens=4, chunk=64)
    assert runner.forwards == len(PROMPTS) + 3  # one prefill forward each, then one forward per decode step


def test_preemption_and_abort_free_the_cache(one_torch_thread: None) -> None:
    model, reference = tiny_models("gemma3-tiny")
    runner = hf_runner(model)
    prompt = PROMPTS[0]
    first = runner.execute(StepPlan(0, (ScheduledSequence(7, tuple(prompt), 0, ((),), True, GREEDY, reset=True,
                                                          prompt_len=len(prompt)),)))
    token = first.tokens[0].token_id
    # Preempted, then recomputed: the restarted chunk (reset) replaces the old cache.
    again = runner.execute(StepPlan(1, (ScheduledSequence(7, (*prompt, token), 0, ((),), True, GREEDY, reset=True,
                                                          prompt_len=len(prompt)),)))
    assert runner.caches[7].seen == len(prompt) + 1
    assert [token, again.tokens[0].token_id] == generate(reference, prompt, 2)
    runner.execute(StepPlan(2, (), finished_request_ids=(7,)))
    assert 7 not in runner.caches
    with pytest.raises(RuntimeError, match="prefix cache off"):
        runner.execute(StepPlan(3, (ScheduledSequence(8, (5, 6), 4, ((),), True, GREEDY, reset=True),)))


def test_prompt_logprobs_match_a_full_forward(one_torch_thread: None) -> None:
    model, reference = tiny_models("gemma3-tiny")
    runner = hf_runner(model)
    prompt = PROMPTS[0]
    targets = tuple(prompt[1:])
    result = runner.execute(StepPlan(0, (ScheduledSequence(1, tuple(prompt), 0, ((),), True, GREEDY, reset=True,
                                                           prompt_len=len(prompt), prompt_logprob_targets=targets),)))
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(targets)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(result.prompt_logprobs[0].token_logprobs), expected, atol=1e-4)


@pytest.mark.parametrize(("policy", "budget", "sink"), [("none", 8, 4), ("sink", 8, 4), ("sink", 32, 9),
                                                        ("h2o", 4, 4), ("lru", 0, 4)])
def test_bad_eviction_settings_are_rejected(policy: str, budget: int, sink: int) -> None:
    with pytest.raises(ValueError, match="KV_"):
        EvictionConfig(policy, budget, sink)


@pytest.mark.parametrize(("values", "message"), [
    ({"BACKEND": "reference", "KV_EVICTION": "sink", "KV_BUDGET_TOKENS": "64"}, "feature of BACKEND=hf"),
    ({"BACKEND": "hf", "KV_EVICTION": "h2o"}, "KV_BUDGET_TOKENS >= 16"),
    ({"BACKEND": "hf", "KV_BUDGET_TOKENS": "64"}, "needs an eviction policy"),
    ({"BACKEND": "hf", "KV_EVICTION": "sink", "KV_BUDGET_TOKENS": "32", "KV_SINK_TOKENS": "9"}, "KV_SINK_TOKENS"),
    ({"KV_EVICTION": "fifo"}, "accepted values are none, lru, sink, h2o"),
])
def test_bad_settings_stop_start_up(values: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        resolve_backend(load_settings(environ=values, dotenv_path=None), torch.device("cpu"))


def test_good_hf_settings_resolve() -> None:
    settings = load_settings(environ={"BACKEND": "hf", "KV_EVICTION": "lru", "KV_BUDGET_TOKENS": "256"},
                             dotenv_path=None)
    assert resolve_backend(settings, torch.device("cpu")) == "hf"


def test_one_forward_per_decode_gives_the_same_tokens(one_torch_thread: None) -> None:
    model, _ = tiny_models("gemma3-tiny")
    batched = drive(hf_runner(model), PROMPTS, new_tokens=8)
    runner = hf_runner(model)
    runner.batch_decodes = False
    assert drive(runner, PROMPTS, new_tokens=8) == batched


@pytest.mark.heavy
def test_embedded_model_greedy_equals_transformers_generate() -> None:
    """The embedded GGUF through transformers' GGUF loading, served by the runner: the same greedy tokens as
    ``generate`` on that model, for prompts of different lengths decoded together."""
    from inference_server.backends.hf.loading import load_hf_model
    from inference_server.config import Settings

    loaded = load_hf_model(Settings(backend="hf", device="cpu"), torch.device("cpu"), torch.float32)
    assert loaded.tokenizer is not None
    prompts = [loaded.tokenizer.encode(text) for text in ("The capital of France is", "Once upon a time, in a")]
    outputs = drive(HFModelRunner(loaded.model, loaded.spec, torch.device("cpu")), prompts, new_tokens=8, chunk=4)
    loaded.model.set_attn_implementation("sdpa")
    assert outputs == [generate(loaded.model, prompt, 8) for prompt in prompts]
