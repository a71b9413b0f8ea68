"""Helpers for the Hugging Face backend tests: tiny random transformers models and a plan driver."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from inference_server.backends.hf.eviction_config import EvictionConfig
from inference_server.backends.hf.loading import config_from_dict
from inference_server.backends.hf.runner import HFModelRunner
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import parse_model_spec
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan

TINY_GEMMA3 = dict(model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=8,
                   max_position_embeddings=1024, query_pre_attn_scalar=16, bos_token_id=2, eos_token_id=1,
                   pad_token_id=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def tiny_config(name: str) -> dict[str, Any]:
    return dict(TINY_GEMMA3) if name == "gemma3-tiny" else preset_config(name)


def tiny_models(name: str, seed: int = 0) -> tuple[Any, Any]:
    """Two copies of one random model: one for the runner, one (default attention) for ``generate``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config_from_dict(tiny_config(name))
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    reference.load_state_dict(model.state_dict())
    return model.eval(), reference.eval()


def hf_runner(model: Any, eviction: EvictionConfig | None = None) -> HFModelRunner:
    return HFModelRunner(model, parse_model_spec(model.config.to_dict()), torch.device("cpu"), eviction)


def drive(runner: HFModelRunner, prompts: Sequence[Sequence[int]], new_tokens: int, chunk: int = 5,
          sampling: SamplingParams = GREEDY) -> list[list[int]]:
    """Greedy-generate ``new_tokens`` per prompt through plans as the scheduler makes them: every prompt
    prefilled in ``chunk``-token chunks (all prompts' chunks in the same steps), then batched decodes."""
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [0] * len(prompts)
    step = 0
    while any(len(out) < new_tokens for out in outputs):
        sequences = []
        for i, prompt in enumerate(prompts):
            if done[i] < len(prompt):
                ids = tuple(prompt[done[i]:done[i] + chunk])
                sequences.append(ScheduledSequence(i, ids, done[i], ((),), done[i] + len(ids) == len(prompt),
                                                   sampling, reset=done[i] == 0, prompt_len=len(prompt)))
                done[i] += len(ids)
            elif len(outputs[i]) < new_tokens:
                cached = len(prompt) + len(outputs[i]) - 1
                sequences.append(ScheduledSequence(i, (outputs[i][-1],), cached, ((),), True, sampling,
                                                   prompt_len=len(prompt)))
        result = runner.execute(StepPlan(step, tuple(sequences)))
        for token in result.tokens:
            outputs[token.request_id].append(token.token_id)
        step += 1
    return outputs


def generate(reference: Any, prompt: Sequence[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([list(prompt)])
    out = reference.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()
