"""The RoPE tables in one launch (``kernels.rope_tables``) against ``layers.rope_cos_sin``, the seven PyTorch kernels
they replace: at the real layer types' inverse frequencies (Gemma 4 sliding and proportional full, Qwen3-MoE) and
positions up to a long context.

On the GPU both compute ``float(position) * inv_freq`` in fp32 and take CUDA's ``cosf`` / ``sinf`` (libdevice in the
kernel, the same functions in PyTorch's elementwise kernels), so the tables must be equal bit for bit. Under the
interpreter the kernel takes NumPy's cos and sin, which may differ from PyTorch's CPU ones in the last fp32 bit:
there the tables agree within one rounding.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.backends.cuda.norm_ops import triton_rope_cos_sin
from inference_server.kernels.rope_tables import rope_tables
from inference_server.models.architectures.layers import rope_cos_sin, rope_inv_freq
from inference_server.models.spec import RopeSpec

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEV == "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROPES = {
    "gemma4 sliding": RopeSpec(theta=10_000.0, head_dim=256),
    "gemma4 full (proportional)": RopeSpec(theta=1_000_000.0, head_dim=512, partial_factor=0.25),
    "qwen3-moe": RopeSpec(theta=1_000_000.0, head_dim=128),
    "odd half (tiny)": RopeSpec(theta=10_000.0, head_dim=24),
}


def _check(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == dtype and g.shape == w.shape and g.is_contiguous()
        if INTERPRETED:
            tol = 1e-6 if dtype == torch.float32 else 8e-3  # one fp32 ulp of the angle's cos, or one bf16 rounding
            torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=tol)
        else:
            assert torch.equal(g, w)


@pytest.mark.parametrize("name", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_tables_match_the_reference(name: str, dtype: torch.dtype) -> None:
    inv_freq = rope_inv_freq(ROPES[name]).to(DEV)
    positions = torch.tensor([0, 1, 2, 527, 4095, 32767], dtype=torch.int64, device=DEV)
    got = rope_tables(positions, inv_freq, dtype)
    _check(got, rope_cos_sin(inv_freq, positions, dtype), dtype)
    # the halves hold the same angles (NeoX layout) and frequency-0 pairs give cos 1, sin 0
    half = inv_freq.shape[0]
    assert torch.equal(got[0][:, :half], got[0][:, half:]) and torch.equal(got[1][:, :half], got[1][:, half:])
    zero = inv_freq == 0
    assert bool((got[0][:, :half][:, zero] == 1).all()) and bool((got[1][:, :half][:, zero] == 0).all())


def test_rope_tables_take_int32_positions_and_no_tokens() -> None:
    inv_freq = rope_inv_freq(ROPES["qwen3-moe"]).to(DEV)
    positions = torch.arange(0, 40, 3, dtype=torch.int32, device=DEV)
    _check(rope_tables(positions, inv_freq, torch.bfloat16), rope_cos_sin(inv_freq, positions, torch.bfloat16),
           torch.bfloat16)
    cos, sin = rope_tables(positions[:0], inv_freq, torch.bfloat16)
    assert cos.shape == sin.shape == (0, 128)


def test_backend_op_falls_back_where_the_kernel_does_not_apply() -> None:
    inv_freq = rope_inv_freq(ROPES["gemma4 sliding"]).to(DEV)
    positions = torch.tensor([5, 9], device=DEV)
    # float64 inverse frequencies: the reference (which casts them to fp32 itself)
    fallback = triton_rope_cos_sin(inv_freq.double(), positions, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(fallback, rope_cos_sin(inv_freq.double(), positions, torch.bfloat16),
                                                  strict=True))
    with pytest.raises(ValueError, match="integers"):
        rope_tables(positions.float(), inv_freq, torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_tables_bitwise_on_gpu_over_a_long_context(name: str) -> None:
    inv_freq = rope_inv_freq(ROPES[name]).to(DEV)
    positions = torch.arange(0, 131072, 7, device=DEV)
    for dtype in (torch.bfloat16, torch.float32):
        _check(rope_tables(positions, inv_freq, dtype), rope_cos_sin(inv_freq, positions, dtype), dtype)
