"""Triton fused MoE: expert alignment, gate/up grouped GEMM + activation, down grouped GEMM, weighted k-sum.

Pipeline: 4 kernel launches at decode (5 once the T*K pairs exceed one alignment chunk: 128 pairs at
E=128, 256 at E<=64), no host syncs, graph-capturable (grids come from static upper bounds):

1. Alignment: a stable counting sort of the T*K (token, k) pairs by expert; each expert's group is
   padded to a multiple of BLOCK_M, so every BLOCK_M-row block belongs to one expert. Outputs
   ``sorted_pair_ids`` (pair id ``t*K + k``, or ``T*K`` for padding) and ``block_expert`` (expert of
   each block, -1 for blocks past the used ones). Our own design: the pairs are cut into chunks of
   16384/E_pad (at most 256); a one-hot ``[CHUNK, E]`` cumsum gives each pair its rank inside its
   expert and chunk, and per-chunk expert counts (``_moe_align_count_kernel``, skipped when one chunk
   holds all pairs, as in decode) give the chunk's offset: stable, deterministic, parallel over chunks.
2. ``_moe_gate_up_kernel``: per block, ``gate = x @ W_gu[e, :I].T`` and ``up = x @ W_gu[e, I:].T`` (two
   fp32 accumulators over the same A tile), epilogue ``act(gate) * up`` -> ``inter [T*K, I]`` (row = pair).
3. ``_moe_down_kernel``: ``y = inter @ W_down[e].T`` rounded to the activation dtype ->
   ``pair_out [T*K, H]`` (row = pair).
4. ``_moe_sum_kernel``: ``out[t] = Σ_k pair_out[t*K + k] * topk_weight[t, k]`` in fp32, k ascending, one
   cast.

Only blocks of routed experts exist (at most ``floor((N - A)/BLOCK_M) + A`` blocks for N pairs and
A = min(N, E) possibly-active experts), and padded blocks exit at once, so at T=1 only the K routed
experts' weights are read from HBM.

Compiled variants: a server sees every step size, so what varies with the step must not multiply Triton's
compiled variants (each costs seconds the first time it is met, mid-serving). The integer arguments that
follow the step size (``num_pairs``, ``max_blocks``, ``num_chunks``, ``num_blocks_m``) are not specialised
(``do_not_specialize``: no "== 1" / "divisible by 16" variants), and ``NC_PAD`` is at least 128, so every
multi-chunk alignment of up to 128 chunks (16384 pairs: a 2048-token step at K=8) is one variant per BLOCK_M.
What still varies is BLOCK_M and the GEMM tiles it selects; ``CudaModelRunner`` compiles those at start-up.

Accumulation choice: deterministic. The pairs are written once and weighted and summed by a separate
kernel in a fixed order instead of atomically added into ``[T, H]``: results are bitwise reproducible
run to run, there is no zero-fill launch, and the extra traffic (``T*K*H`` written and read once) is
small next to the expert weights at decode (at T=1: ~90 KB against ~25 MB of weights). At prefill it is not
(an 8,192-token step of Gemma-4-26B-A4B: 185 MB a layer in the activation dtype), which is why the pairs are
stored before the weighting, in the activation dtype, rather than weighted in fp32 (twice the bytes for Gemma 4).

Rounding mirrors HF's default ``grouped_mm`` path (see ``reference_moe``): the gate/up and down GEMM
results are rounded to the activation dtype before use; ``act(gate)`` and ``act*up`` are each
rounded; the weighted pair is rounded to ``promote(act dtype, topk_weights dtype)`` (bf16 for Qwen,
whose routing weights are cast to bf16; fp32 for Gemma 4, whose weights stay fp32); the k-sum is fp32. The sum
kernel is compiled without multiply-add contraction (``enable_fp_fusion=False``), so each fp32 weighted pair is
rounded before it is added, as when the down kernel stored it.
fp32 activations use IEEE fp32 dot products (no TF32), so they match the fp32 reference tightly.

int8 experts (``w_gate_up_scale``/``w_down_scale`` given, ``W_INT8`` in the GEMM kernels): weight tiles are loaded
as int8 (half the bytes of bf16, which is what decode is bound by), converted to the activation dtype in
registers, and each GEMM's fp32 accumulator is multiplied by its output row's scale before the rounding above.
``W_INT8`` is a constexpr: the bf16 kernels compile to the same code as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inference_server.kernels.int8_dequant import int8_to_fp32_exact
from inference_server.kernels.moe_arguments import ACT_CODES, check_moe_arguments, moe_output
from inference_server.kernels.moe_configs import (
    MoeGemmConfig,
    MoeKernelConfig,
    device_name,
    tuned_configs_enabled,
    tuned_moe_config,
)
from inference_server.kernels.pdl import (
    pdl_launch,
    pdl_release,
    pdl_release_after_loop,
    pdl_release_after_wait,
    pdl_wait,
)
from inference_server.kernels.reference_moe import Activation
from inference_server.kernels.streamed_linear import dividing_block_k, pow2_clamp

__all__ = [
    "MoeAlignment",
    "MoeGemmConfig",
    "MoeKernelConfig",
    "fused_moe",
    "moe_align_block_size",
    "moe_kernel_config",
    "moe_max_blocks",
]

_H200_SMS = 132


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


def moe_kernel_config(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int = 8,
    num_sms: int = _H200_SMS,
) -> MoeKernelConfig:
    """Heuristic block sizes from (T, H, I, E, K); a starting point for GPU tuning.

    Rows per active expert (uniform routing estimate) picks BLOCK_M. Up to 32 rows the GEMMs are
    weight-streaming GEMVs: narrow N tiles so the K routed experts' tiles cover the SMs, deep K tiles
    and more pipeline stages for loads in flight. Beyond that they are grouped GEMMs with 64-128 tiles.
    """
    pairs = max(1, num_tokens * top_k)
    active = num_experts * (1.0 - (1.0 - min(top_k, num_experts) / num_experts) ** max(1, num_tokens))
    active = max(1.0, min(float(num_experts), float(pairs), active))
    rows = pairs / active
    # Busy experts get about rows + 2 sqrt(rows): size BLOCK_M so most experts need one block.
    block_m = 16 if rows <= 8 else 32 if rows <= 24 else 64 if rows <= 96 else 128
    n_gu_max = pow2_clamp(intermediate_size, 16, 1 << 30)
    n_dn_max = pow2_clamp(hidden_size, 16, 1 << 30)
    if block_m <= 32:
        bn_gu = 64 if active * triton.cdiv(intermediate_size, 64) >= 2 * num_sms else 32
        bn_dn = 64 if active * triton.cdiv(hidden_size, 64) >= num_sms else 32
        gate_up = MoeGemmConfig(min(bn_gu, n_gu_max), dividing_block_k(hidden_size, 128), 1, 4, 4)
        down = MoeGemmConfig(min(bn_dn, n_dn_max), dividing_block_k(intermediate_size, 128), 1, 4, 4)
    else:
        warps = 8 if block_m >= 128 else 4
        gate_up = MoeGemmConfig(min(64, n_gu_max), dividing_block_k(hidden_size, 64), 1, warps, 3)
        down = MoeGemmConfig(min(128, n_dn_max), dividing_block_k(intermediate_size, 64), 1, warps, 3)
    return MoeKernelConfig(block_m, gate_up, down)


def _halve_block_k(config: MoeKernelConfig) -> MoeKernelConfig:
    """The config with half the K depth per tile (at least 16): the same tiles' shared memory in fp32 as the
    bf16 heuristic budgets for (seen: 245,760 bytes needed at Gemma-4-26B widths, 232,448 available)."""

    def halved(gemm: MoeGemmConfig) -> MoeGemmConfig:
        return MoeGemmConfig(gemm.block_n, max(16, gemm.block_k // 2), gemm.group_m, gemm.num_warps,
                             gemm.num_stages)

    return MoeKernelConfig(config.block_m, halved(config.gate_up), halved(config.down))


# ----------------------------------------------------------------------------------------------
# Alignment: group (token, k) pairs by expert, pad each group to BLOCK_M
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeAlignment:
    """Pairs grouped by expert. Pair id p = t*K + k; padding slots hold N = T*K.

    ``sorted_pair_ids [max_blocks * block_m] int32``: expert 0's pairs (ascending), padding up to a
    multiple of block_m, expert 1's, ...; slots past ``num_padded`` also hold N.
    ``block_expert [max_blocks] int32``: expert of each block, -1 past the used blocks.
    ``num_padded [1] int32``: used slots (a multiple of block_m), on device.
    """

    sorted_pair_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def moe_max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on Σ_e ceil(n_e / block_m) over Σ n_e = num_pairs, at most num_experts e."""
    active = min(num_pairs, num_experts)
    return (num_pairs - active) // block_m + active


@triton.jit(do_not_specialize=['num_pairs'])
def _moe_align_count_kernel(
    ids_ptr,  # [N] expert id of each pair
    chunk_counts_ptr,  # [num_chunks, E_PAD] int32 out: pairs per expert in each chunk
    num_pairs,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): the expert ids come from the router launch, so wait before the first load and store; a short
    # kernel, so release the next launch at once (its CTAs get resident and wait while this one runs).
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    e_offs = tl.arange(0, E_PAD)
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
    counts = tl.sum((ids[:, None] == e_offs[None, :]).to(tl.int32), axis=0)  # [E_PAD]
    tl.store(chunk_counts_ptr + c * E_PAD + e_offs, counts)


@triton.jit(do_not_specialize=['num_pairs', 'max_blocks', 'num_chunks'])
def _moe_align_scatter_kernel(
    ids_ptr,  # [N] expert id of each pair
    chunk_counts_ptr,  # [num_chunks, E_PAD] int32 from the count kernel (unused when SINGLE)
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 out
    block_expert_ptr,  # [max_blocks] int32 out
    num_padded_ptr,  # [1] int32 out
    num_pairs,
    max_blocks,
    num_chunks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    NC_PAD: tl.constexpr,
    SINGLE: tl.constexpr,  # one chunk holds every pair: count inline, no count kernel
    FILL: tl.constexpr,  # slots per padding store in the SINGLE path
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): the expert ids (and chunk counts) come from earlier launches and the sorted ids may still be
    # read by the previous layer's GEMMs, so wait before the first load and store; a short kernel, so release the next
    # launch at once (its CTAs get resident and wait while this one runs).
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    c = tl.program_id(0)
    e_offs = tl.arange(0, E_PAD)  # [E_PAD]
    c_offs = tl.arange(0, CHUNK)  # [CHUNK]
    p = c * CHUNK + c_offs
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
    onehot = (ids[:, None] == e_offs[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    if SINGLE:
        counts = tl.sum(onehot, axis=0)  # [E_PAD]
        before = tl.zeros([E_PAD], dtype=tl.int32)
    else:
        rows = tl.arange(0, NC_PAD)
        cc = tl.load(
            chunk_counts_ptr + rows[:, None] * E_PAD + e_offs[None, :],
            mask=(rows < num_chunks)[:, None],
            other=0,
        )  # [NC_PAD, E_PAD]
        counts = tl.sum(cc, axis=0)
        # pairs of each expert in the earlier chunks
        before = tl.sum(cc * (rows < c).to(tl.int32)[:, None], axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]
    ends = tl.cumsum(padded, axis=0)  # end slot of each expert's group
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    if c == 0:
        tl.store(num_padded_ptr, total)
    # Pair slots: group start + pairs of the expert in earlier chunks + rank inside this chunk.
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # [CHUNK], -1 for masked lanes
    base = tl.sum(onehot * (starts + before)[None, :], axis=1)
    num_slots = max_blocks * BLOCK_M
    stride = num_chunks * CHUNK
    if SINGLE:
        # One program (decode): every slot gets the padding id in wide plain stores, then, after a barrier
        # (the program's threads see each other's global writes), the pairs overwrite their slots. The
        # general path below finds padding slots with a [CHUNK, E_PAD] search per CHUNK slots, a serial loop
        # that took a sixth of a Qwen3-MoE layer's time at batch 1 (docs/benchmarks.md).
        for s0 in range(0, num_slots, FILL):
            s = s0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + s, num_pairs + tl.zeros_like(s), mask=s < num_slots)
        tl.debug_barrier()
        tl.store(sorted_ptr + base + rank, p, mask=(p < num_pairs) & (rank >= 0))
    else:
        tl.store(sorted_ptr + base + rank, p, mask=(p < num_pairs) & (rank >= 0))
        # Padding slots (disjoint from every pair slot, so no ordering hazard), spread over the programs.
        for s0 in range(c * CHUNK, num_slots, stride):
            s = s0 + c_offs
            e_of = tl.sum((ends[None, :] <= s[:, None]).to(tl.int32), axis=1)  # expert whose group holds s
            sel = (e_of[:, None] == e_offs[None, :]).to(tl.int32)
            fill = s - tl.sum(sel * starts[None, :], axis=1) >= tl.sum(sel * counts[None, :], axis=1)
            fill = fill | (s >= total)
            tl.store(sorted_ptr + s, num_pairs + tl.zeros_like(s), mask=(s < num_slots) & fill)
    # Block experts, spread over the programs.
    for b0 in range(c * CHUNK, max_blocks, stride):
        b = b0 + c_offs
        first = b * BLOCK_M
        e_of = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(first < total, e_of, -1), mask=b < max_blocks)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group the (token, k) pairs of ``topk_ids [T, K]`` by expert, padded per expert to block_m.

    No host sync. One launch when the T*K pairs fit one chunk (decode), else two: per-chunk expert
    counts, then a scatter where each chunk places its pairs after the earlier chunks' (stable).
    Ids must lie in [0, num_experts): others are dropped (their pairs are never computed).
    Within an expert, pairs keep ascending pair order.
    """
    ids = topk_ids.reshape(-1)  # [N]
    if not ids.is_contiguous():
        ids = ids.contiguous()
    n = ids.numel()
    max_blocks = moe_max_blocks(n, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = pow2_clamp(num_experts, 16, 1 << 20)
    chunk = pow2_clamp(n, 16, max(16, min(256, 16384 // e_pad)))  # [CHUNK, E_PAD] one-hot tiles
    num_chunks = max(1, triton.cdiv(n, chunk))
    single = num_chunks == 1
    warps = 8 if e_pad * chunk >= 16384 else 4
    if single:
        chunk_counts = num_padded  # unused
    else:
        chunk_counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=dev)
        _moe_align_count_kernel[(num_chunks,)](
            ids, chunk_counts, n, E_PAD=e_pad, CHUNK=chunk, num_warps=warps, **pdl_launch()
        )
    _moe_align_scatter_kernel[(num_chunks,)](
        ids, chunk_counts, sorted_ids, block_expert, num_padded, n, max_blocks, num_chunks,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, NC_PAD=1 if single else pow2_clamp(num_chunks, 128, 1 << 20),
        SINGLE=single, FILL=1024, num_warps=warps, **pdl_launch(),
    )  # fmt: skip
    return MoeAlignment(sorted_ids, block_expert, num_padded, block_m)


# ----------------------------------------------------------------------------------------------
# Grouped GEMMs
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Launch order: GROUP_M m-blocks at a time, m fastest inside a group (GROUP_M=1: n fastest)."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc += a @ b. IEEE: exact fp32 products (fp32 inputs, no TF32). UPCAST: interpreter-only fix
    (TRITON_INTERPRET's numpy dot mishandles bf16), never set on GPU."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _mma_w(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr, W_INT8: tl.constexpr, MAGIC: tl.constexpr):
    """acc += a @ b for a weight tile ``b``: int8 (W_INT8) is converted to a's dtype in registers first (its values
    are exact in every float type; under UPCAST straight to fp32: the interpreter mishandles int8 -> bf16).
    MAGIC: through fp32 by the exponent trick (``int8_dequant``) instead of the quarter-rate conversion."""
    if W_INT8:
        if MAGIC:
            b = int8_to_fp32_exact(b)
            if not UPCAST:
                b = b.to(a.dtype)
        elif UPCAST:
            b = b.to(tl.float32)
        else:
            b = b.to(a.dtype)
    return _mma(a, b, acc, IEEE, UPCAST)


@triton.jit
def act_times_up(gate, up, dt, ACT: tl.constexpr):
    """``act(gate) * up`` from the fp32 results of the gate and up GEMMs, with torch's rounding points: each GEMM's
    output rounded to the activation dtype ``dt``, then ``act(gate)`` rounded, then the product (fp32, for the
    caller to store in ``dt``). ACT 0 is silu, 1 gelu_tanh. Shared by the grouped kernel here and
    ``moe_decode``'s GEMV."""
    gate = gate.to(dt).to(tl.float32)
    up = up.to(dt).to(tl.float32)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))  # silu
    else:
        # gelu_tanh: 0.5 g (1 + tanh(z)) == g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3)
        act = gate / (1.0 + tl.exp(-1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)))
    return act.to(dt).to(tl.float32) * up


@triton.jit(do_not_specialize=['num_pairs', 'num_blocks_m'])
def _moe_gate_up_kernel(
    x_ptr,  # [T, H] activations
    w_ptr,  # [E, 2I, H] gate rows [0, I), up rows [I, 2I); int8 when W_INT8
    out_ptr,  # [N, I] act(gate) * up, row = pair id
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 pair ids
    block_expert_ptr,  # [max_blocks] int32
    scale_ptr,  # [E, 2I] per-output-row scale of the int8 weight (unused unless W_INT8)
    num_pairs,
    H,
    inter_size,
    num_blocks_m,
    stride_xt,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,  # 0 silu, 1 gelu_tanh
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    W_INT8: tl.constexpr,  # int8 weights: dequantised in registers, scaled after the fp32 reduction
    MAGIC: tl.constexpr,  # with W_INT8: dequantised by the exponent trick (int8_dequant)
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): the block's expert, its pairs and the activations come from earlier launches (which expert's
    # weights to read is known only from them), so wait before the first load, in every program (also those that
    # return at once: a kernel completes only after its predecessor).
    pdl_wait(USE_PDL)
    pdl_release_after_wait(USE_PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_blocks_m, tl.cdiv(inter_size, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)  # [BM]
    row_ok = pair < num_pairs
    tok = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_n_safe = offs_n % inter_size  # in-bounds loads; the store is masked
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk  # [BM, BK]
    g_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + offs_n_safe[None, :] * stride_wn
        + offs_k[:, None] * stride_wk
    )  # [BK, BN]
    u_ptrs = g_ptrs + inter_size * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < H - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        acc_g = _mma_w(a, g, acc_g, IEEE, UPCAST, W_INT8, MAGIC)
        acc_u = _mma_w(a, u, acc_u, IEEE, UPCAST, W_INT8, MAGIC)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    # Release after the main loop (kernels.pdl's mode; the other releases right after the wait): only the epilogue
    # is left, so the next launch's CTAs (resident from here on, waiting) hold no shared memory and registers while
    # this kernel's programs still stream their tiles.
    pdl_release_after_loop(USE_PDL)
    dt = out_ptr.dtype.element_ty
    if W_INT8:  # per output row of W: gate row n, up row I + n
        s_ptrs = scale_ptr + expert.to(tl.int64) * stride_se + offs_n_safe * stride_sn
        acc_g = acc_g * tl.load(s_ptrs).to(tl.float32)[None, :]
        acc_u = acc_u * tl.load(s_ptrs + inter_size * stride_sn).to(tl.float32)[None, :]
    h = act_times_up(acc_g, acc_u, dt, ACT)
    o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(o_ptrs, h.to(dt), mask=row_ok[:, None] & (offs_n < inter_size)[None, :])


@triton.jit(do_not_specialize=['num_pairs', 'num_blocks_m'])
def _moe_down_kernel(
    a_ptr,  # [N, I] act(gate) * up, row = pair id
    w_ptr,  # [E, H, I]; int8 when W_INT8
    out_ptr,  # [N, H] expert outputs in the activation dtype, not yet weighted
    sorted_ptr,
    block_expert_ptr,
    scale_ptr,  # [E, H] per-output-row scale of the int8 weight (unused unless W_INT8)
    num_pairs,
    H,
    inter_size,
    num_blocks_m,
    stride_at,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    stride_se,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    W_INT8: tl.constexpr,  # int8 weights: dequantised in registers, scaled after the fp32 reduction
    MAGIC: tl.constexpr,  # with W_INT8: dequantised by the exponent trick (int8_dequant)
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): as the gate/up kernel: wait in every program before the first load.
    pdl_wait(USE_PDL)
    pdl_release_after_wait(USE_PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_blocks_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)  # [BM]
    row_ok = pair < num_pairs
    pair64 = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_safe = offs_n % H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + pair64[:, None] * stride_at + offs_k[None, :] * stride_ak  # [BM, BK]
    w_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + offs_n_safe[None, :] * stride_wn
        + offs_k[:, None] * stride_wk
    )  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(inter_size, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < inter_size - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = _mma_w(a, w, acc, IEEE, UPCAST, W_INT8, MAGIC)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    # Release after the main loop (kernels.pdl's mode; the other releases right after the wait): only the epilogue
    # is left, so the next launch's CTAs (resident from here on, waiting) hold no shared memory and registers while
    # this kernel's programs still stream their tiles.
    pdl_release_after_loop(USE_PDL)
    if W_INT8:
        s_ptrs = scale_ptr + expert.to(tl.int64) * stride_se + offs_n_safe * stride_sn
        acc = acc * tl.load(s_ptrs).to(tl.float32)[None, :]
    o_ptrs = out_ptr + pair64[:, None] * stride_ot + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < H)[None, :])


@triton.jit
def _moe_sum_kernel(
    in_ptr,  # [T*K, H] expert outputs in the activation dtype, row = pair
    topk_w_ptr,  # [T*K] routing weight of each pair
    out_ptr,  # [T, H]
    H,
    stride_in,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WEIGHTED_DTYPE: tl.constexpr,  # promote(act, topk_weights): where each weighted pair is rounded
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): the pairs come from the down kernel just before, and the routing weights from an earlier
    # launch, so wait before the first load and store; a short kernel, so release the next launch at once (its CTAs
    # get resident and wait while this one runs).
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # fixed order k = 0..K-1: deterministic
        route_w = tl.load(topk_w_ptr + t * TOP_K + k).to(tl.float32)
        y = tl.load(in_ptr + (t * TOP_K + k) * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
        # rounded to the weighted dtype before the add (the launch disables multiply-add contraction)
        acc += (y * route_w).to(WEIGHTED_DTYPE).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# TRITON_INTERPRET=1 is read when a kernel is decorated: the kernels are then interpreter objects.
_INTERPRETED = not isinstance(_moe_gate_up_kernel, triton.runtime.JITFunction)


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation,
    *,
    config: MoeKernelConfig | None = None,
    out: torch.Tensor | None = None,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = Σ_k w[t,k] · down_e(act(gate_e(x_t)) · up_e(x_t)),  e = topk_ids[t, k].

    Shapes: ``hidden [T, H]``; ``w_gate_up [E, 2I, H]`` (gate rows first, then up); ``w_down [E, H, I]``
    (both in ``hidden.dtype``: fp32, fp16 or bf16, or both int8 with scales, see below; any strides);
    ``topk_weights [T, K]`` float (its dtype sets the weighting precision: bf16 for Qwen3-MoE, fp32 for
    Gemma 4, see module docstring);
    ``topk_ids [T, K]`` int32/int64 with every id in [0, E) (unchecked: out-of-range pairs are skipped
    and leave their rows of the k-sum undefined). Returns ``out [T, H]`` in ``hidden.dtype`` (written
    into ``out`` when given). No host syncs; allocations come from the caching allocator, so the call
    is CUDA-graph capturable. ``config`` defaults to the tuned config for this GPU and shape
    (``moe_configs.tuned_moe_config``), else ``moe_kernel_config(T, H, I, E, K)``.

    int8 weights (``reference_int8``'s format): pass both scales, ``w_gate_up_scale [E, 2I]`` and
    ``w_down_scale [E, H]`` (float, per output row), with ``w_gate_up``/``w_down`` int8. Weight tiles are converted
    to the activation dtype in registers, and each GEMM's fp32 result is multiplied by its row's scale before the
    rounding to the activation dtype (so before the activation and before the routing weight): the oracle is
    ``tests/kernels/reference_moe.py``'s ``fused_moe_int8_reference``. Tuned configs come from the files for
    ``dtype=int8`` (bf16/fp16 activations; fp32 ones use the heuristic).
    """
    shapes = check_moe_arguments(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, w_gate_up_scale,
                                 w_down_scale)
    T, H, E, inter_size, K, w_int8 = (shapes.tokens, shapes.hidden, shapes.experts, shapes.intermediate,
                                      shapes.top_k, shapes.int8)
    out = moe_output(hidden, out)
    if T == 0:
        return out
    cfg = config
    if cfg is None and tuned_configs_enabled() and not (w_int8 and hidden.element_size() > 2):
        # tuned for this GPU and shape (moe_configs; int8 experts have their own files), else the heuristic
        tuned_dtype = torch.int8 if w_int8 else hidden.dtype
        cfg = tuned_moe_config(T, H, inter_size, E, K, tuned_dtype, device_name(hidden.device))
    if cfg is None:
        cfg = moe_kernel_config(T, H, inter_size, E, K)
        if hidden.element_size() > 2:
            cfg = _halve_block_k(cfg)  # fp32 tiles take twice the shared memory (the H200's 227 KB ran out)
    bm = cfg.block_m
    n_pairs = T * K
    align = moe_align_block_size(topk_ids, E, bm)
    max_blocks = align.block_expert.numel()
    upcast = _INTERPRETED and hidden.dtype != torch.float32
    ieee = hidden.dtype == torch.float32
    dev = hidden.device

    inter = torch.empty(n_pairs, inter_size, dtype=hidden.dtype, device=dev)  # [T*K, I]
    gu = cfg.gate_up
    grid_gu = (max_blocks * triton.cdiv(inter_size, gu.block_n),)
    gu_scale = w_gate_up_scale if w_gate_up_scale is not None else w_gate_up  # unused unless int8
    _moe_gate_up_kernel[grid_gu](
        hidden, w_gate_up, inter, align.sorted_pair_ids, align.block_expert, gu_scale,
        n_pairs, H, inter_size, max_blocks,
        hidden.stride(0), hidden.stride(1), w_gate_up.stride(0), w_gate_up.stride(1), w_gate_up.stride(2),
        inter.stride(0), gu_scale.stride(0), gu_scale.stride(1),
        TOP_K=K, ACT=ACT_CODES[activation], BLOCK_M=bm, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k,
        GROUP_M=gu.group_m, EVEN_K=H % gu.block_k == 0, IEEE=ieee, UPCAST=upcast, W_INT8=w_int8,
        MAGIC=w_int8 and bool(gu.magic_dequant),
        num_warps=gu.num_warps, num_stages=gu.num_stages, **pdl_launch(loop="moe"),
    )  # fmt: skip

    weights = topk_weights.reshape(-1)  # [T*K]
    if not weights.is_contiguous():
        weights = weights.contiguous()
    pair_out = torch.empty(n_pairs, H, dtype=hidden.dtype, device=dev)  # [T*K, H], not yet weighted
    dn = cfg.down
    grid_dn = (max_blocks * triton.cdiv(H, dn.block_n),)
    dn_scale = w_down_scale if w_down_scale is not None else w_down  # unused unless int8
    _moe_down_kernel[grid_dn](
        inter, w_down, pair_out, align.sorted_pair_ids, align.block_expert, dn_scale,
        n_pairs, H, inter_size, max_blocks,
        inter.stride(0), inter.stride(1), w_down.stride(0), w_down.stride(1), w_down.stride(2),
        pair_out.stride(0), dn_scale.stride(0), dn_scale.stride(1),
        BLOCK_M=bm, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, GROUP_M=dn.group_m,
        EVEN_K=inter_size % dn.block_k == 0, IEEE=ieee, UPCAST=upcast, W_INT8=w_int8,
        MAGIC=w_int8 and bool(dn.magic_dequant),
        num_warps=dn.num_warps, num_stages=dn.num_stages, **pdl_launch(loop="moe"),
    )  # fmt: skip

    block_h = pow2_clamp(H, 16, 1024)
    weighted_dtype = _TL_DTYPES[torch.promote_types(hidden.dtype, topk_weights.dtype)]
    _moe_sum_kernel[(T, triton.cdiv(H, block_h))](
        pair_out, weights, out, H, pair_out.stride(0), out.stride(0), TOP_K=K, BLOCK_H=block_h,
        WEIGHTED_DTYPE=weighted_dtype, num_warps=4 if block_h >= 512 else 1, enable_fp_fusion=False, **pdl_launch(),
    )  # fmt: skip
    return out
