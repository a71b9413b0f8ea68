"""The decode MoE GEMVs (``kernels.moe_decode``) against the PyTorch reference, and against the grouped ``fused_moe``.

On CPU the kernels run under TRITON_INTERPRET=1 at tiny shapes (the interpreter rounds fp32 -> bf16 by
truncation, so bf16 tolerances are those of the grouped kernel's tests); the ``gpu`` tests use the real
Qwen3-30B-A3B and Gemma-4-26B-A4B expert shapes.
"""

import os
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from tests.kernels.reference_moe import fused_moe_reference

from inference_server.kernels import moe_decode
from inference_server.kernels.fused_moe import fused_moe
from inference_server.kernels.moe_decode import MoeDecodeConfig, fused_moe_decode, moe_decode_config
from inference_server.kernels.reference_int8 import quantize_int8_per_channel
from inference_server.kernels.reference_moe import route_softmax_topk

from .test_kernels_compile_for_h200 import _compile_in_child
from .test_moe_kernels import _REAL, _real_case, assert_bf16_moe_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SMALL = MoeDecodeConfig(gate_up_block_n=16, gate_up_block_k=32, down_block_n=16, down_block_k=16)
"""Tiles small enough that the tiny test shapes take several row tiles and K tiles (and the K loop's prefetch)."""


def _case(T: int, E: int, K: int, H: int, inter: int, dtype: torch.dtype, seed: int,
          weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    w_gu = (torch.randn(E, 2 * inter, H, generator=gen) / H**0.5).to(DEV, dtype)  # [E, 2I, H]
    w_dn = (torch.randn(E, H, inter, generator=gen) / inter**0.5).to(DEV, dtype)  # [E, H, I]
    w, ids = route_softmax_topk(torch.randn(T, E, generator=gen) * 2, K, renormalize=True)
    return x, w_gu, w_dn, w.to(DEV, weights_dtype), ids.to(DEV)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("T", "E", "K", "H", "inter"), [(1, 8, 8, 64, 48), (3, 8, 2, 64, 32), (5, 6, 3, 96, 40)])
def test_fp32_matches_the_reference(T: int, E: int, K: int, H: int, inter: int, activation: str) -> None:
    """fp32: the same products, summed in another order (H = 96 and I = 40 leave a masked K tail)."""
    x, w_gu, w_dn, w, ids = _case(T, E, K, H, inter, torch.float32, T * 31 + E)
    out = fused_moe_decode(x, w_gu, w_dn, w, ids, activation, config=SMALL)
    torch.testing.assert_close(out, fused_moe_reference(x, w_gu, w_dn, w, ids, activation), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])  # Qwen-style, Gemma-style
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("T", "K"), [(1, 8), (4, 2)])
def test_bf16_matches_the_reference(T: int, K: int, activation: str, weights_dtype: torch.dtype) -> None:
    x, w_gu, w_dn, w, ids = _case(T, 8, K, 64, 48, torch.bfloat16, T * 7 + K, weights_dtype)
    out = fused_moe_decode(x, w_gu, w_dn, w, ids, activation, config=SMALL)
    ref = fused_moe_reference(x, w_gu, w_dn, w, ids, activation)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=6e-2, rtol=4e-2)


def test_fp16_matches_the_reference() -> None:
    x, w_gu, w_dn, w, ids = _case(3, 8, 2, 64, 48, torch.float16, 5)
    out = fused_moe_decode(x, w_gu, w_dn, w.half(), ids, "gelu_tanh", config=SMALL)
    ref = fused_moe_reference(x, w_gu, w_dn, w.half(), ids, "gelu_tanh")
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-3, rtol=5e-3)




def _int8_case(T: int, E: int, K: int, H: int, inter: int, dtype: torch.dtype, seed: int,
               extremes: bool = False) -> tuple[torch.Tensor, ...]:
    """``_case`` with int8 experts (``reference_int8``'s format) and their scales; ``extremes``: a quarter of the
    bytes -128 and a quarter 127, the rest uniform (every sign-bit and byte-position case of the word path)."""
    x, w_gu, w_dn, w, ids = _case(T, E, K, H, inter, dtype, seed)
    q_gu, s_gu = quantize_int8_per_channel(w_gu)
    q_dn, s_dn = quantize_int8_per_channel(w_dn)
    if extremes:
        gen = torch.Generator().manual_seed(seed + 1)
        for q in (q_gu, q_dn):
            draw = torch.randint(0, 4, q.shape, generator=gen).to(q.device)
            q.copy_(torch.where(draw == 0, -128, torch.where(draw == 1, 127, q.long())).to(torch.int8))
    return x, q_gu, q_dn, s_gu, s_dn, w, ids


def _assert_int8_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """int8 experts against the int8 reference: fp32 within summation order, bf16 within its rounding."""
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=6e-2, rtol=4e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_experts_follow_the_int8_reference(dtype: torch.dtype) -> None:
    x, q_gu, q_dn, s_gu, s_dn, w, ids = _int8_case(3, 8, 4, 64, 48, dtype, 11)
    scales = dict(w_gate_up_scale=s_gu, w_down_scale=s_dn)
    out = fused_moe_decode(x, q_gu, q_dn, w, ids, "silu", config=SMALL, **scales)
    _assert_int8_close(out, fused_moe_reference(x, q_gu, q_dn, w, ids, "silu", **scales), dtype)


def _padded_rows(q: torch.Tensor, pad: int) -> torch.Tensor:
    """``q`` stored with ``pad`` spare bytes after each row: same values, rows no longer 4-byte aligned."""
    big = q.new_zeros(*q.shape[:-1], q.shape[-1] + pad)
    big[..., : q.shape[-1]] = q
    return big[..., : q.shape[-1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "H", "inter", "extremes"), [
    (1, 64, 48, True),  # whole K tiles (EVEN_K), -128 and 127 bytes
    (2, 104, 40, True),  # K tails: 104 = 3 x 32 + 8 (gate/up), 40 = 2 x 16 + 8 (down), 8 columns: one word pair
    (2, 96, 56, False),  # gate/up whole tiles, down tail of 8
])
def test_int8_word_path_follows_the_int8_reference(T: int, H: int, inter: int, extremes: bool,
                                                    dtype: torch.dtype) -> None:
    """int8 experts read as 32-bit words (both kernels): the int8 reference's result, whole and ragged K tiles."""
    x, q_gu, q_dn, s_gu, s_dn, w, ids = _int8_case(T, 8, 4, H, inter, dtype, H + inter + T, extremes)
    assert moe_decode._weight_operand(q_gu, True, SMALL.gate_up_block_k)[1]
    assert moe_decode._weight_operand(q_dn, True, SMALL.down_block_k)[1]
    scales = dict(w_gate_up_scale=s_gu, w_down_scale=s_dn)
    out = fused_moe_decode(x, q_gu, q_dn, w, ids, "gelu_tanh", config=SMALL, **scales)
    _assert_int8_close(out, fused_moe_reference(x, q_gu, q_dn, w, ids, "gelu_tanh", **scales), dtype)


def test_int8_default_tiles_and_forced_single_bytes() -> None:
    """The int8 heuristic tiles (one warp, K tiles cut to the dots: 64 and a masked 48 here) on the word path, and
    ``int8_words=False`` (single bytes at the same tiles): the reference's result both ways."""
    x, q_gu, q_dn, s_gu, s_dn, w, ids = _int8_case(2, 8, 4, 64, 48, torch.float32, 21, extremes=True)
    cfg = moe_decode_config(64, 48, 4, int8=True)
    assert moe_decode._weight_operand(q_gu, True, cfg.gate_up_block_k)[1]
    assert moe_decode._weight_operand(q_dn, True, cfg.down_block_k)[1]
    scales = dict(w_gate_up_scale=s_gu, w_down_scale=s_dn)
    ref = fused_moe_reference(x, q_gu, q_dn, w, ids, "silu", **scales)
    torch.testing.assert_close(fused_moe_decode(x, q_gu, q_dn, w, ids, "silu", **scales), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(fused_moe_decode(x, q_gu, q_dn, w, ids, "silu", int8_words=False, **scales), ref,
                               atol=2e-5, rtol=2e-5)

@pytest.mark.parametrize(("H", "inter", "pad"), [(100, 44, 0), (64, 48, 1)])
def test_int8_single_byte_fallback_gives_the_word_path_result(H: int, inter: int, pad: int) -> None:
    """Rows of a multiple of 4 but not 8 bytes (100, 44), or rows not 4-byte aligned: single bytes, the same
    result as words (fp32: only the order of the fp32 sums differs)."""
    x, q_gu, q_dn, s_gu, s_dn, w, ids = _int8_case(2, 8, 3, H, inter, torch.float32, H + pad, extremes=True)
    if pad:
        q_gu, q_dn = _padded_rows(q_gu, pad), _padded_rows(q_dn, pad)
    assert not moe_decode._weight_operand(q_gu, True, SMALL.gate_up_block_k)[1]
    assert not moe_decode._weight_operand(q_dn, True, SMALL.down_block_k)[1]
    scales = dict(w_gate_up_scale=s_gu, w_down_scale=s_dn)
    out = fused_moe_decode(x, q_gu, q_dn, w, ids, "silu", config=SMALL, **scales)
    torch.testing.assert_close(out, fused_moe_reference(x, q_gu, q_dn, w, ids, "silu", **scales), atol=2e-5,
                               rtol=2e-5)
    if not pad:  # 100 x 44 has no word layout; the padded 64 x 48 rows have one when contiguous: compare the paths
        return
    words = fused_moe_decode(x, q_gu.contiguous(), q_dn.contiguous(), w, ids, "silu", config=SMALL, **scales)
    torch.testing.assert_close(out, words, atol=2e-5, rtol=2e-5)


def test_int8_words_are_read_only_with_whole_word_pairs_a_tile() -> None:
    """K tiles must hold whole word pairs (a multiple of 8 columns) and the weight's layout must allow words."""
    q = torch.zeros(2, 8, 64, dtype=torch.int8, device=DEV)
    operand, words = moe_decode._weight_operand(q, True, 32)
    assert words and operand.dtype == torch.int32 and operand.shape == (2, 8, 16)
    assert not moe_decode._weight_operand(q, True, 4)[1]
    assert not moe_decode._weight_operand(q.float(), False, 32)[1]  # float weights: never words
    assert not moe_decode._weight_operand(q[:, :, :60], True, 32)[1]  # 60 columns: not a multiple of 8


def test_default_config_and_repeated_calls_leave_the_counters_zeroed() -> None:
    """The heuristic tiles give the reference's result; every launch resets the arrival counters it used, so a
    second call (in a CUDA graph: a replay) finds them at zero and gives the same result."""
    x, w_gu, w_dn, w, ids = _case(2, 8, 4, 64, 48, torch.float32, 3)
    first = fused_moe_decode(x, w_gu, w_dn, w, ids, "silu")
    torch.testing.assert_close(first, fused_moe_reference(x, w_gu, w_dn, w, ids, "silu"), atol=2e-5, rtol=2e-5)
    assert int(moe_decode._arrival_counters(x.device).count_nonzero()) == 0
    assert torch.equal(first, fused_moe_decode(x, w_gu, w_dn, w, ids, "silu"))


def test_pairs_with_out_of_range_experts_add_nothing() -> None:
    x, w_gu, w_dn, w, ids = _case(2, 8, 3, 64, 48, torch.float32, 4)
    bad = ids.clone()
    bad[0, 1] = 8  # no such expert
    bad[1, 2] = -1
    kept = w.clone()
    kept[0, 1] = 0.0  # the reference with those pairs weighted by zero
    kept[1, 2] = 0.0
    out = fused_moe_decode(x, w_gu, w_dn, w, bad, "silu", config=SMALL)
    ref = fused_moe_reference(x, w_gu, w_dn, kept, ids, "silu")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_heuristic_tiles_divide_the_real_shapes() -> None:
    qwen = moe_decode_config(2048, 768, 2)  # Qwen3-30B-A3B
    assert (qwen.gate_up_block_k, qwen.down_block_k) == (256, 128)
    gemma = moe_decode_config(2816, 704, 2)  # Gemma-4-26B-A4B: 704 = 11 x 64
    assert 2816 % gemma.gate_up_block_k == 0 and 704 % gemma.down_block_k == 0
    assert moe_decode_config(2048, 768, 4).gate_up_block_k == 128  # fp32: the same bytes per tile


def test_int8_tiles_give_each_warp_256_columns() -> None:
    """int8 (words): one warp and 256 columns a K tile (whole word pairs), cut to short dots; Gemma's I = 704
    takes a masked tail."""
    qwen = moe_decode_config(2048, 768, 2, int8=True)
    assert (qwen.gate_up_block_k, qwen.gate_up_warps, qwen.down_block_k, qwen.down_warps) == (256, 1, 256, 1)
    gemma = moe_decode_config(2816, 704, 2, int8=True)
    assert 2816 % gemma.gate_up_block_k == 0 and 704 % gemma.down_block_k == 192
    tiny = moe_decode_config(64, 48, 2, int8=True)
    assert (tiny.gate_up_block_k, tiny.down_block_k, tiny.gate_up_block_n) == (64, 64, 8)


def test_bad_arguments_are_rejected() -> None:
    x, w_gu, w_dn, w, ids = _case(2, 8, 2, 64, 48, torch.float32, 6)
    with pytest.raises(ValueError, match="at most"):
        fused_moe_decode(x.new_zeros(moe_decode.MAX_TOKENS + 1, 64), w_gu, w_dn,
                         w.new_zeros(moe_decode.MAX_TOKENS + 1, 2), ids.new_zeros(moe_decode.MAX_TOKENS + 1, 2),
                         "silu")
    with pytest.raises(ValueError, match="both"):
        fused_moe_decode(x, w_gu, w_dn, w, ids, "silu", w_down_scale=torch.ones(8, 64))
    with pytest.raises(ValueError, match="activation"):
        fused_moe_decode(x, w_gu, w_dn, w, ids, "relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe_decode(x, w_gu.transpose(1, 2).contiguous().transpose(1, 2), w_dn, w, ids, "silu")
    assert fused_moe_decode(x[:0], w_gu, w_dn, w[:0], ids[:0], "silu").shape == (0, 64)


# ------------------------------------------------------------------ sm_90 compile (no GPU needed)

_COMPILE = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from inference_server.kernels import moe_decode

    target = GPUTarget("cuda", 90, 64)
    # Qwen3-30B-A3B (H 2048, I 768) and Gemma-4-26B-A4B (H 2816, I 704), bf16 experts, int8 experts as int32
    # words (with the byte permute) and as single bytes (the fallback)
    for hidden, inter, weight, act, topk_w in ((2048, 768, "*bf16", 0, "*bf16"), (2816, 704, "*bf16", 1, "*fp32"),
                                               (2816, 704, "*i8", 1, "*fp32"), (2048, 768, "words", 0, "*bf16"),
                                               (2816, 704, "words", 1, "*fp32")):
        words = weight == "words"
        int8 = words or weight == "*i8"
        weight = "*i32" if words else weight
        cfg = moe_decode.moe_decode_config(hidden, inter, 2, int8=words)  # single bytes: the float tiles
        for fn, length, block_n, block_k, warps, types, extra in (
                (moe_decode._gate_up_kernel, hidden, cfg.gate_up_block_n, cfg.gate_up_block_k, cfg.gate_up_warps,
                 {"x_ptr": "*bf16", "w_ptr": weight, "ids_ptr": "*i64", "scale_ptr": "*bf16", "out_ptr": "*bf16"},
                 {"TOP_K": 8, "ACT": act}),
                (moe_decode._down_kernel, inter, cfg.down_block_n, cfg.down_block_k, cfg.down_warps,
                 {"inter_ptr": "*bf16", "w_ptr": weight, "ids_ptr": "*i64", "topk_w_ptr": topk_w, "scale_ptr": "*bf16",
                  "pair_ptr": "*fp32" if topk_w == "*fp32" else "*bf16", "counter_ptr": "*i32", "out_ptr": "*bf16"},
                 {"TOP_K": 8, "ROW_TILES_STRIDE": 2048, "W_BEFORE_WAIT": True})):
            constexprs = dict(extra, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=length % block_k == 0, W_INT8=int8,
                              W_WORDS=words, PRMT=words, USE_PDL=False, INT_DOT=words)
            signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
            attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
                     if n.endswith("_ptr") or n.startswith("stride") or n in ("H", "inter_size")}
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                    target=target, options=dict(num_warps=warps, num_stages=1))
            ptx = kernel.asm["ptx"]
            if words:  # two words (8 columns) a load and thread, each byte placed by one permute
                assert "ld.global.v2.b32" in ptx or "ld.global.nc.v2.b32" in ptx, (fn.__name__, hidden, "v2")
                assert "prmt.b32" in ptx, (fn.__name__, hidden, "no byte permute")
                assert "dp2a.lo.s32.s32" in ptx, (fn.__name__, hidden, "bf16 activations: the integer dot")
                # at the int8 tiles the activations stay in the threads of their weight columns: no shared-memory
                # tile of them (256 bf16 columns: 512 bytes) exchanged every K tile
                assert kernel.metadata.shared < 2 * block_k, (fn.__name__, hidden, kernel.metadata.shared)
            else:  # the weight stream is vectorised: 16-byte loads (8 bf16 or 16 int8 values a thread)
                assert "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx, (fn.__name__, hidden, weight)
    print("compiled")
''')


def test_kernels_compile_for_sm90_with_vectorised_weight_loads() -> None:
    _compile_in_child(_COMPILE)


# ------------------------------------------------------------------ GPU, real shapes

@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 16, 64])
@pytest.mark.parametrize("model", sorted(_REAL))
def test_gpu_real_shapes_match_the_reference_and_the_grouped_kernel(model: str, T: int) -> None:
    x, w_gu, w_dn, w, ids, act = _real_case(model, T)
    out = fused_moe_decode(x, w_gu, w_dn, w, ids, act)
    ref = fused_moe_reference(x, w_gu, w_dn, w, ids, act)
    assert_bf16_moe_close(out, ref)
    scale = ref.float().abs().max().item()
    grouped = fused_moe(x, w_gu, w_dn, w, ids, act)
    assert (out.float() - grouped.float()).abs().mean() < 2e-3 * scale


@gpu
@needs_cuda
@pytest.mark.parametrize("model", sorted(_REAL))
def test_gpu_fp32_tight_and_int8(model: str) -> None:
    x, w_gu, w_dn, w, ids, act = _real_case(model, 4, dtype=torch.float32)
    torch.testing.assert_close(fused_moe_decode(x, w_gu, w_dn, w, ids, act),
                               fused_moe_reference(x, w_gu, w_dn, w, ids, act), atol=1e-4, rtol=1e-4)
    q_gu, s_gu = quantize_int8_per_channel(w_gu)
    q_dn, s_dn = quantize_int8_per_channel(w_dn)
    scales = dict(w_gate_up_scale=s_gu, w_down_scale=s_dn)
    torch.testing.assert_close(fused_moe_decode(x, q_gu, q_dn, w, ids, act, **scales),
                               fused_moe_reference(x, q_gu, q_dn, w, ids, act, **scales), atol=1e-4, rtol=1e-4)


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("model", sorted(_REAL))
def test_gpu_int8_words_match_the_reference_and_single_bytes(model: str, T: int) -> None:
    """bf16 activations, int8 experts at the real shapes (the word path with the PTX byte permute, int8 tiles;
    Gemma's I = 704 with its masked K tail): the int8 reference's result, and the single-byte path's."""
    x, w_gu, w_dn, w, ids, act = _real_case(model, T)
    q_gu, s_gu = quantize_int8_per_channel(w_gu)
    q_dn, s_dn = quantize_int8_per_channel(w_dn)
    scales = dict(w_gate_up_scale=s_gu, w_down_scale=s_dn)
    out = fused_moe_decode(x, q_gu, q_dn, w, ids, act, **scales)
    assert_bf16_moe_close(out, fused_moe_reference(x, q_gu, q_dn, w, ids, act, **scales))
    assert_bf16_moe_close(out, fused_moe_decode(x, q_gu, q_dn, w, ids, act, int8_words=False, **scales))

@gpu
@needs_cuda
def test_gpu_deterministic_and_graph_capturable() -> None:
    x, w_gu, w_dn, w, ids, act = _real_case("gemma4-26b-a4b", 16)
    first = fused_moe_decode(x, w_gu, w_dn, w, ids, act)
    assert torch.equal(first, fused_moe_decode(x, w_gu, w_dn, w, ids, act))
    out = torch.empty_like(first)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):  # launches in stream order share the counters
            fused_moe_decode(x, w_gu, w_dn, w, ids, act, out=out)
    x2, _, _, w2, ids2, _ = _real_case("gemma4-26b-a4b", 16, seed=1)
    x.copy_(x2)
    w.copy_(w2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe_decode(x, w_gu, w_dn, w, ids, act))
    assert int(moe_decode._arrival_counters(x.device).count_nonzero()) == 0


# The out-of-range id's pair: its gate/up program writes nothing, so the down program reads an uninitialised row of
# the intermediate buffer (and its epilogue gives the pair zeros): numpy may warn on that garbage.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize(("kind", "H", "inter"), [("float", 64, 48), ("float", 96, 40), ("int8", 64, 48),
                                                   ("int8", 104, 40), ("int8-bytes", 64, 48)])
def test_down_weights_before_the_wait_are_the_same_bits(kind: str, H: int, inter: int) -> None:
    """``weights_before_wait=True``: the down launch's expert ids and first weight tiles loaded before its
    PDL wait (whole and ragged K tiles, float weights and int8 as words or single bytes, a pair with an expert out
    of range) give the result of the launch that loads them after it, bit for bit."""
    if kind == "float":
        x, w_gu, w_dn, w, ids = _case(2, 8, 4, H, inter, torch.bfloat16, H + inter)
        scales: dict[str, torch.Tensor] = {}
    else:
        x, w_gu, w_dn, s_gu, s_dn, w, ids = _int8_case(2, 8, 4, H, inter, torch.bfloat16, H + inter)
        scales = dict(w_gate_up_scale=s_gu, w_down_scale=s_dn)
    ids[1, 2] = 8  # out of range: the pair adds nothing, whichever side of the wait its id is read
    outs = [fused_moe_decode(x, w_gu, w_dn, w, ids, "silu", config=SMALL, int8_words=kind != "int8-bytes",
                             weights_before_wait=early, **scales) for early in (False, True)]
    assert torch.equal(outs[0], outs[1])


def test_down_launch_takes_the_switch() -> None:
    x, w_gu, w_dn, w, ids = _case(1, 8, 8, 64, 48, torch.float32, 3)
    for setting, expected in ((True, True), (False, False), (None, False)):  # None: where PDL is on, never here
        launches, _ = moe_decode.moe_decode_launches(x, w_gu, w_dn, w, ids, "silu", config=SMALL,
                                                     weights_before_wait=setting)
        assert launches is not None and launches.down_constexprs["W_BEFORE_WAIT"] is expected
