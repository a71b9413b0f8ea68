"""Decode attention a layer call, as the decode graphs run it: the default split-K kernel (``paged_decode_attention``)
against ``DETERMINISTIC``'s two ways, the aligned prefill kernel on one-token chunks (what it ran at decode before
``kernels/invariant_decode_attention.py``) and the split decode kernel (also with 16-row query tiles, the smallest
``tl.dot`` takes: the G heads of a decode query fill 2-8 of the prefill tile's 32-128 rows; and with 128-key splits
instead of ``KV_SPLIT_KEYS``'s 256: either would change the prefill's bits too), at Gemma-4-26B-A4B's
sliding and full layers and Qwen3-30B-A3B's layer, several batches and contexts. Each KV cache is cycled through
enough copies that a call's keys are not in L2 from the previous one (``kit.graph_timing.rotation``), every sequence at
the same context.

Run on the device machine from the project root: ``python3 bench/invariant_attention_bench.py`` (~1-2 minutes);
``TRITON_INTERPRET=1 uv run python bench/invariant_attention_bench.py --quick`` is a CPU dry run (tiny shapes, no
figures). Prints one markdown table, microseconds per call (median of the graph replays).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kit.graph_timing import calls_per_graph, rotation, time_calls  # bench/ is on the path

LAYERS = {  # name: (q heads, kv heads, head_dim, window)
    "26B-A4B sliding": (16, 8, 256, 1024),
    "26B-A4B full": (16, 2, 512, None),
    "Qwen3-30B-A3B": (32, 4, 128, None),
}
MAX_MODEL_LEN = 32768
PAGE = 16


def paged_cache(batch: int, ctx: int, kv_heads: int, dim: int, device: torch.device, gen: torch.Generator):
    """K/V caches holding ``batch`` sequences of ``ctx`` keys in shuffled blocks, their tables and lengths."""
    blocks = -(-ctx // PAGE)
    k = torch.randn(batch * blocks + 1, PAGE, kv_heads, dim, generator=gen, device=device).to(torch.bfloat16)
    v = torch.randn_like(k)
    tables = (1 + torch.randperm(batch * blocks, generator=gen, device=device)).view(batch, blocks).int()
    return k, v, tables, torch.full((batch,), ctx, dtype=torch.int32, device=device)


def bench(layer: str, batch: int, ctx: int, device: torch.device, reps: int) -> dict[str, float]:
    # imported here: TRITON_INTERPRET (a CPU dry run) must be set before the kernels are decorated
    from inference_server.kernels.decode_attention import paged_decode_attention
    from inference_server.kernels.invariant_decode_attention import invariant_decode_attention
    from inference_server.kernels.prefill_attention import paged_prefill_attention

    heads, kv_heads, dim, window = LAYERS[layer]
    gen = torch.Generator(device=device).manual_seed(0)
    cache_bytes = 2 * batch * ctx * kv_heads * dim * 2
    copies = rotation(cache_bytes) if device.type == "cuda" else 1
    caches = [paged_cache(batch, ctx, kv_heads, dim, device, gen) for _ in range(copies)]
    q = (torch.randn(batch, heads, dim, generator=gen, device=device) * dim**-0.25).to(torch.bfloat16)
    out = torch.empty_like(q)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    scale = dim**-0.5
    kernels = {
        "default split-K": lambda k, v, t, c: paged_decode_attention(q, k, v, t, c, scale, window, out=out,
                                                                      max_context_len=MAX_MODEL_LEN),
        "aligned prefill, 1-token chunks": lambda k, v, t, c: paged_prefill_attention(q, k, v, t, cu, c, scale, window,
                                                                                      out=out, align_kv=True),
        "split decode (deterministic)": lambda k, v, t, c: invariant_decode_attention(q, k, v, t, c, scale, window,
                                                                                      out=out,
                                                                                      max_context_len=MAX_MODEL_LEN),
        # what 16-row query tiles would give (the prefill would have to take them too: the bits follow BLOCK_M)
        "split decode, BLOCK_M 16": lambda k, v, t, c: invariant_decode_attention(q, k, v, t, c, scale, window,
                                                                                  out=out, block_m=16,
                                                                                  max_context_len=MAX_MODEL_LEN),
        # what 128-key splits would give (KV_SPLIT_KEYS is 256: the prefill takes the constant too)
        "split decode, S 128": lambda k, v, t, c: invariant_decode_attention(q, k, v, t, c, scale, window, out=out,
                                                                             split_keys=128,
                                                                             max_context_len=MAX_MODEL_LEN),
    }
    result = {}
    for name, fn in kernels.items():
        calls = [functools.partial(fn, *caches[i % copies]) for i in range(calls_per_graph(copies))]
        result[name] = time_calls(calls, device, reps)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a dry run of the script)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches, contexts = ((1, 64), (540, 2048, 8192)) if not args.quick else ((2,), (40,))
    layers = list(LAYERS) if not args.quick else ["26B-A4B sliding"]
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (dry run)'}; "
          f"MAX_MODEL_LEN {MAX_MODEL_LEN}; microseconds per call\n")
    header = None
    for layer in layers:
        for batch in batches:
            for ctx in contexts:
                row = bench(layer, batch, ctx, device, args.reps if not args.quick else 1)
                if header is None:
                    header = list(row)
                    print("| layer | B | context | " + " | ".join(header) + " |")
                    print("|---|---|---|" + "---|" * len(header))
                print(f"| {layer} | {batch} | {ctx} | " + " | ".join(f"{row[h] * 1e6:.1f}" for h in header) + " |")


if __name__ == "__main__":
    main()
