"""Engines for actor tests: the fake engine (``tests/fake_engine.py``) as an in-loop executor, or the real CPU
runner on a tiny model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tests.fake_engine import FakeEngine

from inference_server.actors.executor import RunnerPipeline
from inference_server.backends.model_runner import ModelRunner
from inference_server.backends.paged_kv import FULL_GROUP, SLIDING_GROUP, PagedKVStorage
from inference_server.core.kv_manager import KVManager
from inference_server.core.scheduler import SchedulerConfig
from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import parse_model_spec
from inference_server.supervisor import EngineParts

BLOCK = 4
VOCAB = 512


def fake_parts(step: Callable, *, num_blocks: int = 256, **overrides) -> EngineParts:
    config = overrides.pop("scheduler_config", SchedulerConfig(max_batch_size=8, max_num_batched_tokens=64))
    values = dict(step=step, kv=KVManager(block_size=BLOCK, num_full_blocks=num_blocks), tokenizer=None,
                  max_model_len=512, vocab_size=VOCAB, eos_token_ids=frozenset(), scheduler_config=config)
    values.update(overrides)
    return EngineParts(**values)


BACKENDS = ["reference", "hf"]
"""The step runners the actor tests that run a real model are parametrised over (``backend`` fixture)."""


def tiny_model_parts(num_blocks: int, *, preset: str = "gemma-4-31b-tiny", backend: str = "reference",
                     **overrides) -> EngineParts:
    """A real CPU step runner (fp32) on a tiny dummy-weight model: the reference runner (our model, reference
    attention) or the Hugging Face runner (transformers' model built from the same preset; no prefix cache)."""
    torch.set_num_threads(1)
    spec = parse_model_spec(preset_config(preset))
    window = max((c.window for c in spec.cache_layers if c.window), default=None)
    kv = KVManager(block_size=BLOCK, num_full_blocks=num_blocks, num_sliding_blocks=num_blocks if window else 0,
                   sliding_window=window, enable_prefix_cache=backend != "hf")
    runner: ModelRunner
    if backend == "hf":
        from inference_server.backends.hf.loading import _from_config, config_from_dict
        from inference_server.backends.hf.runner import HFModelRunner

        hf_model = _from_config(config_from_dict(preset_config(preset)), torch.float32, torch.device("cpu"), 5)
        runner = HFModelRunner(hf_model, spec, torch.device("cpu"))
    else:
        model = build_model(spec, torch.float32, "cpu")
        init_dummy_weights(model, seed=5)
        groups = {FULL_GROUP: num_blocks} | ({SLIDING_GROUP: num_blocks} if window else {})
        storage = PagedKVStorage(spec.cache_layers, groups, BLOCK, torch.float32, "cpu")
        runner = ModelRunner(model, spec, storage, torch.device("cpu"))
    # The runner's own launch/collect (pending tokens resolved on the device), in the loop: keeps mock-clock
    # tests free of threads. ``step.runner`` lets tests count the tokens it computed.
    step = RunnerPipeline(runner, threaded=False)

    values = dict(step=step, kv=kv, tokenizer=None, max_model_len=256, vocab_size=spec.vocab_size,
                  eos_token_ids=frozenset(),
                  scheduler_config=SchedulerConfig(max_batch_size=8, max_num_batched_tokens=32))
    values.update(overrides)
    return EngineParts(**values)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def fake_step() -> FakeEngine:
    """The fake engine as an in-loop executor step of 10 ms (mock time)."""
    return FakeEngine(step_seconds=0.01)
