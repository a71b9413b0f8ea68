"""Gemma 4's post-norm(s) + residual add (+ scale) (+ up to three next norms) in one Triton launch vs the PyTorch ops.

On CPU under TRITON_INTERPRET=1 in fp32 (equal up to the sum order of the norms: numpy's and torch's reductions
add in another order) and in bf16 (every rounding point is torch's, so bf16 outputs differ from the unfused
PyTorch sequence by at most the rare last bit an fp32 sum-order difference moves across a rounding boundary);
the ``gpu`` tests use the real hidden sizes in bf16.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from tests.kernels.reference_fused import norm_add_reference

from inference_server.kernels.norm_add import norm_add

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# the layer's uses: post-attention norm + add + pre-FFN norm (dense layers); the same with the experts' input norm
# and the router's folded fp32 norm (MoE layers); the MoE tail (two branches, their sum's norm, add, scale, next
# layer's input norm); the dense tail (add, scale, next norm); PLE's first add (no scale, no next norm);
# the bare norm; two branches alone
CASES = {
    "attention": dict(residual=True, out_norms=1),
    "attention_moe": dict(residual=True, out_norms=2, fp32_last=True),
    "moe_tail": dict(b=True, ws=True, residual=True, scale=True, out_norms=1),
    "dense_tail": dict(residual=True, scale=True, out_norms=1),
    "ple_first_add": dict(residual=True),
    "norm_only": {},
    "moe_branches": dict(b=True),
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
    if case.get("ws"):
        args.update(ws=weight(), eps_s=1e-5)
    if case.get("residual"):
        args["residual"] = rows()
    if case.get("scale"):
        args["scale"] = torch.tensor([0.625], dtype=dtype, device=DEV)
    out_norms = [(weight(), 1e-6 * (i + 1)) for i in range(case.get("out_norms", 0))]
    if case.get("fp32_last"):  # the router's folded norm: ``scale * H^-0.5`` kept in fp32
        out_norms.append(((1 + 0.5 * torch.randn(H, generator=gen)).to(DEV) * H ** -0.5, 1e-6))
    args["out_norms"] = out_norms
    return args


def _unfused(args: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The PyTorch sequence the Gemma 4 layer ran before the fusion: ``layers.rms_norm`` (gemma4 style) and
    tensor ops, each rounding to the activation dtype."""
    from inference_server.models.architectures.layers import rms_norm

    y = rms_norm(args["a"], args["wa"], args["eps_a"], "gemma4")
    if "b" in args:
        y = y + rms_norm(args["b"], args["wb"], args["eps_b"], "gemma4")
    if "ws" in args:
        y = rms_norm(y, args["ws"], args["eps_s"], "gemma4")
    if "residual" in args:
        y = args["residual"] + y
    if "scale" in args:
        y = y * args["scale"]
    return y, [rms_norm(y, w, eps, "gemma4").to(y.dtype) for w, eps in args["out_norms"]]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("T", "H", "stride_pad"), [(1, 64, 0), (3, 200, 8)])
def test_matches_the_pytorch_ops_in_fp32(case: str, T: int, H: int, stride_pad: int) -> None:
    args = _make(T, H, torch.float32, seed=T + H, case=CASES[case], stride_pad=stride_pad)
    y, zs = norm_add(**args)
    y_ref, zs_ref = norm_add_reference(**args)
    assert len(zs) == len(zs_ref) == len(args["out_norms"])
    for got, ref in ((y, y_ref), *zip(zs, zs_ref, strict=True)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_reference_is_the_unfused_pytorch_sequence(case: str) -> None:
    """``norm_add_reference`` is, bit for bit, what the layer computed op by op (fp32 and bf16)."""
    for dtype in (torch.float32, torch.bfloat16):
        args = _make(3, 48, dtype, seed=7, case=CASES[case])
        y, zs = norm_add_reference(**args)
        y_old, zs_old = _unfused(args)
        assert torch.equal(y, y_old) and len(zs) == len(zs_old)
        assert all(z.dtype == dtype and torch.equal(z, z_old) for z, z_old in zip(zs, zs_old, strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_is_the_unfused_sequence(case: str) -> None:
    """bf16 at every rounding point: compiled, equal to the unfused ops but for a rare last bit (see the module
    docstring); the interpreter rounds fp32 -> bf16 by truncation (tests/backends/test_triton_add_norm.py), so there
    about half the elements are one ulp off at each rounding point: within a few ulps."""
    args = _make(4, 256, torch.bfloat16, seed=11, case=CASES[case])
    y, zs = norm_add(**args)
    y_old, zs_old = _unfused(args)
    for got, ref in ((y, y_old), *zip(zs, zs_old, strict=True)):
        assert got.dtype == torch.bfloat16
        if torch.cuda.is_available():
            assert (got != ref).float().mean().item() < 0.05
        torch.testing.assert_close(got.float(), ref.float(), atol=2 ** -3, rtol=2 ** -6)


def test_rejects_mismatched_inputs() -> None:
    args = _make(2, 32, torch.float32, seed=0, case=CASES["attention"])
    with pytest.raises(ValueError, match="residual"):
        norm_add(**{**args, "residual": args["residual"][:1]})
    with pytest.raises(ValueError, match=r"out_norms\[0\]"):
        norm_add(**{**args, "out_norms": [(args["wa"][:16], 1e-6)]})
    with pytest.raises(ValueError, match="at most 3"):
        norm_add(**{**args, "out_norms": [(args["wa"], 1e-6)] * 4})
    with pytest.raises(ValueError, match="ws"):
        norm_add(**{**args, "ws": args["wa"].half()})
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
    y, zs = norm_add(**args)
    y_ref, zs_ref = norm_add_reference(**args)
    assert len(zs) == len(zs_ref) == len(args["out_norms"])
    for got, ref in ((y, y_ref), *zip(zs, zs_ref, strict=True)):
        assert got.dtype == torch.bfloat16
        assert (got != ref).float().mean().item() < 0.05
        torch.testing.assert_close(got.float(), ref.float(), atol=2 ** -3, rtol=2 ** -6)  # one ulp at |x| < 16
