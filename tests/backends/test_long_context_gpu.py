"""Long context on the GPU: a tiny preset stretched to its real model's longest context, fp32, the custom-cuda runner
against the reference runner (PyTorch ops) on the same weights.

The prompt fills the real model's whole window (``max_position_embeddings`` of the real config, less the decode
steps), so every long-context path runs at its largest: RoPE at positions past 2^17, block tables of ~16k blocks,
the prefill attention over a quarter of a million keys, the sliding layers' window at the end of a long sequence,
and the decode attention's split count fixed by that model length. The CUDA runner prefills in chunks of the
engine's prefill-only step budget (8,192 tokens), the reference in 2,048 (its attention materialises every score
of a chunk), so the comparison also holds the chunking invariance in exact arithmetic. Then ``DECODE_STEPS``
greedy steps teacher-forced by the reference. Tolerance as in ``test_cuda_backend``'s fp32 tests: the same greedy
token at every step, relative logits error <= 1e-3 (both compute in fp32; only the order of sums differs).
"""

from __future__ import annotations

import random

import pytest
import torch
from tests.backends.test_cuda_backend import LogitsTap

from inference_server.backends.cuda.options import CudaRunnerOptions
from inference_server.backends.cuda.runner import CudaModelRunner
from inference_server.backends.model_runner import ModelRunner
from inference_server.backends.paged_kv import PagedKVStorage, group_of
from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import ModelSpec, parse_model_spec
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan

pytestmark = pytest.mark.gpu

BLOCK = 16
DECODE_STEPS = 8
RUNNER_CHUNK = 8192  # the CUDA default MAX_PREFILL_TOKENS: a long prompt alone is prefilled in these
REFERENCE_CHUNK = 2048
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)
REQUEST = 7


def stretched(tiny: str, real: str) -> dict:
    """The tiny preset's config with the real model's longest context."""
    config = preset_config(tiny)
    config["max_position_embeddings"] = preset_config(real)["max_position_embeddings"]
    return config


def runner_pair(spec: ModelSpec, num_blocks: int,
                device: torch.device) -> tuple[ModelRunner, CudaModelRunner, LogitsTap]:
    """The reference runner and the CUDA runner (graphs for batch 1), each with a model of its own holding the same
    weights and a KV storage of ``num_blocks`` per group."""
    groups = {group_of(layer) for layer in spec.cache_layers}
    models = []
    for _ in range(2):
        model = build_model(spec, torch.float32, device)
        init_dummy_weights(model, seed=0)
        models.append(model)
    tap = LogitsTap(*models)

    def storage() -> PagedKVStorage:
        return PagedKVStorage(spec.cache_layers, dict.fromkeys(groups, num_blocks), BLOCK, torch.float32, device)

    reference = ModelRunner(models[0], spec, storage(), device)
    options = CudaRunnerOptions(max_model_len=num_blocks * BLOCK, max_batch_size=1)
    return reference, tap.watch(CudaModelRunner(models[1], spec, storage(), device, options)), tap


def prefill(runner: ModelRunner, prompt: list[int], chunk: int, tables: tuple[tuple[int, ...], ...],
            tap: LogitsTap) -> tuple[int, torch.Tensor]:
    """The prompt in steps of ``chunk`` tokens; the greedy token and logits of its last step."""
    token = -1
    for step, start in enumerate(range(0, len(prompt), chunk)):
        end = min(len(prompt), start + chunk)
        plan = StepPlan(step_id=step, sequences=(ScheduledSequence(
            request_id=REQUEST, token_ids=tuple(prompt[start:end]), cached_len=start, block_tables=tables,
            sample=end == len(prompt), sampling=GREEDY, reset=start == 0, prompt_len=len(prompt)),))
        result = runner.execute(plan)
        if end == len(prompt):
            token = result.tokens[0].token_id
    assert tap.last is not None
    return token, tap.last


def decode(runner: ModelRunner, token: int, position: int, tables: tuple[tuple[int, ...], ...],
           prompt_len: int, tap: LogitsTap) -> tuple[int, torch.Tensor]:
    plan = StepPlan(step_id=position, sequences=(ScheduledSequence(
        request_id=REQUEST, token_ids=(token,), cached_len=position, block_tables=tables, sample=True,
        sampling=GREEDY, reset=False, prompt_len=prompt_len),))
    result = runner.execute(plan)
    assert tap.last is not None
    return result.tokens[0].token_id, tap.last


def relative_error(ours: torch.Tensor, truth: torch.Tensor) -> float:
    return float((ours - truth).norm() / truth.norm())


@pytest.mark.parametrize(("tiny", "real"), [("gemma-4-26b-a4b-tiny", "gemma-4-26b-a4b"),
                                            ("gemma-4-e2b-tiny", "gemma-4-e2b")])
def test_fp32_greedy_at_the_longest_context_equals_reference(tiny: str, real: str) -> None:
    config = stretched(tiny, real)
    spec = parse_model_spec(config)
    length = config["max_position_embeddings"] - DECODE_STEPS
    num_blocks = -(-(length + DECODE_STEPS) // BLOCK)
    tables = (tuple(range(num_blocks)),) * (max(group_of(layer) for layer in spec.cache_layers) + 1)
    rng = random.Random(0)
    prompt = [rng.randrange(3, spec.vocab_size) for _ in range(length - 1)]  # the last position is the 1st decode's
    reference, runner, tap = runner_pair(spec, num_blocks, torch.device("cuda"))

    truth_token, truth_logits = prefill(reference, prompt, REFERENCE_CHUNK, tables, tap)
    token, logits = prefill(runner, prompt, RUNNER_CHUNK, tables, tap)
    errors = [relative_error(logits, truth_logits)]
    tokens = [(token, truth_token)]
    position = len(prompt)
    for _ in range(DECODE_STEPS):  # teacher-forced: both decode the reference's token
        truth_next, truth_logits = decode(reference, truth_token, position, tables, len(prompt), tap)
        ours_next, logits = decode(runner, truth_token, position, tables, len(prompt), tap)
        errors.append(relative_error(logits, truth_logits))
        tokens.append((ours_next, truth_next))
        truth_token, position = truth_next, position + 1
    assert position == config["max_position_embeddings"] - 1
    assert runner.graph_steps == DECODE_STEPS
    assert all(ours == truth for ours, truth in tokens), tokens
    assert max(errors) <= 1e-3, errors
