"""``DETERMINISTIC=true`` on the custom-cuda runner: greedy tokens and logprobs of a request are bitwise the same alone,
inside a loaded mixed batch with chunked prefill, after a prefix-cache hit of part of its prompt, and after being
preempted and recomputed (``tests/schedule_invariance.py``).

``gpu`` tests: bf16 (what the GPU serves), dummy weights, Gemma-4-26B-A4B, Gemma-4-E4B and Qwen3-30B-A3B at their real
widths, head sizes, windows and expert shapes, cut to a few layers; the default mode runs the same schedules and
its divergence is printed (issue 43 measured 3 of 8 prompts identical in a loaded batch on 26B-A4B): it is asserted
to differ somewhere in the tokens or logprobs, which is what the deterministic mode is for.

A ``heavy`` test runs the deterministic table's kernels (the fixed-tile GEMM, the one-row RMSNorm, the fixed-config
MoE, the aligned prefill attention, the split decode attention at decode steps, the decode graph staging) on the CPU
under the Triton interpreter on a tiny Gemma 4 MoE. There ``tl.dot`` is numpy's matmul, whose CPU BLAS may sum a
64-row tile's last rows in another order, so that test asserts the tokens; the bitwise claim is the GPU tests'.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from tests.schedule_invariance import InvarianceConfig, InvarianceReport, cut_model_folder, run_invariance

WAYS = ("loaded", "cache_hit", "preempted")
GPU_MODELS = (("gemma-4-26b-a4b", 6), ("gemma-4-e4b", 6), ("qwen3-30b-a3b", 4))
"""Presets and the layers they are cut to (Gemma 4: five sliding layers and the full one)."""



def gpu_config(folder: Path, deterministic: bool) -> InvarianceConfig:
    """bf16 on the custom-cuda backend with its decode graphs: a 256-token step budget chunks the long prompts, 12
    fillers make the loaded steps ~20 sequences, and a 6,144-token KV pool preempts in the second loaded run."""
    settings = {"MODEL": str(folder), "DUMMY_WEIGHTS": "true", "DEVICE": "cuda", "BACKEND": "custom-cuda",
                "DTYPE": "bfloat16", "MAX_NUM_BATCHED_TOKENS": "256", "KV_BLOCK_SIZE": "16", "KV_CACHE_TOKENS": "65536",
                "MAX_BATCH_SIZE": "64", "DETERMINISTIC": str(deterministic).lower()}
    return InvarianceConfig(settings=settings, prompt_lengths=(5, 40, 289, 600, 1025, 1500, 129), max_tokens=16,
                            num_fillers=12, filler_prompt_lengths=(40, 300, 9, 700), filler_max_tokens=96,
                            stagger_tokens=24, preempt_kv_tokens=6144)


def assert_bitwise(report: InvarianceReport) -> None:
    print(report.table())
    assert report.loaded_mixed_steps > 0 and any(o.loaded_chunks > 1 for o in report.outcomes)
    assert any(o.runs["cache_hit"].cached_prompt_tokens for o in report.outcomes), "no cache hit"
    assert any(o.preempted_restarts for o in report.outcomes), "no test prompt was preempted"
    assert report.defects() == [], report.table()
    n = len(report.outcomes)
    assert [report.bitwise_equal(way) for way in WAYS] == [n] * len(WAYS), report.table()


@pytest.mark.gpu
@pytest.mark.parametrize(("preset", "layers"), GPU_MODELS)
def test_bf16_greedy_is_bitwise_deterministic_on_cuda(tmp_path: Path, preset: str, layers: int) -> None:
    folder = cut_model_folder(preset, layers, tmp_path / f"{preset}-{layers}l")
    assert_bitwise(run_invariance(gpu_config(folder, deterministic=True)))


DEFAULT_MODE_CASES = [pytest.param(preset, layers, marks=() if preset == "qwen3-30b-a3b" else pytest.mark.slow)
                      for preset, layers in GPU_MODELS]
"""The default mode's divergence is a characterisation, not a guard: one preset (the quickest) runs in the default
GPU suite, all three with ``--run-slow``, so that the suite fits one device call."""


@pytest.mark.gpu
@pytest.mark.parametrize(("preset", "layers"), DEFAULT_MODE_CASES)
def test_bf16_default_mode_is_not_batch_invariant_on_cuda(tmp_path: Path, preset: str, layers: int) -> None:
    folder = cut_model_folder(preset, layers, tmp_path / f"{preset}-{layers}l")
    # loaded and cache hit are enough to show a difference: no second (preempting) engine for the default mode
    config = attrs.evolve(gpu_config(folder, deterministic=False), preempt_kv_tokens=None)
    report = run_invariance(config)
    print(report.table())
    n = len(report.outcomes)
    assert sum(report.bitwise_equal(way) for way in WAYS[:2]) < 2 * n, report.table()


@pytest.mark.heavy
def test_deterministic_cuda_runner_in_the_triton_interpreter() -> None:
    """The custom-cuda runner with ``DETERMINISTIC`` on the CPU (graph staging without capture), tiny Gemma 4 MoE."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the Triton interpreter is off where CUDA is present (the gpu tests cover the kernels)")
    from tests.schedule_invariance import build_engine

    from inference_server.actors.executor import RunnerPipeline
    from inference_server.backends.cuda.options import CudaRunnerOptions
    from inference_server.backends.cuda.runner import CudaModelRunner

    config = InvarianceConfig(
        settings={"MODEL": "gemma-4-26b-a4b-tiny", "DUMMY_WEIGHTS": "true", "DEVICE": "cpu", "DTYPE": "float32",
                  "MAX_NUM_BATCHED_TOKENS": "16", "KV_BLOCK_SIZE": "4", "KV_CACHE_TOKENS": "2048",
                  "ADMISSION_TIMEOUT": "3600"},  # interpreted steps are slow on a busy machine
        prompt_lengths=(3, 30, 13), max_tokens=4, num_fillers=2, filler_prompt_lengths=(20, 3), filler_max_tokens=12,
        stagger_tokens=3)
    built = build_engine(config)
    runner = CudaModelRunner(built.loaded.model, built.loaded.spec, built.runner.storage, built.device,
                             CudaRunnerOptions(max_model_len=built.parts.max_model_len, max_batch_size=8,
                                               reference_ops=True, deterministic=True))
    built = attrs.evolve(built, parts=attrs.evolve(built.parts, step=RunnerPipeline(runner)), runner=runner)
    report = run_invariance(config, built)
    print(report.table())
    assert report.loaded_mixed_steps > 0 and report.defects() == [], report.table()
    assert runner.graph_steps > 0 and runner.eager_steps > 0
