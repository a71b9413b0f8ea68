#!/usr/bin/env python3
"""Probe (issue 43): does the deterministic decode attention keep the aligned prefill's bits with a query tile of
``max(16, G)`` rows instead of the prefill's ``BLOCK_M``, and how much faster is it?

``kernels.invariant_decode_attention`` computes each KV split's state on a query tile of the aligned prefill's
``BLOCK_M`` rows (64 for head_dim 256, 32 for 512, 128 for 128) although a decode query fills only G of them (2 for
Gemma-4-26B-A4B's sliding layers, 8 for its full layers and for Qwen3-30B-A3B): 8-62 rows of padding whose dots the
tensor cores still compute. At B=64 on 26B-A4B it took 5,152 µs a step against the default kernel's 2,257
(docs/benchmarks.md, "Deterministic inference"). A row's result may not depend on the tile's height (the
deterministic GEMM's rows did not, over token tiles 16-128: ``28edb9c``), but a 16-row tile may run other MMA
instructions (``mma.sync`` instead of ``wgmma``), so only the GPU can say.

For each layer kind, batch and context (bf16, random K/V in shuffled 16-token pages): the kernel at today's tile and at
each smaller candidate (``block_m``; ``tile_config`` raises it to G at least), the number of output elements that
differ from today's (which the GPU suite holds bitwise to the aligned prefill) and µs per call
(``kit.graph_timing.time_calls``, median of ``--reps`` CUDA-graph replays). A candidate with 0 differing elements at
every point may become the decode tile (with the GPU suite's prefill-bits tests run at it).

  python3 bench/invariant_decode_tiles.py                 # on the GPU, ~1 minute
  TRITON_INTERPRET=1 uv run python bench/invariant_decode_tiles.py --batches 2 --contexts 40 --reps 1 --split-keys 32
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from inference_server.kernels.invariant_decode_attention import invariant_decode_attention  # noqa: E402
from inference_server.kernels.prefill_attention import tile_config  # noqa: E402
from kit.graph_timing import time_calls  # noqa: E402

# (name, query heads, kv heads, head_dim, window)
LAYERS = (("gemma-4-26b-a4b sliding", 16, 8, 256, 1024), ("gemma-4-26b-a4b full", 16, 2, 512, None),
          ("qwen3-30b-a3b", 32, 4, 128, None), ("gemma-4-e4b sliding", 8, 2, 256, 512))
PAGE = 16


def _paged(batch: int, context: int, kv_heads: int, head_dim: int, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-context // PAGE)
    num_blocks = batch * blocks + 1
    k_cache = (torch.randn(num_blocks, PAGE, kv_heads, head_dim, generator=gen) * head_dim**-0.25).to(device,
                                                                                                      torch.bfloat16)
    v_cache = torch.randn(num_blocks, PAGE, kv_heads, head_dim, generator=gen).to(device, torch.bfloat16)
    block_tables = (1 + torch.randperm(num_blocks - 1, generator=gen)).view(batch, blocks).to(device, torch.int32)
    # contexts spread over the last page and a split boundary, as a batch's are
    lens = torch.tensor([max(1, context - (b * 37) % PAGE) for b in range(batch)], dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="527,2048")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--split-keys", type=int, default=None, help="dry runs: a split size below the default")
    options = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print("| layer | batch | context | tile rows (today) | µs today | candidate rows: µs (elements differing) |")
    print("|---|---|---|---|---|---|")
    for name, heads, kv_heads, head_dim, window in LAYERS:
        group = heads // kv_heads
        today = tile_config(head_dim, group)[0]
        candidates = sorted({tile_config(head_dim, group, m)[0] for m in (16, 32, 64)} - {today})
        candidates = [m for m in candidates if m < today]
        for batch in (int(b) for b in options.batches.split(",")):
            for context in (int(c) for c in options.contexts.split(",")):
                k_cache, v_cache, tables, lens = _paged(batch, context, kv_heads, head_dim, device, batch + context)
                gen = torch.Generator().manual_seed(7)
                q = (torch.randn(batch, heads, head_dim, generator=gen) * head_dim**-0.25).to(device, torch.bfloat16)
                kwargs = dict(max_context_len=context, split_keys=options.split_keys)
                attend = functools.partial(invariant_decode_attention, q, k_cache, v_cache, tables, lens,
                                           head_dim**-0.5, window, **kwargs)
                reference = attend()
                cells = []
                today_us = time_calls([attend] * 8, device, options.reps) * 1e6
                for rows in candidates:
                    out = attend(block_m=rows)
                    differ = int((out != reference).sum())
                    us = time_calls([functools.partial(attend, block_m=rows)] * 8, device, options.reps) * 1e6
                    cells.append(f"{rows}: {us:.1f} ({differ})")
                print(f"| {name} | {batch} | {context} | {today} | {today_us:.1f} | {'; '.join(cells) or '-'} |",
                      flush=True)


if __name__ == "__main__":
    main()
