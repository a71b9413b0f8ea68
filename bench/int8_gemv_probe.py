"""What bounds the one-token int8 GEMV short of HBM's read ceiling: the dequantising arithmetic, or the way the
weights are read? (issue 13: Gemma-4-31B at B=1 needs its int8 GEMVs near 0.95 of 4.3 TB/s; they run at 0.70-0.89.)

One probe kernel, the engine GEMV's loop at one token (``kernels/int8_gemv.py``: two int32 words a thread and row,
the next tile's loads before this tile's arithmetic, whole K tiles), with two switches:

* ``MODE`` 0: the engine's arithmetic (byte permute into 2**23's mantissa, float add, FMA); 1: no arithmetic, the
  words XORed into an integer accumulator (the same loads, the same registers in flight): the read pattern's own
  ceiling.
* ``MODE`` 2: the activations pre-quantized on the host to a 16-bit fixed point with one scale, split in two int8
  limbs, and the products as ``dp4a`` integer dot products: no weight conversion at all (the measurement that led
  to ``kernels/int8_fixed_dot.py``, whose fixed point is per word and computed in the kernel);
* ``RUN`` 2: two words a thread and load (8-byte loads, the engine's); 4: four (16-byte loads);
* ``TILED`` 0: the engine's row-major ``[N, K]`` weights (a program reads ``BLOCK_N`` rows' ``BLOCK_K``-byte
  segments each tile, far apart); 1: the weights repacked ``[N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K]`` so a
  program's tile is one contiguous ``BLOCK_N x BLOCK_K`` chunk and its tiles follow each other in memory (measured
  in the first call of 2026-12-01's fourth session: no gain; the table below no longer times it).

Each cell is the median per-call time of ``--reps`` replays of a CUDA graph of consecutive calls over enough
weight copies that no call finds its weights in L2 (``graph_timing``), as a fraction of 4.3 TB/s. The engine's
kernel with its tuned config is timed beside (since the integer dot, the engine's kernel is that path).
Results: ``bench/results/2026-12-01-h200/session4/probe_and_sweep.md``.

Usage (on the GPU, ~1 min): ``python3 bench/int8_gemv_probe.py [--reps 20]``
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from graph_timing import calls_per_graph, device_l2_bytes, rotation, time_calls
from inference_server.kernels.int8_dequant import fma_words, word_pair_offsets, words_to_fp32_exact

HBM_BYTES_PER_S = 4.3e12
SHAPES = (("31b qkv", 16384, 5376), ("31b o", 5376, 8192), ("31b gate_up", 43008, 5376), ("31b down", 5376, 21504))
CONFIGS = ((8, 256, 1), (16, 256, 1), (8, 512, 1), (8, 512, 2), (8, 1024, 4), (4, 1024, 2), (16, 512, 2))
"""(block_n, block_k, num_warps)"""


@triton.jit
def probe_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, K, xh_ptr, xl_ptr, x_scale, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, TILED: tl.constexpr, MODE: tl.constexpr, PRMT: tl.constexpr = True,
                 RUN: tl.constexpr = 2):
    WORDS: tl.constexpr = BLOCK_K // 4
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_N)
    if RUN == 2:
        offs_w, _ = word_pair_offsets(WORDS)
    else:  # runs of 4 words: 16-byte loads
        offs_w = tl.arange(0, WORDS)
    k_words = K // 4
    n_tiles = K // BLOCK_K
    if TILED:  # [N / BN, K / BK, BN, BK]: the program's tiles are consecutive chunks of BN * BK bytes
        w_ptrs = w_ptr + pid.to(tl.int64) * (BLOCK_N * k_words) + rows[:, None] * WORDS + offs_w[None, :]
        w_step = BLOCK_N * WORDS
    else:
        w_ptrs = w_ptr + (pid * BLOCK_N + rows).to(tl.int64)[:, None] * k_words + offs_w[None, :]
        w_step = WORDS
    x_ptrs = x_ptr + tl.arange(0, BLOCK_K)
    xh_ptrs = xh_ptr + offs_w
    xl_ptrs = xl_ptr + offs_w
    w = tl.load(w_ptrs)
    if MODE == 2:
        xh = tl.load(xh_ptrs)
        xl = tl.load(xl_ptrs)
    else:
        x = tl.load(x_ptrs)
    acc_h = tl.zeros((BLOCK_N, WORDS), dtype=tl.int32)
    acc_l = tl.zeros((BLOCK_N, WORDS), dtype=tl.int32)
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    bits = tl.zeros((BLOCK_N, WORDS), dtype=tl.int32)
    for kb in range(0, n_tiles):
        more = (kb + 1 < n_tiles).to(tl.int32)
        w_ptrs += more * w_step
        x_ptrs += more * BLOCK_K
        w_next = tl.load(w_ptrs)
        if MODE == 2:  # x as two int8 limbs (hi signed, lo unsigned) of a 16-bit fixed point: dp4a, no dequant
            xh_ptrs += more * WORDS
            xl_ptrs += more * WORDS
            xh_next = tl.load(xh_ptrs)
            xl_next = tl.load(xl_ptrs)
            acc_h = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                              [w, xh[None, :] + tl.zeros_like(w), acc_h], dtype=tl.int32,
                                              is_pure=True, pack=1)
            acc_l = tl.inline_asm_elementwise("dp4a.s32.u32 $0, $1, $2, $3;", "=r,r,r,r",
                                              [w, xl[None, :] + tl.zeros_like(w), acc_l], dtype=tl.int32,
                                              is_pure=True, pack=1)
            xh = xh_next
            xl = xl_next
        else:
            x_next = tl.load(x_ptrs)
            if MODE == 0:
                w0, w1, w2, w3 = words_to_fp32_exact(w, PRMT)
                acc = fma_words(acc, w0, w1, w2, w3, x, WORDS)
            else:
                bits = bits ^ w
            x = x_next
        w = w_next
    if MODE == 0:
        out = tl.sum(acc, axis=1) * tl.load(scale_ptr + pid * BLOCK_N + rows).to(tl.float32)
    elif MODE == 2:
        dot = tl.sum(acc_h.to(tl.float32) * 256.0 + acc_l.to(tl.float32), axis=1)
        out = dot * x_scale * tl.load(scale_ptr + pid * BLOCK_N + rows).to(tl.float32)
    else:
        out = tl.sum(bits, axis=1).to(tl.float32)
    tl.store(out_ptr + pid * BLOCK_N + rows, out.to(out_ptr.dtype.element_ty))


def tiled(q: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    n, k = q.shape
    return q.view(n // block_n, block_n, k // block_k, block_k).permute(0, 2, 1, 3).contiguous().view(n, k)


def launch_probe(w: torch.Tensor, scale: torch.Tensor, *, x: torch.Tensor, out: torch.Tensor,
                 limbs: tuple[torch.Tensor, torch.Tensor, float], n: int, k: int, block_n: int, block_k: int,
                 warps: int, mode: int, run: int) -> None:
    """One probe launch over ``w`` (int32 words of an ``[n, k]`` int8 weight) into ``out``."""
    x_hi, x_lo, x_scale = limbs
    probe_kernel[(n // block_n,)](x, w, scale, out, k, x_hi, x_lo, x_scale, BLOCK_N=block_n, BLOCK_K=block_k,
                                  TILED=0, MODE=mode, RUN=run, num_warps=warps)


def limbs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """x [K] as a 16-bit fixed point with one scale, split in two int8 limbs packed four to an int32 word: the
    high limb signed, the low one unsigned (``q = 256 * hi + lo``)."""
    scale = x.float().abs().max().item() / 32767.0
    q = torch.round(x.float() / scale).to(torch.int32)
    hi = torch.div(q, 256, rounding_mode="floor")
    lo = q - 256 * hi
    return (hi.to(torch.int8).view(torch.int32), lo.to(torch.uint8).view(torch.int8).view(torch.int32), scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    from inference_server.kernels.int8_linear import int8_linear
    from inference_server.kernels.reference_int8 import quantize_int8_per_channel

    device = torch.device("cuda")
    l2 = device_l2_bytes(device)
    gen = torch.Generator(device).manual_seed(0)
    print(f"# one-token int8 GEMV probe on {torch.cuda.get_device_name()}, triton {triton.__version__}; cells: µs "
          f"(fraction of 4.3 TB/s), median of {a.reps} graph replays")
    print("| shape | config (n, k, warps) | fp32 math, 8 B | read only, 8 B | dp4a, 8 B | dp4a, 16 B "
          "| read only, 16 B |")
    print("|---|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        copies = rotation(n * k, l2)
        quantized = [quantize_int8_per_channel(torch.randn(n, k, generator=gen, device=device,
                                                           dtype=torch.bfloat16)) for _ in range(copies)]
        x = torch.randn(1, k, generator=gen, device=device, dtype=torch.bfloat16)
        x_hi, x_lo, x_scale = limbs(x.view(-1))
        out = torch.empty(n, device=device, dtype=torch.bfloat16)
        nbytes = n * k + 2 * k + 4 * n
        engine = [functools.partial(int8_linear, x, q, s) for q, s in quantized]
        engine_s = time_calls([engine[i % copies] for i in range(calls_per_graph(copies))], device, a.reps)
        expected = int8_linear(x, *quantized[0]).float().view(-1)
        print(f"| {name} [{n}x{k}] | engine (tuned) | {engine_s * 1e6:.1f} ({nbytes / engine_s / HBM_BYTES_PER_S:.2f})"
              f" | | | | |", flush=True)
        weights = [q.view(torch.int32) for q, _ in quantized]
        for block_n, block_k, warps in CONFIGS:
            if k % block_k or n % block_n:
                continue
            cells = []
            for mode, run in ((0, 2), (1, 2), (2, 2), (2, 4), (1, 4)):
                launch = dict(x=x, out=out, limbs=(x_hi, x_lo, x_scale), n=n, k=k, block_n=block_n, block_k=block_k,
                              warps=warps, mode=mode, run=run)
                if mode != 1:
                    launch_probe(weights[0], quantized[0][1], **launch)
                    err = (out.float() - expected).abs().max().item()
                    if err > 2**-6 * expected.abs().max().item():
                        raise SystemExit(f"probe output differs on {name} ({block_n}, {block_k}, {warps}) mode "
                                         f"{mode}: {err}")
                calls = [functools.partial(launch_probe, w, q[1], **launch)
                         for w, q in zip(weights, quantized, strict=True)]
                secs = time_calls([calls[i % copies] for i in range(calls_per_graph(copies))], device, a.reps)
                cells.append(f"{secs * 1e6:.1f} ({nbytes / secs / HBM_BYTES_PER_S:.2f})")
            print(f"| {name} | {block_n}, {block_k}, {warps} | " + " | ".join(cells) + " |", flush=True)
        del weights
        del quantized
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
