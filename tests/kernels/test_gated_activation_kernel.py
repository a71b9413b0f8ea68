"""``act(gate) * up`` in one Triton launch vs PyTorch's two kernels (each rounding to the activation dtype).

On CPU under TRITON_INTERPRET=1 at small widths (fp32 inputs: the interpreter truncates fp32 -> bf16 casts, so
bf16 is compared within one bf16 ulp there); the ``gpu`` tests use Gemma 4's real MLP widths in bf16.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.kernels.gated_activation import gated_activation

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _reference(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    activated = F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)
    return activated * up


def _halves(T: int, width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as the two halves of one [T, 2I] GEMM output (strided rows), values in the range MLPs see."""
    gen = torch.Generator().manual_seed(seed)
    fused = (torch.randn(T, 2 * width, generator=gen) * 3).to(DEV, dtype)
    gate, up = fused.chunk(2, dim=-1)
    return gate, up


@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "width"), [(1, 48), (3, 130), (2, 2048)])
def test_matches_pytorch(T: int, width: int, dtype: torch.dtype, act: str) -> None:
    gate, up = _halves(T, width, dtype, seed=T + width)
    out = gated_activation(gate, up, act)
    ref = _reference(gate, up, act)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # two roundings, each at most one bf16 ulp away (the interpreter truncates instead of rounding)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=2 ** -6)


def test_extremes_saturate_like_pytorch() -> None:
    gate = torch.tensor([[-60.0, -20.0, -3.0, 0.0, 3.0, 20.0, 60.0]], device=DEV)
    up = torch.ones_like(gate)
    for act in ("gelu_tanh", "silu"):
        torch.testing.assert_close(gated_activation(gate, up, act), _reference(gate, up, act), atol=1e-5, rtol=1e-5)


def test_rejects_what_it_does_not_compute() -> None:
    gate, up = _halves(2, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="supports"):
        gated_activation(gate, up, "relu")
    with pytest.raises(ValueError, match="one dtype"):
        gated_activation(gate, up.double(), "silu")


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 64, 2048])
@pytest.mark.parametrize("width", [2112, 10240, 21504])
def test_real_widths_bf16_on_gpu(T: int, width: int) -> None:
    gate, up = _halves(T, width, torch.bfloat16, seed=T)
    out, ref = gated_activation(gate, up, "gelu_tanh"), _reference(gate, up, "gelu_tanh")
    mismatched = (out != ref).float().mean().item()
    assert mismatched < 1e-3, mismatched  # both roundings kept: the rare difference is a last-bit tanh tie
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=2 ** -7)


def test_cuda_runner_op_takes_hf_names_and_falls_back_where_the_kernel_does_not_apply() -> None:
    from inference_server.backends.cuda.projection_ops import triton_gated_activation
    from inference_server.models.architectures.ops import torch_gated_activation

    gate, up = _halves(2, 40, torch.float32, seed=5)
    for name in ("gelu_pytorch_tanh", "silu", "gelu"):  # exact-erf gelu has no kernel: the reference runs
        torch.testing.assert_close(triton_gated_activation(gate, up, name), torch_gated_activation(gate, up, name),
                                   atol=1e-5, rtol=1e-5)
    strided = torch.randn(2, 40, 2, device=DEV)[..., 0]  # last dim not contiguous: the reference runs
    expected = torch_gated_activation(strided, up, "silu")
    torch.testing.assert_close(triton_gated_activation(strided, up, "silu"), expected)
