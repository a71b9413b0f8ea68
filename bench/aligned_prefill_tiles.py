"""What ``DETERMINISTIC``'s query tile (``prefill_attention.ALIGNED_BLOCK_M`` rows, shared with the invariant decode
kernel) costs a long prompt's prefill attention: one 8,192-query chunk at 8,192 and at 30,000 keys (the chunk
ending the prompt), per layer kind of Gemma-4-26B-A4B (sliding D 256, full D 512) and Qwen3-30B-A3B (D 128), bf16,
timed with CUDA events (median of ``--reps``): the aligned kernel on its tile, the aligned kernel on the small
tiles' rows it used before (64 / 32 / 128), and the default (unaligned, long-chunk) kernel. The per-layer-kind µs
times the model's layers of that kind give the prompt's attention cost in each mode.

  python3 bench/aligned_prefill_tiles.py        # on the device, ~30 s with compiles
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from inference_server.kernels.prefill_attention import ALIGNED_BLOCK_M, paged_prefill_attention

# (model, layer kind, layers of that kind, query heads, kv heads, head dim, window, rows of the old aligned tile)
LAYER_KINDS = (
    ("gemma-4-26b-a4b", "sliding", 25, 16, 8, 256, 1024, 64),
    ("gemma-4-26b-a4b", "full", 5, 16, 2, 512, None, 32),
    ("qwen3-30b-a3b", "full", 48, 32, 4, 128, None, 128),
)
CHUNK = 8192
PAGE = 16


def time_call(call: object, reps: int) -> float:
    """Median seconds of ``call()`` (CUDA events; compiled and warmed first)."""
    assert callable(call)
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"| model | layer kind | keys | aligned {ALIGNED_BLOCK_M}-row ms | aligned old-row ms | default ms "
          f"| x layers: aligned / old / default ms |\n|---|---|---|---|---|---|---|")
    for model, kind, layers, heads, kv_heads, dim, window, old_rows in LAYER_KINDS:
        for keys in (8192, 30000):
            blocks = -(-keys // PAGE)
            gen = torch.Generator(device).manual_seed(keys + dim)
            k_cache = torch.randn(blocks, PAGE, kv_heads, dim, generator=gen, device=device, dtype=torch.bfloat16)
            v_cache = torch.randn_like(k_cache)
            q = torch.randn(CHUNK, heads, dim, generator=gen, device=device, dtype=torch.bfloat16)
            tables = torch.arange(blocks, dtype=torch.int32, device=device)[None]
            cu = torch.tensor([0, CHUNK], dtype=torch.int32, device=device)
            ctx = torch.tensor([keys], dtype=torch.int32, device=device)
            out = torch.empty_like(q)
            args_ = (q, k_cache, v_cache, tables, cu, ctx, dim ** -0.5, window)

            def run(block_m: int | None, aligned: bool, call_args: tuple = args_, out: torch.Tensor = out) -> None:
                paged_prefill_attention(*call_args, out=out, block_m=block_m, align_kv=aligned)

            now = time_call(lambda: run(None, True), args.reps)
            old = time_call(lambda rows=old_rows: run(rows, True), args.reps)
            default = time_call(lambda: run(None, False), args.reps)
            print(f"| {model} | {kind} | {keys:,} | {now * 1e3:.2f} | {old * 1e3:.2f} | {default * 1e3:.2f} "
                  f"| {layers * now * 1e3:.0f} / {layers * old * 1e3:.0f} / {layers * default * 1e3:.0f} |")
            del k_cache, v_cache, q
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
