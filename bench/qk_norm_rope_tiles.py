#!/usr/bin/env python3
"""Experiment (branch ``qknr-tokens``): ``kernels.qk_norm_rope`` with a block of tokens per program against one token
per program, at the served models' head shapes and step sizes, as the runner calls it (the paged K/V store in the
same launch).

The question: at prefill sizes the one-(token, head)-row program moved 2-4 bytes a thread with scalar loads, and the
engine profile of an 8,192-token step of Gemma-4-26B-A4B gave the kernel 9.0 ms (30 launches, ~300 µs each, about a
quarter of the bytes it moves at HBM speed; ``bench/results/long-context-2026-12-04.md``). The candidate's program
takes ``_tokens_per_program(head_dim / 2)`` tokens of one head (a 1,024-element tile a half: 16-byte loads and
stores). "one" is the same kernel with one token a program (``_TILE_ELEMENTS = 1``), i.e. today's tile shape.

For each shape and token count: µs per call (``kit.graph_timing.time_calls``, median of ``--reps`` CUDA-graph
replays, inputs cycled over copies past 2x the L2), the GB/s of the bytes a call moves (q/k/v in, q/k/v out, the K/V
rows stored, the rope rows), and the largest difference between the two outputs in bf16 ulps of the output
(they may differ in the order of the fp32 sum of squares).

  python3 bench/qk_norm_rope_tiles.py                 # on the GPU, ~1 minute
  TRITON_INTERPRET=1 uv run python bench/qk_norm_rope_tiles.py --tokens 1,20 --reps 1   # dry run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from inference_server.kernels import qk_norm_rope as module  # noqa: E402
from inference_server.kernels.qk_norm_rope import PagedKVWrite, qk_norm_rope  # noqa: E402
from kit.graph_timing import calls_per_graph, device_l2_bytes, rotation, time_calls  # noqa: E402

# (name, q heads, kv heads, head_dim, mode, value norm): the runner's store calls
SHAPES = (
    ("gemma-4-26b-a4b sliding", 16, 8, 256, "gemma", True),
    ("gemma-4-26b-a4b full (K = V)", 16, 2, 512, "gemma", True),
    ("qwen3-30b-a3b", 32, 4, 128, "qwen", False),
)
PAGE = 16


def _case(tokens: int, heads: int, kv_heads: int, head_dim: int, norm_v: bool, device: torch.device,
          seed: int) -> tuple[list[torch.Tensor], PagedKVWrite]:
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    fused = (torch.randn(tokens, width, generator=gen) * 2).to(device, torch.bfloat16)
    q, k, v = (p.unflatten(-1, (-1, head_dim)) for p in fused.split([heads * head_dim, kv_heads * head_dim,
                                                                      kv_heads * head_dim], dim=-1))
    weights = [(1 + 0.3 * torch.randn(head_dim, generator=gen)).to(device, torch.bfloat16) for _ in range(2)]
    angles = torch.arange(tokens).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(device, torch.bfloat16), emb.sin().to(device, torch.bfloat16)
    blocks = -(-tokens // PAGE)
    k_cache = torch.zeros(blocks, PAGE, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(blocks * PAGE, generator=gen)[:tokens].to(device)
    write = PagedKVWrite(k_cache, v_cache, slots, value=None if norm_v else v)
    return [q, k, v if norm_v else None, *weights, cos, sin], write


def _call(args: list[torch.Tensor | None], write: PagedKVWrite, mode: str) -> tuple:
    q, k, v, q_w, k_w, cos, sin = args
    return qk_norm_rope(q, k, v, q_w, k_w, 1e-6, mode, cos, sin, cache=write)  # type: ignore[arg-type]


def _bytes(tokens: int, heads: int, kv_heads: int, head_dim: int) -> int:
    rows_in = heads + 2 * kv_heads
    return tokens * head_dim * 2 * (2 * rows_in + 2 * kv_heads + 2)  # in, out, cache rows, cos + sin


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest difference in bf16 ulps (as ordered integers of the bit patterns)."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    ai = torch.where(ai < 0, -32768 - ai, ai)
    bi = torch.where(bi < 0, -32768 - bi, bi)
    return int((ai - bi).abs().max()) if a.numel() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,64,256,2048,8192", help="step token counts")
    parser.add_argument("--reps", type=int, default=5)
    options = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    l2 = device_l2_bytes(device)
    tile_elements = module._TILE_ELEMENTS
    print("| shape | tokens | one token a program µs | block of tokens µs (tokens) | speed-up | GB/s one / block "
          "| max ulps apart |")
    print("|---|---|---|---|---|---|---|")
    for name, heads, kv_heads, head_dim, mode, norm_v in SHAPES:
        for tokens in (int(t) for t in options.tokens.split(",")):
            moved = _bytes(tokens, heads, kv_heads, head_dim)
            copies = rotation(moved, l2) if l2 else 1
            cases = [_case(tokens, heads, kv_heads, head_dim, norm_v, device, seed) for seed in range(copies)]
            calls = [lambda a=a, w=w, m=mode: _call(a, w, m) for a, w in cases]
            times, outputs = {}, {}
            for label, elements in (("one", 1), ("block", tile_elements)):
                module._TILE_ELEMENTS = elements
                try:
                    outputs[label] = [t.clone() if t is not None else None for t in calls[0]()]
                    times[label] = time_calls(calls * (calls_per_graph(copies) // copies), device, options.reps)
                finally:
                    module._TILE_ELEMENTS = tile_elements
            apart = max(_ulps(a, b) for a, b in zip(outputs["one"], outputs["block"], strict=True) if a is not None)
            one, block = times["one"] * 1e6, times["block"] * 1e6
            per_program = module._tokens_per_program(1 << (head_dim // 2 - 1).bit_length())
            print(f"| {name} | {tokens} | {one:.1f} | {block:.1f} ({per_program}) | {one / block:.2f}x "
                  f"| {moved / one / 1e3:.0f} / {moved / block / 1e3:.0f} | {apart} |", flush=True)


if __name__ == "__main__":
    main()
