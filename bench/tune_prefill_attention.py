#!/usr/bin/env python3
"""Time the paged prefill attention's tile configs on this GPU, per attention layer kind of the MoE models.

For each layer kind (Qwen3-30B-A3B head_dim 128; Gemma-4-26B-A4B sliding head_dim 256 and full head_dim 512, heads
and window from the presets) one chunk of ``--chunk`` queries at the end of a ``--context``-token prompt (the last
chunk of a chunked prefill, random bf16 K/V in 16-token pages) runs ``kernels.prefill_attention`` with each
``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` candidate, timed by ``kit.graph_timing.time_calls`` (median of
``--reps`` CUDA-graph replays after a warm-up; wall time on the CPU); a candidate counts only if its output equals
the current config's within bf16 rounding, and one that fails to compile (shared memory, registers) is listed as
such. Prints one table per layer kind, fastest first,
with the attention TFLOP/s (causal: 2 x 2 x visible keys x head_dim FLOPs per query and head).

  python3 bench/tune_prefill_attention.py                     # on the H200, ~1-2 minutes
  TRITON_INTERPRET=1 uv run python bench/tune_prefill_attention.py --context 40 --chunk 16 --quick 2  # dry run
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from inference_server.kernels import prefill_attention  # noqa: E402
from inference_server.models.loading.presets import preset_config  # noqa: E402
from inference_server.models.spec import parse_model_spec  # noqa: E402
from kit.graph_timing import time_calls  # noqa: E402

CANDIDATES = {  # head_dim: (BLOCK_M, BLOCK_N, num_warps, num_stages) to try
    128: list(itertools.product((128,), (64, 128), (4, 8), (2, 3, 4))),
    256: list(itertools.product((64, 128), (32, 64), (8,), (2, 3))),
    512: list(itertools.product((32, 64), (32, 64), (8,), (1, 2))),
}


def layer_kinds() -> list[tuple[str, int, int, int, int | None]]:
    """(name, query heads, kv heads, head_dim, window) of each attention layer kind of the two MoE models."""
    kinds = []
    for model in ("qwen3-30b-a3b", "gemma-4-26b-a4b"):
        spec = parse_model_spec(preset_config(model))
        seen = set()
        for layer in spec.cache_layers:
            key = (layer.num_kv_heads, layer.head_dim, layer.window)
            if key not in seen:
                seen.add(key)
                kinds.append((f"{model} D={layer.head_dim}" + (f" window {layer.window}" if layer.window else ""),
                              spec.num_attention_heads, *key))
    return kinds


def time_kind(heads: int, kv_heads: int, head_dim: int, window: int | None, context: int, chunk: int, reps: int,
              quick: int, device: torch.device) -> list[tuple[str, float | None, tuple[int, int, int, int]]]:
    page = 16
    gen = torch.Generator(device="cpu").manual_seed(head_dim)
    blocks = -(-context // page)
    k_cache = (torch.randn(blocks, page, kv_heads, head_dim, generator=gen) * head_dim ** -0.25).to(device,
                                                                                                    torch.bfloat16)
    v_cache = torch.randn(blocks, page, kv_heads, head_dim, generator=gen).to(device, torch.bfloat16)
    q = (torch.randn(chunk, heads, head_dim, generator=gen) * head_dim ** -0.25).to(device, torch.bfloat16)
    tables = torch.randperm(blocks, generator=gen).to(device, torch.int32)[None, :]
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    ctx = torch.tensor([context], dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, tables, cu, ctx, head_dim ** -0.5, window)
    current = prefill_attention._prefill_config(head_dim, small_tiles=False)
    expected = prefill_attention.paged_prefill_attention(*args).float()
    results = []
    original = prefill_attention._prefill_config
    candidates = [current] + [c for c in CANDIDATES[max(k for k in CANDIDATES if k <= max(head_dim, 128))]
                              if c != current]
    for config in candidates[:quick] if quick else candidates:
        prefill_attention._prefill_config = lambda _d, _small=True, config=config: config
        try:
            out = prefill_attention.paged_prefill_attention(*args)
            error = (out.float() - expected).abs().max().item()
            if error > 2 ** -6 * expected.abs().max().item():
                results.append((f"differs {error:.1e}", None, config))
                continue
            call = functools.partial(prefill_attention.paged_prefill_attention, *args, out=out)
            results.append(("ok", time_calls([call], device, reps), config))
        except Exception as err:  # out of shared memory or registers: not a candidate
            results.append((f"failed: {type(err).__name__}", None, config))
        finally:
            prefill_attention._prefill_config = original
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--quick", type=int, default=0, help="time only the first N candidates (dry runs)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name, heads, kv_heads, head_dim, window in layer_kinds():
        keys = sum(min(args.context - args.chunk + i + 1, window or args.context) for i in range(args.chunk))
        flops = 4.0 * keys * head_dim * heads
        print(f"\n{name}: {heads} heads / {kv_heads} kv heads, {args.chunk} queries at the end of {args.context} keys")
        print("| BLOCK_M | BLOCK_N | warps | stages | us | TFLOP/s | status |\n|---|---|---|---|---|---|---|")
        rows = time_kind(heads, kv_heads, head_dim, window, args.context, args.chunk, args.reps, args.quick, device)
        current = rows[0][2]
        for status, seconds, config in sorted(rows, key=lambda r: (r[1] is None, r[1] or 0.0)):
            mark = " (current)" if config == current else ""
            us = f"{seconds * 1e6:.1f}" if seconds else "-"
            tflops = f"{flops / seconds / 1e12:.0f}" if seconds else "-"
            print(f"| {config[0]} | {config[1]} | {config[2]} | {config[3]} | {us} | {tflops} | {status}{mark} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
