"""The attention output projection's weights prefetched into L2 while the decode attention runs
(its kernel is here): µs per layer of [attention -> o GEMV], with and without the
prefetch, at batch 1 and the real shapes.

At one token the decode attention is latency (a few µs for ~1 MB of K/V) and HBM idles under it; the o projection
after it streams 10-90 MB. Each row times one CUDA graph of ``--layers`` layers over distinct weight copies (so no
copy is in L2 from its previous read), PDL on as in the engine, median of ``--reps`` replays:

* ``gemv``: the o GEMV alone, from HBM; ``gemv L2``: the same weight every call (in L2: the ceiling);
* ``attn``: the attention alone;
* ``attn+gemv``: the two in a chain, as the engine runs them;
* ``pf+attn+gemv``: a prefetch launch of the layer's o weight (its first ``--max-mb`` MB) before the attention, at
  each ``--chunks`` size (bytes a thread asks for);
* ``pf+gemv``: the prefetch right before the GEMV (no window: what the launch itself costs);
* ``side``: the prefetch launched on a second stream forked from the first before the attention (a parallel branch of
  the graph, joined once after the last layer), so that its completion holds nothing up.

  python3 bench/l2_prefetch.py                      # on the H200: every layer shape; ~1 min
  python3 bench/l2_prefetch.py --only qwen3-30b-a3b --chunks 4096,16384,65536
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton
import triton.language as tl

from graph_timing import time_calls  # bench/ is on the path
from inference_server.backends.cuda_backend import triton_dense_linear
from inference_server.kernels import decode_attention
from inference_server.kernels.pdl import pdl_launch, pdl_release, pdl_wait, use_pdl

HBM_BYTES_PER_S = 4.3e12
_THREADS = 32
"""Prefetches a program issues by default: one warp, one each."""
# (name, kv heads, query heads per kv head, head dim, window, hidden size): the attention layers at their configs
SHAPES = (
    ("qwen3-30b-a3b", 4, 8, 128, None, 2048),
    ("gemma-4-26b-a4b sliding", 8, 2, 256, 1024, 2816),
    ("gemma-4-26b-a4b full", 2, 8, 512, None, 2816),
    ("gemma-4-e4b sliding", 2, 4, 256, 512, 2560),
    ("gemma-4-e4b full", 2, 4, 512, None, 2560),
    ("gemma-4-31b sliding", 16, 2, 256, 1024, 5376),
)


@triton.jit
def _bulk_prefetch_l2(addresses, sizes):
    """One ``cp.async.bulk.prefetch.L2.global`` per element: ``sizes`` bytes (a multiple of 16) from ``addresses``
    (16-byte aligned, as int64) into L2. The result is a dummy; the asm is not pure, so it is kept."""
    return tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                     [addresses, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _line_prefetch_l2(addresses):
    """One ``prefetch.global.L2`` per element: the line holding each address into L2 (no destination register)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addresses],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(
    base_ptr,  # *u8: the first byte of the range (16-byte aligned)
    nbytes,  # i64: the range's length, a multiple of 16
    CHUNK: tl.constexpr,  # bytes a thread asks for (a multiple of 16)
    THREADS: tl.constexpr,  # prefetches a program issues
    LINES: tl.constexpr = False,  # per-line prefetches (CHUNK / 128 a thread) instead of one bulk prefetch
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL: release at once (this kernel holds no SM resources worth keeping the next one out for); the prefetches
    # touch weights only, so they go before the wait; the wait keeps completion transitive (l2_prefetch).
    pdl_release(USE_PDL)
    if LINES:
        # the program's THREADS * CHUNK bytes as 128-byte lines, consecutive lines on consecutive threads
        first = tl.program_id(0).to(tl.int64) * THREADS * CHUNK
        for i in tl.static_range(CHUNK // 128):
            offs = first + (i * THREADS + tl.arange(0, THREADS)).to(tl.int64) * 128
            offs = tl.where(offs < nbytes, offs, 0)
            _line_prefetch_l2((base_ptr + offs).to(tl.int64, bitcast=True))
    else:
        offs = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64) * CHUNK
        inside = offs < nbytes
        start = tl.where(inside, offs, 0)  # lanes past the end ask for the first chunk again (a no-op in L2)
        size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
        _bulk_prefetch_l2((base_ptr + start).to(tl.int64, bitcast=True), size)
    pdl_wait(USE_PDL)


def l2_prefetch(weight: torch.Tensor, max_bytes: int | None = None, chunk_bytes: int = 16384, *,
                lines: bool = False, threads: int = _THREADS) -> bool:
    """Ask for the first ``max_bytes`` (all, if None) of ``weight``'s storage in L2, asynchronously; returns whether
    a launch was made (none for a non-contiguous tensor, a start not 16-byte aligned, or nothing to fetch).
    CUDA-graph capturable (no host sync); sm_90 or newer, compiled (the interpreter has no PTX).

    PDL: the programs release at once, issue their prefetches (weights only, so before the wait), then wait, so
    the kernel completes only after its predecessor did (``kernels.pdl``'s transitivity). A bulk prefetch holds
    its program until its bytes arrive (call 1: the launch lasted as long as its fetches), so in a chain the
    launch adds its fetch time; on a parallel branch of the graph (``side``) it does not."""
    if chunk_bytes <= 0 or chunk_bytes % (128 if lines else 16) or not weight.is_contiguous():
        return False
    nbytes = weight.numel() * weight.element_size()
    if max_bytes is not None:
        nbytes = min(nbytes, max_bytes)
    nbytes -= nbytes % 16
    if nbytes <= 0 or weight.data_ptr() % 16:
        return False
    raw = weight.view(-1).view(torch.uint8)
    grid = (max(1, triton.cdiv(nbytes, chunk_bytes * threads)),)
    _l2_prefetch_kernel[grid](raw, nbytes, CHUNK=chunk_bytes, THREADS=threads, LINES=lines,
                              num_warps=max(1, threads // 32), **pdl_launch())
    return True


def time_graph(layers: list, reps: int, last=None) -> float:
    """Median µs per layer (each a list of thunks run in order), all layers in one CUDA graph
    (``graph_timing.time_calls``); ``last`` (a thunk) runs once after the last layer (the side stream's join)."""
    def layer(group: list, tail=None) -> None:
        for call in group:
            call()
        if tail is not None:
            tail()

    calls = [functools.partial(layer, group) for group in layers[:-1]] + [functools.partial(layer, layers[-1], last)]
    return time_calls(calls, torch.device("cuda"), reps) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=527)
    ap.add_argument("--max-model-len", type=int, default=1024, help="the attention's split bound")
    ap.add_argument("--layers", type=int, default=24, help="distinct weight copies in a graph")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunks", default="4096,16384,65536",
                    help="bulk: bytes a thread asks for; with --lines: bytes a thread covers in 128-byte lines")
    ap.add_argument("--lines", action="store_true", help="per-line prefetch.global.L2 instead of bulk")
    ap.add_argument("--threads", type=int, default=32, help="threads a prefetch program")
    ap.add_argument("--max-mb", type=float, default=32.0, help="prefetch at most this much of a weight")
    ap.add_argument("--only", default="", help="comma-separated names of SHAPES (prefixes)")
    ap.add_argument("--no-pdl", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (sm_90: the prefetch instruction)")
    use_pdl(not a.no_pdl)
    gen = torch.Generator(device="cuda").manual_seed(0)
    page, dev, bf16 = 16, torch.device("cuda"), torch.bfloat16
    chunks = [int(c) for c in a.chunks.split(",") if c]
    print("| layer | o weight MB | gemv | gemv L2 | attn | attn+gemv | pf+gemv | "
          + " | ".join(f"pf+attn+gemv {c / 1024:g} KB" for c in chunks) + " | "
          + " | ".join(f"side {c / 1024:g} KB" for c in chunks) + " | best saving |")
    print("|---|---|---|---|---|---|---|" + "---|" * (2 * len(chunks)) + "---|")
    side = torch.cuda.Stream()

    def join() -> None:
        torch.cuda.current_stream().wait_stream(side)
    wanted = [w.strip() for w in a.only.split(",") if w.strip()]
    for name, kv_heads, group, head_dim, window, hidden in SHAPES:
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        blocks = -(-a.context // page)
        k_cache = torch.randn(blocks + 1, page, kv_heads, head_dim, device=dev, dtype=bf16, generator=gen)
        v_cache = torch.randn_like(k_cache)
        tables = torch.zeros(1, -(-a.max_model_len // page) + 1, dtype=torch.int32, device=dev)
        tables[0, :blocks] = torch.randperm(blocks, device=dev, generator=gen).to(torch.int32)
        lens = torch.full((1,), a.context, dtype=torch.int32, device=dev)
        q = torch.randn(1, kv_heads * group, head_dim, device=dev, dtype=bf16, generator=gen)
        attn_out = torch.empty_like(q)
        width = kv_heads * group * head_dim
        weights = [torch.randn(hidden, width, device=dev, dtype=bf16, generator=gen) * 0.02 for _ in range(a.layers)]
        x = attn_out.view(1, width)
        max_bytes = int(a.max_mb * 2**20)
        attend = functools.partial(decode_attention.paged_decode_attention, q, k_cache, v_cache, tables, lens,
                                   head_dim ** -0.5, window, None, max_context_len=a.max_model_len, out=attn_out)

        def gemv(w: torch.Tensor, x: torch.Tensor = x) -> None:
            triton_dense_linear(x, w, max_tokens=2, tuned_only=True)

        def prefetch(w: torch.Tensor, chunk: int, max_bytes: int = max_bytes) -> None:
            l2_prefetch(w, max_bytes, chunk, lines=a.lines, threads=a.threads)

        row = {
            "gemv": time_graph([[functools.partial(gemv, w)] for w in weights], a.reps),
            "gemv L2": time_graph([[functools.partial(gemv, weights[0])] for _ in weights], a.reps),
            "attn": time_graph([[attend] for _ in weights], a.reps),
            "attn+gemv": time_graph([[attend, functools.partial(gemv, w)] for w in weights], a.reps),
            "pf+gemv": time_graph([[functools.partial(prefetch, w, chunks[0]), functools.partial(gemv, w)]
                                   for w in weights], a.reps),
        }
        def forked(w: torch.Tensor, chunk: int, prefetch=prefetch) -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch(w, chunk)

        with_pf = [time_graph([[functools.partial(prefetch, w, c), attend, functools.partial(gemv, w)]
                               for w in weights], a.reps) for c in chunks]
        with_side = [time_graph([[functools.partial(forked, w, c), attend, functools.partial(gemv, w)]
                                 for w in weights], a.reps, last=join) for c in chunks]
        mb = weights[0].numel() * 2 / 2**20
        print(f"| {name} | {mb:.1f} | " + " | ".join(f"{row[k]:.2f}" for k in row) + " | "
              + " | ".join(f"{t:.2f}" for t in with_pf) + " | " + " | ".join(f"{t:.2f}" for t in with_side)
              + f" | {row['attn+gemv'] - min(with_pf + with_side):.2f} |", flush=True)
        del weights, k_cache, v_cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
