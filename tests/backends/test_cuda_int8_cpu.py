"""The custom-cuda runner with an int8 model (QUANTIZATION=int8 layers and experts) against the reference runner
on an int8 model of the same weights, with the Triton kernels (``kernels.int8_linear``, the int8 path of
``kernels.fused_moe``) in the CPU interpreter: fused q/k/v and gate/up over int8 weights, the static decode path,
fp32; on a GPU (``gpu``) with the int8 head (``INT8_EMBEDDINGS=on``) and the fused int8 greedy head, graphs captured."""

from __future__ import annotations

import pytest
import torch
from tests.backends.test_cuda_backend import (
    BLOCK,
    LogitsTap,
    Script,
    build,
    compare,
    num_groups,
    storage_for,
    tokens_of,
)

from inference_server.backends.cuda.options import CudaRunnerOptions
from inference_server.backends.cuda.runner import CudaModelRunner
from inference_server.backends.model_runner import ModelRunner
from inference_server.models.architectures.blocks import SelfAttention
from inference_server.models.architectures.quantized import quantize_model_int8_


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels in the CPU interpreter; "
                    "the GPU runs them through the engine")
# Qwen3-MoE in CI: int8 experts (the int8 MoE kernels) and int8 dense projections (the fused q/k/v, o) on this
# runner; E2B is the same check on a dense model (its int8 layers: models/test_quantized.py, every architecture)
@pytest.mark.parametrize("name", ["qwen3-30b-a3b-tiny", pytest.param("gemma-4-e2b-tiny", marks=pytest.mark.slow)])
def test_int8_model_on_the_cuda_runner_matches_the_reference_runner(name: str) -> None:
    torch.set_num_threads(1)
    spec, model = build(name, torch.float32, "cpu")
    _, reference_model = build(name, torch.float32, "cpu")  # the same weights, through the reference ops table
    quantize_model_int8_(model)
    quantize_model_int8_(reference_model)
    tap = LogitsTap(model, reference_model)
    script = Script(spec, num_groups(spec), 4, seed=1, prompt_lens=(5, 12))
    n, m = len(script.seqs), script.blocks_per_seq
    reference = ModelRunner(reference_model, spec, storage_for(spec, n, m, torch.float32, "cpu"), torch.device("cpu"))
    options = CudaRunnerOptions(max_model_len=m * BLOCK, max_batch_size=4)
    runner = tap.watch(CudaModelRunner(model, spec, storage_for(spec, n, m, torch.float32, "cpu"), torch.device("cpu"),
                                       options))
    fused = [m for m in model.modules() if isinstance(m, SelfAttention) and m.qkv_weight is not None]
    assert fused and all(module.qkv_weight.dtype == torch.int8 for module in fused)
    comparison = compare(script, tokens_of(reference), tokens_of(runner), tap, 4)
    assert comparison.agree == comparison.total
    assert max(comparison.errors) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-30b-a3b-tiny", "gemma-4-31b-tiny"])  # untied / tied + soft-cap
def test_int8_head_on_the_gpu_runner_matches_the_reference_runner(name: str) -> None:
    """An int8 model with the embeddings and lm_head int8 too (``INT8_EMBEDDINGS=on``) on the CUDA runner (GPU,
    fp32, decode graphs captured): every greedy step goes through the fused int8 greedy head, and its tokens are
    the reference runner's."""
    spec, model = build(name, torch.float32, "cuda")
    _, reference_model = build(name, torch.float32, "cuda")  # the same weights, through the reference ops table
    quantize_model_int8_(model, embeddings=True)
    quantize_model_int8_(reference_model, embeddings=True)
    assert model.int8_head() is not None
    tap = LogitsTap(model, reference_model)
    script = Script(spec, num_groups(spec), 32, seed=1, prompt_lens=(5, 40))
    n, m = len(script.seqs), script.blocks_per_seq
    reference = ModelRunner(reference_model, spec, storage_for(spec, n, m, torch.float32, "cuda"), torch.device("cuda"))
    options = CudaRunnerOptions(max_model_len=m * BLOCK, max_batch_size=4)
    runner = tap.watch(CudaModelRunner(model, spec, storage_for(spec, n, m, torch.float32, "cuda"),
                                       torch.device("cuda"), options))
    comparison = compare(script, tokens_of(reference), tokens_of(runner), tap, 32)
    assert runner.graph_steps > 0
    assert comparison.agree == comparison.total, comparison.stats()
    assert max(comparison.errors) < 1e-3, comparison.stats()
