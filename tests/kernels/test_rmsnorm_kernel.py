"""Fused (residual +) RMSNorm: Triton kernel vs the PyTorch reference, both conventions.

On CPU the kernel runs under TRITON_INTERPRET=1 (which rounds fp32 -> bf16 by truncation: bf16 is
compared to within one bf16 ulp); the ``gpu`` tests use real hidden and head sizes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from tests.kernels.reference_norm import rmsnorm_reference

from inference_server.kernels.rmsnorm import fused_add_rmsnorm, rms_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def _inputs(T: int, D: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=gen) * 3).to(DEV, dtype)
    res = torch.randn(T, D, generator=gen).to(DEV, dtype)
    w = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV, dtype)
    return x, res, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("mode", ["gemma", "qwen"])
@pytest.mark.parametrize(("T", "D"), [(1, 64), (7, 48)])
def test_fused_add_rmsnorm_matches_reference(
    T: int, D: int, mode: str, with_residual: bool, with_weight: bool, dtype: torch.dtype
) -> None:
    x, res, w = _inputs(T, D, dtype, seed=T + D)
    residual = res if with_residual else None
    weight = w if with_weight else None
    y, new_res = fused_add_rmsnorm(x, residual, weight, 1e-6, mode)
    y_ref, res_ref = rmsnorm_reference(x, residual, weight, 1e-6, mode)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, **_TOL[dtype])
    if with_residual:
        torch.testing.assert_close(new_res, res_ref, **_TOL[dtype])
    else:
        assert new_res is x


def test_qwen_mode_with_fp32_weight_promotes() -> None:
    x, res, _ = _inputs(5, 32, torch.bfloat16)
    w32 = torch.linspace(0.5, 1.5, 32, device=DEV)
    y, _ = fused_add_rmsnorm(x, res, w32, 1e-6, "qwen")
    y_ref, _ = rmsnorm_reference(x, res, w32, 1e-6, "qwen")
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("mode", ["gemma", "qwen"])
def test_per_head_norm_on_strided_qkv_view(mode: str) -> None:
    T, nH, nKV, D = 3, 4, 2, 32
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(T, (nH + 2 * nKV) * D, generator=gen).to(DEV)  # fused projection output
    q = qkv[:, : nH * D].view(T, nH, D)  # [T, nH, D], token stride (nH + 2 nKV) * D
    k = qkv[:, nH * D : (nH + nKV) * D].view(T, nKV, D)
    wq = torch.rand(D, generator=gen).to(DEV) + 0.5
    expected_q = rmsnorm_reference(q, None, wq, 1e-6, mode)[0]
    expected_k = rmsnorm_reference(k, None, None, 1e-6, mode)[0]
    torch.testing.assert_close(rms_norm(q, wq, 1e-6, mode), expected_q, atol=2e-6, rtol=2e-6)
    v_before = qkv[:, (nH + nKV) * D :].clone()
    rms_norm(k, None, 1e-6, mode, out=k)  # in place inside the qkv buffer
    torch.testing.assert_close(k, expected_k, atol=2e-6, rtol=2e-6)
    assert torch.equal(qkv[:, (nH + nKV) * D :], v_before)


def test_in_place_residual_update_and_1d_input() -> None:
    x, res, w = _inputs(4, 64, torch.float32, seed=9)
    y_ref, res_ref = rmsnorm_reference(x, res, w, 1e-5, "gemma")
    y, new_res = fused_add_rmsnorm(x, res, w, 1e-5, "gemma", residual_out=res)
    assert new_res is res
    torch.testing.assert_close(res, res_ref, atol=0, rtol=0)
    torch.testing.assert_close(y, y_ref, atol=2e-6, rtol=2e-6)
    v = x[0]  # [D]
    torch.testing.assert_close(
        rms_norm(v, None, 1e-6, "gemma"), rmsnorm_reference(v, None, None, 1e-6, "gemma")[0]
    )


def test_rejects_bad_arguments() -> None:
    x, res, w = _inputs(2, 32, torch.float32)
    with pytest.raises(ValueError):
        fused_add_rmsnorm(x, res, w[:16], 1e-6, "gemma")
    with pytest.raises(ValueError):
        fused_add_rmsnorm(x, res.bfloat16(), w, 1e-6, "gemma")
    with pytest.raises(ValueError):
        fused_add_rmsnorm(x, res, w, 1e-6, "llama")  # type: ignore[arg-type]


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16, 256, 2048])
@pytest.mark.parametrize("H", [2048, 2816, 5376])
@pytest.mark.parametrize("mode", ["gemma", "qwen"])
def test_fused_add_rmsnorm_gpu_real_shapes(mode: str, H: int, T: int) -> None:
    x, res, w = _inputs(T, H, torch.bfloat16, seed=H + T)
    y, new_res = fused_add_rmsnorm(x, res, w, 1e-6, mode)
    y_ref, res_ref = rmsnorm_reference(x, res, w, 1e-6, mode)
    assert torch.equal(new_res, res_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1.6e-2)
    assert (y.float() != y_ref.float()).float().mean() < 0.01  # at most rare 1-ulp flips


@gpu
@needs_cuda
@pytest.mark.parametrize(("heads", "D"), [(32, 128), (16, 256), (2, 512)])
def test_per_head_norm_gpu(heads: int, D: int) -> None:
    gen = torch.Generator().manual_seed(D)
    qkv = torch.randn(256, 2 * heads * D, generator=gen).to("cuda", torch.bfloat16)
    q = qkv[:, : heads * D].view(256, heads, D)
    w = (1 + 0.3 * torch.randn(D, generator=gen)).to("cuda", torch.bfloat16)
    for mode in ("gemma", "qwen"):
        torch.testing.assert_close(
            rms_norm(q, w, 1e-6, mode), rmsnorm_reference(q, None, w, 1e-6, mode)[0], atol=1e-2, rtol=1.6e-2
        )
