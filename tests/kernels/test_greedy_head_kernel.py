"""The fused greedy head (``kernels.greedy_head``) against its PyTorch reference (``compute_logits`` + the
sampler's greedy choice, ``kernels.reference_greedy_head``).

CPU: the Triton interpreter at small shapes (vocabularies that are not a multiple of the 64-row slice, hidden
sizes that are not a multiple of the K tile, one and two row blocks), fp32 and bf16, soft-cap on and off, float
heads and int8 heads (``reference_int8``'s format, scales in the activation dtype; the reference is
``int8_linear_reference``). GPU (``gpu``): the real vocabulary x hidden shapes of Qwen3-30B-A3B and Gemma 4 in bf16
at N = 1, 16, 64, and Gemma-4-31B's head in int8 at N = 1 and 16 (also against the unfused path's
``kernels.int8_linear``).

Tolerances. Tokens: equal to the reference's argmax on every row whose two best reference logits are more than
one ulp apart (bf16: one bf16 ulp of the best logit; fp32: 1e-5 relative), because the kernel's fp32 sums
differ from the reference GEMM's in summation order only, which can move a logit across one rounding boundary;
on the excluded rows the chosen token's reference logit must be within that ulp of the maximum. With
integer-valued inputs every sum is exact, so there every row must match, ties included (the first index).
Logprobs: within 1e-4 plus one ulp of the best logit (a best logit rounded the other way moves the logprob by
up to that ulp), and the median within 2e-5.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs
import pytest
import torch
from tests.kernels.reference_greedy_head import greedy_head_reference, logits_reference

from inference_server.kernels.greedy_head import (
    MAX_ROWS,
    greedy_head,
    greedy_head_config,
    greedy_head_supports,
)
from inference_server.kernels.reference_int8 import quantize_int8_per_channel

from .rounding import assert_gpu_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of |x| in ``dtype`` (fp32 tensors returned): bf16 spacing, or 1e-5 relative for fp32."""
    if dtype == torch.float32:
        return x.abs() * 1e-5 + 1e-30
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0 ** -126)))
    return torch.exp2(exponent - 7)


def check_against_reference(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None,
                            ids: torch.Tensor, logprobs: torch.Tensor, exact: bool = False,
                            scale: torch.Tensor | None = None) -> int:
    """Assert the module docstring's tolerances; returns how many rows were held to exact token equality.
    ``scale``: an int8 head."""
    ref_ids, ref_logprobs = greedy_head_reference(hidden, weight, softcap, scale)
    logits = logits_reference(hidden, weight, softcap, scale).float()
    top2 = logits.topk(2, dim=-1).values
    spacing = ulp(top2[:, 0], hidden.dtype)
    near_tie = (top2[:, 0] - top2[:, 1]) <= spacing
    if exact:
        near_tie = torch.zeros_like(near_tie)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert ids.shape == logprobs.shape == (hidden.shape[0],)
    clear = ~near_tie
    assert torch.equal(ids[clear], ref_ids[clear]), (ids[clear], ref_ids[clear])
    chosen = logits.gather(1, ids[:, None]).squeeze(1)
    assert bool(((top2[:, 0] - chosen) <= spacing).all())
    error = (logprobs - ref_logprobs).abs()
    assert bool((error <= 1e-4 + (0.0 if exact else 1.0) * spacing).all()), (error.max(), spacing)
    assert float(error.median()) <= 2e-5, error
    return int(clear.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize(("rows", "vocab", "hidden_size"), [(1, 300, 64), (5, 333, 96), (17, 130, 256),
                                                           (70, 200, 32)])
def test_matches_reference(rows: int, vocab: int, hidden_size: int, softcap: float | None,
                           dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + vocab)
    hidden = torch.randn(rows, hidden_size, generator=gen).to(DEV, dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 4 / math.sqrt(hidden_size)).to(DEV, dtype)
    ids, logprobs = greedy_head(hidden, weight, softcap)
    assert check_against_reference(hidden, weight, softcap, ids, logprobs) >= rows // 2  # most rows exact


def int8_head(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight [V, H] int8, scale [V] in dtype)`` of a float head, as ``Int8Embedding`` / ``Int8Linear`` hold it."""
    return quantize_int8_per_channel(weight.float(), scale_dtype=dtype)


INT8_SHAPES = [(1, 300, 64), (5, 333, 96), (17, 130, 256), (3, 200, 320), (70, 200, 32)]
"""(rows, vocab, hidden): ragged vocabularies; hidden sizes below, at, past (320: a masked second K tile) the int8
tile's 256 columns; one and two row blocks."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize(("rows", "vocab", "hidden_size"), INT8_SHAPES)
def test_int8_head_matches_reference(rows: int, vocab: int, hidden_size: int, softcap: float | None,
                                     dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + vocab + 1)
    hidden = torch.randn(rows, hidden_size, generator=gen).to(DEV, dtype)
    qweight, scale = int8_head(torch.randn(vocab, hidden_size, generator=gen) * 4 / math.sqrt(hidden_size), dtype)
    qweight, scale = qweight.to(DEV), scale.to(DEV)
    assert greedy_head_supports(hidden, qweight, scale) == (rows <= MAX_ROWS)
    ids, logprobs = greedy_head(hidden, qweight, softcap, scale=scale)
    assert check_against_reference(hidden, qweight, softcap, ids, logprobs, scale=scale) >= rows // 2


@pytest.mark.parametrize("magic_dequant", [False, True])
def test_int8_dequantisation_paths_agree(magic_dequant: bool) -> None:
    """Both ways of turning int8 tiles into floats (the conversion, the exponent trick) give the same bits."""
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(4, 128, generator=gen).to(DEV, torch.bfloat16)
    qweight, scale = int8_head(torch.randn(150, 128, generator=gen), torch.bfloat16)
    qweight, scale = qweight.to(DEV), scale.to(DEV)
    config = attrs.evolve(greedy_head_config(4, 1), magic_dequant=magic_dequant)
    ids, logprobs = greedy_head(hidden, qweight, 30.0, config, scale=scale)
    check_against_reference(hidden, qweight, 30.0, ids, logprobs, scale=scale)
    other = greedy_head(hidden, qweight, 30.0, attrs.evolve(config, magic_dequant=not magic_dequant), scale=scale)
    assert torch.equal(ids, other[0]) and torch.equal(logprobs, other[1])


@pytest.mark.parametrize("head", ["float", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_ties_take_the_first_index(dtype: torch.dtype, softcap: float | None, head: str) -> None:
    """Integer-valued inputs (exact sums in any order, exact in bf16): every row's maximum is reached at
    several vocabulary indices, in different 64-row slices, and the kernel returns the first, as
    ``torch.argmax``. An int8 head of such rows holds them as +-127 with one scale, identical on tied rows."""
    rows, vocab, hidden_size = 6, 400, 48
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randint(-1, 2, (rows, hidden_size), generator=gen).float()
    weight = torch.randint(-1, 2, (vocab, hidden_size), generator=gen).float()
    # Row r's best direction sign(hidden[r]) is planted at three indices in different slices; the first of
    # them comes after the first slice for some rows, so the winner is not always in slice 0.
    for r in range(rows):
        for index in (70 + 20 * r, 150 + 13 * r, vocab - 1 - r):
            weight[index] = hidden[r].sign()
    scale = None
    if head == "int8":
        weight, scale = int8_head(weight, dtype)
        scale = scale.to(DEV)
    hidden, weight = hidden.to(DEV, dtype), weight.to(DEV, weight.dtype if scale is not None else dtype)
    logits = logits_reference(hidden, weight, softcap, scale).float()
    best = logits.max(dim=-1, keepdim=True).values
    holders = [torch.nonzero(logits[r] == best[r]).flatten() for r in range(rows)]
    assert all(len({int(i) // 64 for i in h}) >= 2 for h in holders)  # ties across slices, every row
    ids, logprobs = greedy_head(hidden, weight, softcap, scale=scale)
    check_against_reference(hidden, weight, softcap, ids, logprobs, exact=True, scale=scale)
    assert ids.tolist() == [int(h[0]) for h in holders]


def test_same_inputs_same_bits() -> None:
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 64, generator=gen).to(DEV, torch.bfloat16)
    weight = torch.randn(257, 64, generator=gen).to(DEV, torch.bfloat16)
    first, second = greedy_head(hidden, weight, 30.0), greedy_head(hidden, weight, 30.0)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_supports_and_rejects() -> None:
    hidden = torch.zeros(2, 32, dtype=torch.bfloat16)
    weight = torch.zeros(100, 32, dtype=torch.bfloat16)
    assert greedy_head_supports(hidden, weight)
    assert greedy_head_supports(torch.zeros(MAX_ROWS, 32, dtype=torch.bfloat16), weight)
    assert not greedy_head_supports(torch.zeros(MAX_ROWS + 1, 32, dtype=torch.bfloat16), weight)
    assert not greedy_head_supports(hidden.half(), weight.half())
    assert not greedy_head_supports(hidden.float(), weight)
    assert not greedy_head_supports(torch.zeros(32, 2, dtype=torch.bfloat16).t(), weight)
    assert not greedy_head_supports(hidden, weight[:, :16])
    with pytest.raises(ValueError, match="must be bf16 or fp32"):
        greedy_head(hidden.half(), weight.half(), None)
    with pytest.raises(ValueError, match="both bf16 or both fp32"):
        greedy_head(hidden, weight.float(), None)
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        greedy_head(hidden, weight[:, :16], None)
    ids, logprobs = greedy_head(hidden[:0], weight, None)
    assert ids.shape == logprobs.shape == (0,)
    qweight, scale = torch.zeros(100, 32, dtype=torch.int8), torch.ones(100, dtype=torch.bfloat16)
    assert greedy_head_supports(hidden, qweight, scale)
    assert greedy_head_supports(hidden.float(), qweight, scale)  # fp32 activations (the CPU's int8 model)
    assert not greedy_head_supports(hidden, qweight)  # int8 without its scale
    assert not greedy_head_supports(hidden, weight, scale[:100])  # a scale with a float weight
    assert not greedy_head_supports(hidden, qweight, scale[:99])
    assert not greedy_head_supports(hidden, qweight, torch.ones(100, dtype=torch.int32))
    assert not greedy_head_supports(hidden.half(), qweight, scale)
    with pytest.raises(ValueError, match="scale must be a float"):
        greedy_head(hidden, qweight, None, scale=scale[:50])
    with pytest.raises(ValueError, match="int8 weight"):
        greedy_head(hidden, weight, None, scale=scale)


# ------------------------------------------------------------------------------------------- GPU tests


@pytest.fixture
def exact_reference_gemm() -> Iterator[None]:
    """The reference GEMM with one rounding per logit: cuBLAS may otherwise reduce split-K partial sums in bf16
    (PyTorch's default), a second rounding that ``compute_logits``' contract (fp32 sums rounded once) does not
    have and that would move the reference, not the kernel, by an ulp more. (fp32: TF32 is off by default.)"""
    matmul = torch.backends.cuda.matmul
    previous = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    yield
    matmul.allow_bf16_reduced_precision_reduction = previous


REAL_HEADS = [  # (model, vocab, hidden, final soft-cap)
    ("qwen3-30b-a3b", 151936, 2048, None),
    ("gemma-4-e4b", 262144, 2560, 30.0),
    ("gemma-4-26b-a4b", 262144, 2816, 30.0),
    ("gemma-4-31b", 262144, 5376, 30.0),
]


def real_head(vocab: int, hidden_size: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random head and final hidden rows scaled so the logits spread like a model's (std ~3)."""
    gen = torch.Generator(device="cuda").manual_seed(vocab + hidden_size + rows)
    weight = (torch.randn(vocab, hidden_size, generator=gen, device="cuda") / math.sqrt(hidden_size)).to(dtype)
    hidden = (torch.randn(rows, hidden_size, generator=gen, device="cuda") * 3).to(dtype)
    return hidden, weight


@gpu
@pytest.mark.parametrize(("model", "vocab", "hidden_size", "softcap"), REAL_HEADS, ids=[h[0] for h in REAL_HEADS])
def test_real_shapes_bf16(model: str, vocab: int, hidden_size: int, softcap: float | None,
                          exact_reference_gemm: None) -> None:
    held = 0
    for rows in (1, 16, 64):
        hidden, weight = real_head(vocab, hidden_size, rows, torch.bfloat16)
        ids, logprobs = greedy_head(hidden, weight, softcap)
        held += check_against_reference(hidden, weight, softcap, ids, logprobs)
        again = greedy_head(hidden, weight, softcap)
        assert torch.equal(ids, again[0]) and torch.equal(logprobs, again[1])  # deterministic
        del weight
    assert held >= 0.8 * (1 + 16 + 64)


@gpu
def test_real_shape_fp32(exact_reference_gemm: None) -> None:
    hidden, weight = real_head(151936, 2048, 16, torch.float32)
    ids, logprobs = greedy_head(hidden, weight, 30.0)
    assert check_against_reference(hidden, weight, 30.0, ids, logprobs) >= 14


@gpu
@pytest.mark.parametrize("head", ["bf16", "int8"])
def test_captured_in_a_cuda_graph(head: str) -> None:
    """Inside a CUDA graph (fresh inputs copied into the captured buffers), replay gives the eager result."""
    hidden, weight = real_head(262144, 2816, 8, torch.bfloat16)
    scale = None
    if head == "int8":
        weight, scale = int8_head(weight, torch.bfloat16)
    static = hidden.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        greedy_head(static, weight, 30.0, scale=scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, logprobs = greedy_head(static, weight, 30.0, scale=scale)
    fresh = hidden.flip(0).contiguous()
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    eager_ids, eager_logprobs = greedy_head(fresh, weight, 30.0, scale=scale)
    assert torch.equal(ids, eager_ids) and torch.equal(logprobs, eager_logprobs)


@gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_real_shape_int8_gemma_4_31b(rows: int) -> None:
    """Gemma-4-31B's tied head in int8 (262144 x 5376, bf16 scales, soft-cap 30): the reference's tokens and
    logprobs within the module docstring's tolerances, bitwise repeatable, and the tokens of the unfused path the
    runner takes without the fused head (``kernels.int8_linear``, the soft-cap, ``argmax``) wherever its top two
    logits are more than one bf16 ulp apart."""
    from inference_server.kernels.int8_linear import int8_linear
    from inference_server.models.architectures.layers import softcap as apply_softcap

    hidden, weight = real_head(262144, 5376, rows, torch.bfloat16)
    qweight, scale = int8_head(weight, torch.bfloat16)
    del weight
    ids, logprobs = greedy_head(hidden, qweight, 30.0, scale=scale)
    # soft-capped bf16 logits near the cap are 1/8 apart: near ties (held to the looser bound) are common here
    assert check_against_reference(hidden, qweight, 30.0, ids, logprobs, scale=scale) >= max(1, rows // 2)
    again = greedy_head(hidden, qweight, 30.0, scale=scale)
    assert torch.equal(ids, again[0]) and torch.equal(logprobs, again[1])
    unfused = apply_softcap(int8_linear(hidden, qweight, scale), 30.0).float()
    top2 = unfused.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > ulp(top2[:, 0], torch.bfloat16)
    assert torch.equal(ids[clear], unfused.argmax(dim=-1)[clear])


@gpu
@pytest.mark.parametrize("tokens", [1, 2, 16, 100])
def test_unfused_int8_head_logits_at_gemma_4_31b(tokens: int) -> None:
    """The unfused path of an int8 head (sampling, logprobs, prompt logits: ``kernels.int8_linear`` on the
    262144 x 5376 head, no tuned config file: the heuristic's GEMV at 1-2 tokens, tensor-core tiles above) gives
    the reference's logits within one bf16 ulp plus summation-order noise."""
    from inference_server.kernels.int8_linear import int8_linear
    from inference_server.kernels.reference_int8 import int8_linear_reference

    hidden, weight = real_head(262144, 5376, tokens, torch.bfloat16)
    qweight, scale = int8_head(weight, torch.bfloat16)
    del weight
    assert_gpu_close(int8_linear(hidden, qweight, scale), int8_linear_reference(hidden, qweight, scale))
