"""Gemma 4's post-norm + residual add (+ scale) (+ next norm) in one Triton launch vs the PyTorch ops.

On CPU under TRITON_INTERPRET=1 in fp32 (bitwise up to the sum order of the norms); the ``gpu`` tests use the
real hidden sizes in bf16.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.kernels.norm_add import norm_add, norm_add_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# the layer's uses: post-attention norm + add + pre-FFN norm; two MoE branches; post-FFN norm + add + scale;
# the bare norm
CASES = {
    "attention": dict(residual=True, wz=True),
    "moe_branches": dict(b=True),
    "ffn_scaled": dict(residual=True, scale=True),
    "ple_scaled_next_norm": dict(residual=True, scale=True, wz=True),
    "norm_only": {},
}


def _make(T: int, H: int, dtype: torch.dtype, seed: int, case: dict, stride_pad: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def rows() -> torch.Tensor:  # [T, H] with a row stride of H + stride_pad (views of a wider buffer)
        return (torch.randn(T, H + stride_pad, generator=gen) * 3).to(DEV, dtype)[:, :H]

    def weight() -> torch.Tensor:
        return (1 + 0.5 * torch.randn(H, generator=gen)).to(DEV, dtype)

    args: dict = dict(a=rows(), wa=weight(), eps_a=1e-6)
    if case.get("b"):
        args.update(b=rows(), wb=weight(), eps_b=1e-6)
    if case.get("residual"):
        args["residual"] = rows()
    if case.get("scale"):
        args["scale"] = torch.tensor([0.625], dtype=dtype, device=DEV)
    if case.get("wz"):
        args.update(wz=weight(), eps_z=1e-6)
    return args


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("T", "H", "stride_pad"), [(1, 64, 0), (3, 200, 8)])
def test_matches_the_pytorch_ops_in_fp32(case: str, T: int, H: int, stride_pad: int) -> None:
    args = _make(T, H, torch.float32, seed=T + H, case=CASES[case], stride_pad=stride_pad)
    y, z = norm_add(**args)
    y_ref, z_ref = norm_add_reference(**args)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    if z_ref is None:
        assert z is None
    else:
        assert z is not None
        torch.testing.assert_close(z, z_ref, atol=1e-5, rtol=1e-5)


def test_rejects_mismatched_inputs() -> None:
    args = _make(2, 32, torch.float32, seed=0, case=CASES["attention"])
    with pytest.raises(ValueError, match="residual"):
        norm_add(**{**args, "residual": args["residual"][:1]})
    with pytest.raises(ValueError, match="wz"):
        norm_add(**{**args, "wz": args["wz"][:16]})
    with pytest.raises(ValueError, match="b and wb"):
        norm_add(**{**args, "b": args["a"]})
    with pytest.raises(ValueError, match="scale"):
        norm_add(**{**args, "scale": torch.ones(2)})


@gpu
@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("T", [1, 64, 2048])
@pytest.mark.parametrize("H", [2816, 5376, 2560])  # 26B-A4B, 31B, E4B
def test_real_sizes_bf16_on_gpu(case: str, T: int, H: int) -> None:
    """Each rounding point is PyTorch's; the norms' sums are ordered differently, which moves a rare last bit."""
    args = _make(T, H, torch.bfloat16, seed=T, case=CASES[case])
    y, z = norm_add(**args)
    y_ref, z_ref = norm_add_reference(**args)
    for got, ref in ((y, y_ref), (z, z_ref)):
        if ref is None:
            continue
        assert got is not None
        assert (got != ref).float().mean().item() < 0.05
        torch.testing.assert_close(got.float(), ref.float(), atol=2 ** -3, rtol=2 ** -6)  # one ulp at |x| < 16
