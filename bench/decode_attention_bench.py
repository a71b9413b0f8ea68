#!/usr/bin/env python3
"""The paged decode attention alone at small batch: µs a launch per layer shape, against its memory-limited time.

At batch 1 a decode attention reads a few MB of K/V but is a chain of dependent memory round trips (context
length, block table, K and V pages, the split partials and their merge), so its time is latency, not bytes; in
Gemma-4-31B int8's B=1 step it took 1.2 ms of 8.8 (``bench/ablate_decode.py``). Each case captures a CUDA graph
of ``--launches`` back-to-back launches of one layer (PDL off, so that every launch runs alone; the step's graph
overlaps their edges) and reports the median over 3 replays of the µs a launch, the split count, and the limit
``K/V bytes / 4.3 TB/s``.

``--old DIR`` also times the decode attention of another tree (``DIR/src/inference_server/kernels/
decode_attention.py``, e.g. an archive of the previous commit) on the same inputs, and checks that the two agree.

  python3 bench/decode_attention_bench.py --contexts 527,2048 --old .old
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
from pathlib import Path

import torch

from inference_server.kernels import decode_attention
from inference_server.kernels.pdl import use_pdl

HBM_BYTES_PER_S = 4.3e12
# (name, kv heads, query heads per kv head, head dim, window): the layers of the models at their real configs
LAYERS = (
    ("gemma-4-31b sliding", 16, 2, 256, 1024),
    ("gemma-4-31b full", 4, 8, 512, None),
    ("gemma-4-26b-a4b sliding", 8, 2, 256, 1024),
    ("gemma-4-26b-a4b full", 2, 8, 512, None),
    ("gemma-4-e4b sliding", 2, 4, 256, 512),
    ("gemma-4-e4b full", 2, 4, 512, None),
    ("qwen3-30b-a3b", 4, 8, 128, None),
)


def load_module(tree: Path):
    path = tree / "src/inference_server/kernels/decode_attention.py"
    spec = importlib.util.spec_from_file_location("decode_attention_of_" + tree.name.strip("."), path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_launches(fn, launches: int) -> float:
    """Median over 3 replays of the µs a launch of ``fn`` (a graph of ``launches`` back-to-back calls)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="527,2048")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--max-model-len", type=int, default=32768, help="the split choice's bound (a server's length)")
    ap.add_argument("--splits", default="auto", help="auto (choose_num_splits) and/or fixed counts, e.g. auto,1,16")
    ap.add_argument("--launches", type=int, default=60)
    ap.add_argument("--layers", default="", help="comma-separated layer names of LAYERS (default: all)")
    ap.add_argument("--block-n", default="auto", help="key tiles to sweep: auto (the kernel's) and/or sizes")
    ap.add_argument("--stages", default="auto", help="pipeline depths to sweep: auto (the kernel's) and/or depths")
    ap.add_argument("--warps", default="auto", help="warps to sweep: auto (the kernel's) and/or counts")
    ap.add_argument("--old", type=Path, default=None)
    a = ap.parse_args()
    use_pdl(False)
    modules = [("new", decode_attention)] + ([("old", load_module(a.old))] if a.old else [])
    gen = torch.Generator(device="cuda").manual_seed(0)
    page = 16
    print(f"{'layer':<24} {'B':>3} {'ctx':>5} {'splits':>6} {'tile':>4} {'st':>2} {'w':>2} {'limit µs':>8} "
          + " ".join(f"{name + ' µs':>9}" for name, _ in modules) + "   max |new - old|")
    chosen = {n.strip() for n in a.layers.split(",") if n.strip()}
    tunings = [(None if n == "auto" else int(n), None if st == "auto" else int(st), None if w == "auto" else int(w))
               for n in a.block_n.split(",") for st in a.stages.split(",") for w in a.warps.split(",")]
    for name, kv_heads, group, head_dim, window in LAYERS:
        if chosen and name not in chosen:
            continue
        for batch in (int(b) for b in a.batches.split(",")):
            for ctx in (int(c) for c in a.contexts.split(",")):
                blocks = -(-ctx // page)
                k_cache = torch.randn(batch * blocks + 1, page, kv_heads, head_dim, device="cuda",
                                      dtype=torch.bfloat16, generator=gen)
                v_cache = torch.randn_like(k_cache)
                perm = torch.randperm(batch * blocks, device="cuda", generator=gen).to(torch.int32)
                tables = torch.zeros(batch, -(-a.max_model_len // page) + 1, dtype=torch.int32, device="cuda")
                tables[:, :blocks] = perm.view(batch, blocks)
                lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
                q = torch.randn(batch, kv_heads * group, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                visible = min(ctx, window) if window else ctx
                limit_us = 2 * batch * visible * kv_heads * head_dim * 2 / HBM_BYTES_PER_S * 1e6
                for splits in a.splits.split(","):
                    count = None if splits == "auto" else int(splits)
                    for block_n, stages, warps in tunings:
                        times, outs = [], []
                        for _, module in modules:
                            out = torch.empty_like(q)
                            tuning: dict[str, int | None] = dict(block_n=block_n)
                            if stages is not None:  # else the kernel's (an older tree's may not take None)
                                tuning["num_stages"] = stages
                            if warps is not None:
                                tuning["num_warps"] = warps
                            call = functools.partial(module.paged_decode_attention, q, k_cache, v_cache, tables, lens,
                                                     head_dim ** -0.5, window, count, max_context_len=a.max_model_len,
                                                     out=out, **tuning)
                            try:
                                times.append(time_launches(call, a.launches))
                            except Exception as err:  # e.g. a tile and depth past the shared memory: skip it
                                times.append(float("nan"))
                                print(f"# {name} B={batch} splits={splits} tile={block_n} st={stages} w={warps}: "
                                      f"{type(err).__name__}", flush=True)
                            outs.append(out)
                        bound = min(a.max_model_len, window) if window else a.max_model_len
                        shown = count or decode_attention.choose_num_splits(batch, kv_heads, bound)
                        diff = (outs[0].float() - outs[1].float()).abs().max().item() if len(outs) > 1 \
                            else float("nan")
                        print(f"{name:<24} {batch:>3} {ctx:>5} {shown:>6} {block_n or 'auto':>4} {stages or 'a':>2} "
                              f"{warps or 'a':>2} {limit_us:>8.2f} " + " ".join(f"{t:>9.2f}" for t in times)
                              + f"   {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
