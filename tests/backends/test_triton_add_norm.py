"""The CUDA runner's ``Ops.add_rms_norm`` fusion (``norm_ops.triton_add_rms_norm``) against the reference op.

On CPU the kernel runs in the Triton interpreter (tests/conftest.py), which rounds fp32 -> bf16 by truncation:
bf16 is compared within one bf16 ulp there, bitwise on the GPU (the add is fp32 rounded to nearest, as torch).
"""

from __future__ import annotations

import pytest
import torch

from inference_server.backends.cuda.norm_ops import triton_add_rms_norm
from inference_server.backends.cuda.options import CudaRunnerOptions
from inference_server.backends.cuda.runner import CudaModelRunner
from inference_server.backends.paged_kv import PagedKVStorage, group_of
from inference_server.models.architectures.ops import REFERENCE_OPS, Fusions, Ops
from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import NormStyle, parse_model_spec

DEV = "cuda" if torch.cuda.is_available() else "cpu"
_TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def inputs(T: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(T * 100 + D)
    x = (torch.randn(T, D, generator=gen) * 3).to(DEV, dtype)
    residual = torch.randn(T, D, generator=gen).to(DEV, dtype)
    weight = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV, dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("style", "with_weight"), [("gemma4", True), ("gemma4", False), ("qwen", True)])
@pytest.mark.parametrize(("T", "D"), [(1, 64), (7, 48)])
def test_triton_op_matches_reference(T: int, D: int, style: NormStyle, with_weight: bool,
                                     dtype: torch.dtype) -> None:
    x, residual, w = inputs(T, D, dtype)
    weight = w if with_weight else None
    fused = triton_add_rms_norm(x, residual, weight, 1e-6, style)
    assert fused is not None
    normed, new_residual = fused
    ref_normed, ref_residual = REFERENCE_OPS.add_rms_norm(x, residual, weight, 1e-6, style)
    assert normed.dtype == ref_normed.dtype and new_residual.dtype == dtype
    if dtype == torch.float32 or DEV == "cuda":
        assert torch.equal(new_residual, ref_residual)
    else:
        torch.testing.assert_close(new_residual, ref_residual, **_TOL[dtype])
    torch.testing.assert_close(normed, ref_normed, **_TOL[dtype])


def test_gemma3_style_and_strided_rows_take_the_reference() -> None:
    """No kernel for gemma3's (1 + w) norm, and the kernel wants a contiguous last dim: the fusion declines both,
    and a table with it gives the reference op's exact values."""
    x, residual, w = inputs(6, 32, torch.float32)
    table = Ops(fusions=Fusions(add_rms_norm=triton_add_rms_norm))
    for args in [(x, residual, w, 1e-6, "gemma3"), (x.t(), residual.t(), w[:6], 1e-6, "gemma4")]:
        assert triton_add_rms_norm(*args) is None  # type: ignore[arg-type]
        normed, new_residual = table.add_rms_norm(*args)  # type: ignore[arg-type]
        ref_normed, ref_residual = REFERENCE_OPS.add_rms_norm(*args)  # type: ignore[arg-type]
        assert torch.equal(normed, ref_normed) and torch.equal(new_residual, ref_residual)


@pytest.mark.parametrize(("options", "expected"), [
    (dict(), triton_add_rms_norm),
    (dict(reference_ops=True), None),
])
def test_runner_binds_the_table_its_options_ask_for(options: dict, expected: object) -> None:
    spec = parse_model_spec(preset_config("qwen3-30b-a3b-tiny"))
    model = build_model(spec, torch.float32, DEV)
    init_dummy_weights(model)
    groups = {group_of(layer) for layer in spec.cache_layers}
    storage = PagedKVStorage(spec.cache_layers, dict.fromkeys(groups, 4), 16, torch.float32, DEV)
    runner = CudaModelRunner(model, spec, storage, torch.device(DEV),
                             CudaRunnerOptions(max_model_len=32, max_batch_size=2, cuda_graphs=False, **options))
    assert runner.ops.fusions.add_rms_norm is expected
    assert model.ops is runner.ops and model.model.layers[0].post_attention_layernorm.ops is runner.ops
    assert REFERENCE_OPS.fusions.add_rms_norm is None  # the reference table is left as it was
