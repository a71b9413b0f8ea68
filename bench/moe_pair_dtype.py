#!/usr/bin/env python3
"""Experiment (branch ``moe-sum-unweighted``): the fused MoE's pair outputs stored unweighted in the activation dtype
(bf16) and weighted in the k-sum, against stored weighted in ``promote(act, routing weights)`` (fp32 for Gemma 4),
at prefill step sizes.

The question: at an 8,192-token step of Gemma-4-26B-A4B the ``[T*K, H]`` pair outputs are 738 MB a layer in fp32,
written by the down kernel and read by the k-sum (``_moe_down_kernel`` 20.8 ms and ``_moe_sum_kernel`` 5.9 ms of the
step's 166.5 ms of kernels, ``bench/results/long-context-2026-12-04.md``); in bf16 they are half. Both variants run the
same two launches as ``fused_moe`` does (the down GEMM, then the k-sum), once with bf16 pairs (the branch) and once
with fp32 pairs (the bytes the previous code moved; the extra multiply in the sum is free; its values are not the
engine's, only its traffic), timed per layer call by
``kit.graph_timing.time_calls`` (median of ``--reps`` CUDA-graph replays). Qwen3-30B-A3B's routing weights are bf16,
so its pairs were bf16 already: its row is the control (equal times expected).

  python3 bench/moe_pair_dtype.py                    # on the GPU, under a minute
  TRITON_INTERPRET=1 uv run python bench/moe_pair_dtype.py --tokens 4 --reps 1 --experts 8  # dry run
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from inference_server.kernels import fused_moe as module  # noqa: E402
from inference_server.kernels.moe_configs import device_name, tuned_moe_config  # noqa: E402
from inference_server.kernels.reference_moe import route_softmax_topk  # noqa: E402
from inference_server.kernels.streamed_linear import pow2_clamp  # noqa: E402
from kit.graph_timing import time_calls  # noqa: E402

# (name, hidden, expert intermediate, experts, top-k, routing weight dtype)
MODELS = (("gemma-4-26b-a4b", 2816, 704, 128, 8, torch.float32), ("qwen3-30b-a3b", 2048, 768, 128, 8, torch.bfloat16))


def _down_and_sum(inter: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, align: module.MoeAlignment,
                  pair_dtype: torch.dtype, out: torch.Tensor, config: module.MoeKernelConfig) -> None:
    """``fused_moe``'s last two launches (alignment done outside the timing) with pairs stored in ``pair_dtype``."""
    T, K = weights.shape
    H, inter_size = w_down.shape[1], w_down.shape[2]
    max_blocks = align.block_expert.numel()
    pair_out = torch.empty(T * K, H, dtype=pair_dtype, device=inter.device)
    dn = config.down
    module._moe_down_kernel[(max_blocks * triton.cdiv(H, dn.block_n),)](
        inter, w_down, pair_out, align.sorted_pair_ids, align.block_expert, w_down,
        T * K, H, inter_size, max_blocks,
        inter.stride(0), inter.stride(1), w_down.stride(0), w_down.stride(1), w_down.stride(2),
        pair_out.stride(0), 0, 0,
        BLOCK_M=config.block_m, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, GROUP_M=dn.group_m,
        EVEN_K=inter_size % dn.block_k == 0, IEEE=False, UPCAST=module._INTERPRETED, W_INT8=False, MAGIC=False,
        num_warps=dn.num_warps, num_stages=dn.num_stages,
    )  # fmt: skip
    block_h = pow2_clamp(H, 16, 1024)
    module._moe_sum_kernel[(T, triton.cdiv(H, block_h))](
        pair_out, weights.reshape(-1), out, H, pair_out.stride(0), out.stride(0), TOP_K=K, BLOCK_H=block_h,
        WEIGHTED_DTYPE=module._TL_DTYPES[torch.promote_types(inter.dtype, weights.dtype)],
        num_warps=4 if block_h >= 512 else 1, enable_fp_fusion=False,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--experts", type=int, default=0, help="override the expert count (dry runs)")
    options = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print("| model | tokens | pairs fp32 µs | pairs bf16 µs | speed-up | pair bytes fp32 -> bf16 (MB) |")
    print("|---|---|---|---|---|---|")
    for name, hidden, inter_size, experts, top_k, weight_dtype in MODELS:
        experts = options.experts or experts
        top_k = min(top_k, experts)
        gen = torch.Generator().manual_seed(0)
        w_down = (torch.randn(experts, hidden, inter_size, generator=gen) / inter_size**0.5).to(device, torch.bfloat16)
        for tokens in (int(t) for t in options.tokens.split(",")):
            weights, ids = route_softmax_topk(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
            weights, ids = weights.to(device, weight_dtype), ids.to(device)
            inter = torch.randn(tokens * top_k, inter_size, generator=gen).to(device, torch.bfloat16)
            config = (tuned_moe_config(tokens, hidden, inter_size, experts, top_k, torch.bfloat16, device_name(device))
                      or module.moe_kernel_config(tokens, hidden, inter_size, experts, top_k))
            align = module.moe_align_block_size(ids, experts, config.block_m)
            times = {}
            for pair_dtype in (torch.promote_types(torch.bfloat16, weight_dtype), torch.bfloat16):
                out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=device)
                times[pair_dtype] = time_calls(
                    [functools.partial(_down_and_sum, inter, w_down, weights, align, pair_dtype, out, config)] * 4,
                    device, options.reps)
            wide, narrow = times[torch.promote_types(torch.bfloat16, weight_dtype)], times[torch.bfloat16]
            pair_mb = tokens * top_k * hidden * torch.tensor([], dtype=weight_dtype).element_size() / 1e6
            print(f"| {name} | {tokens} | {wide * 1e6:.1f} | {narrow * 1e6:.1f} | {wide / narrow:.2f}x "
                  f"| {pair_mb:.0f} -> {tokens * top_k * hidden * 2 / 1e6:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
