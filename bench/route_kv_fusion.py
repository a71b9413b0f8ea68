"""Fused vs unfused decode launches of issue 12, at the real shapes, inside CUDA graphs: µs per call.

Two tables (markdown, to paste):

* router: the router GEMV (cuBLAS, ``F.linear``) then ``kernels.router.triton_route`` (two launches) against
  ``kernels.router.linear_route`` (one launch), at Qwen3-30B-A3B's (H=2048, E=128, top-8, bf16 weights out) and
  Gemma-4-26B-A4B's (H=2816, E=128, top-8, per-expert scale, fp32 weights out) routers, for several
  ``experts_per_program`` (the engine's default: 1 up to 4 rows, then 2; E per program = one program per token row);
* KV store: ``kernels.qk_norm_rope.qk_norm_rope`` then ``kernels.kv_store.store_kv`` (two launches) against
  ``qk_norm_rope(..., cache=PagedKVWrite(...))`` (one launch), at Qwen3-30B-A3B's and Gemma 4's attention layers;

for T = 1, 4, 16 tokens. Each time replays a CUDA graph of at least 10 calls (the gaps between launches count, as
in the engine's decode graphs), timed with CUDA events, median of ``--reps`` replays (``graph_timing.time_calls``).
Router calls rotate over enough weight copies (~100 MB) that a call's 0.5-0.7 MB weight is not in the 50 MB L2, as
in a model where ~1 GB of other weights flows between two layers' routers. Each row also says whether the fused
result agrees with the unfused one (KV: bitwise; router: rows with another expert choice, which near-ties allow).

  python3 bench/route_kv_fusion.py                    # on the H200: both tables, ~1 min (compiles included)
  TRITON_INTERPRET=1 uv run python bench/route_kv_fusion.py --device cpu --tiny --reps 1   # CPU dry run
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import calls_per_graph, device_l2_bytes, rotation, time_calls  # bench/ is on the path

TOKENS = (1, 4, 16)
EXPERTS_PER_PROGRAM = (1, 2, 4, 8)


@dataclass(frozen=True)
class RouterCase:
    name: str
    hidden: int
    experts: int
    top_k: int
    with_scale: bool  # Gemma 4: per-expert scale, fp32 weights out; Qwen3-MoE: weights cast to bf16


@dataclass(frozen=True)
class AttentionCase:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    mode: str  # "qwen": raw v copied to the cache; "gemma": value norm; K = V when not has_v
    has_v: bool


ROUTER_CASES = (RouterCase("qwen3-30b-a3b", 2048, 128, 8, False), RouterCase("gemma-4-26b-a4b", 2816, 128, 8, True))
ATTENTION_CASES = (
    AttentionCase("qwen3-30b-a3b", 32, 4, 128, "qwen", True),
    AttentionCase("gemma-4-26b-a4b sliding", 16, 8, 256, "gemma", True),
    AttentionCase("gemma-4-26b-a4b full (k=v)", 16, 2, 512, "gemma", False),
    AttentionCase("gemma-4-31b sliding", 32, 16, 256, "gemma", True),
    AttentionCase("gemma-4-31b full (k=v)", 32, 4, 512, "gemma", False),
)
TINY_ROUTER_CASES = (RouterCase("tiny", 64, 16, 4, True),)
TINY_ATTENTION_CASES = (AttentionCase("tiny", 4, 2, 16, "qwen", True), AttentionCase("tiny k=v", 4, 1, 32, "gemma",
                                                                                       False))


def bench_router(case: RouterCase, tokens: int, device: torch.device, reps: int, l2_bytes: int,
                 launches: tuple[tuple[int, int], ...]) -> str:
    """One table row: the unfused router, then the fused one for each (experts per program, warps) launch."""
    from inference_server.kernels.router import linear_route, triton_route

    gen = torch.Generator(device).manual_seed(tokens)
    dtype = torch.bfloat16
    x = torch.randn(tokens, case.hidden, generator=gen, device=device, dtype=dtype)
    copies = rotation(case.experts * case.hidden * 2, l2_bytes, max_copies=256) if device.type == "cuda" else 1
    weights = [0.02 * torch.randn(case.experts, case.hidden, generator=gen, device=device, dtype=dtype)
               for _ in range(copies)]
    scale = (1 + torch.rand(case.experts, generator=gen, device=device)).to(dtype) if case.with_scale else None
    out_dtype = None if case.with_scale else dtype
    n_calls = calls_per_graph(copies)

    def unfused(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_route(torch.nn.functional.linear(x, w), case.top_k, True, scale, out_dtype)

    def fused(w: torch.Tensor, epp: int, warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        return linear_route(x, w, case.top_k, True, scale, out_dtype, experts_per_program=epp, num_warps=warps)

    unfused_s = time_calls([lambda w=weights[i % copies]: unfused(w) for i in range(n_calls)], device, reps)
    times = []
    for epp, warps in launches:
        calls = [lambda w=weights[i % copies], epp=epp, warps=warps: fused(w, epp, warps) for i in range(n_calls)]
        times.append(time_calls(calls, device, reps))
    differing = int((fused(weights[0], 2)[1].sort(dim=1).values != unfused(weights[0])[1].sort(dim=1).values)
                    .any(dim=1).sum())
    best = min(times)
    cells = " | ".join(f"{t * 1e6:.1f}" for t in times)
    return (f"| {case.name} [{case.experts}x{case.hidden}] | {tokens} | {unfused_s * 1e6:.1f} | {cells} | "
            f"{(unfused_s - best) * 1e6:.1f} | {differing}/{tokens} |")


def bench_kv_store(case: AttentionCase, tokens: int, device: torch.device, reps: int) -> str:
    from inference_server.kernels.kv_store import store_kv
    from inference_server.kernels.qk_norm_rope import PagedKVWrite, qk_norm_rope

    gen = torch.Generator(device).manual_seed(tokens)
    dtype = torch.bfloat16
    nh, nkv, d = case.q_heads, case.kv_heads, case.head_dim
    widths = [nh * d, nkv * d] + ([nkv * d] if case.has_v else [])
    qkv = torch.randn(tokens, sum(widths), generator=gen, device=device, dtype=dtype)
    parts = [p.unflatten(-1, (-1, d)) for p in qkv.split(widths, dim=-1)]
    q, k = parts[0], parts[1]
    value = parts[2] if case.has_v else k  # the layer's value before any value norm
    v_in = value if case.mode == "gemma" else None
    q_w = torch.randn(d, generator=gen, device=device, dtype=dtype)
    k_w = torch.randn(d, generator=gen, device=device, dtype=dtype)
    angles = torch.rand(tokens, d, generator=gen, device=device) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    page, blocks = 16, 512
    slots = torch.randperm(blocks * page, generator=gen, device=device)[:tokens]
    caches = [torch.zeros(blocks, page, nkv, d, device=device, dtype=dtype) for _ in range(4)]

    def unfused() -> None:
        _, k_out, v_out = qk_norm_rope(q, k, v_in, q_w, k_w, 1e-6, case.mode, cos, sin)  # type: ignore[arg-type]
        assert k_out is not None
        store_kv(k_out, v_out if v_out is not None else value, caches[0], caches[1], slots)

    def fused() -> None:
        write = PagedKVWrite(caches[2], caches[3], slots, value=None if v_in is not None else value)
        qk_norm_rope(q, k, v_in, q_w, k_w, 1e-6, case.mode, cos, sin, cache=write)  # type: ignore[arg-type]

    unfused_s = time_calls([unfused] * calls_per_graph(1), device, reps)
    fused_s = time_calls([fused] * calls_per_graph(1), device, reps)
    same = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    return (f"| {case.name} [{nh}/{nkv} heads x {d}] | {tokens} | {unfused_s * 1e6:.1f} | {fused_s * 1e6:.1f} | "
            f"{(unfused_s - fused_s) * 1e6:.1f} | {'yes' if same else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--warps", default="4", help="warps of the fused router's launches, comma separated")
    args = parser.parse_args()
    device = torch.device(args.device)
    tokens = [int(t) for t in args.tokens.split(",")]
    router_cases = TINY_ROUTER_CASES if args.tiny else ROUTER_CASES
    attention_cases = TINY_ATTENTION_CASES if args.tiny else ATTENTION_CASES
    l2_bytes = device_l2_bytes(device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)

    epp = (*EXPERTS_PER_PROGRAM, router_cases[0].experts)
    launches = tuple((e, int(w)) for w in args.warps.split(",") for e in epp)
    print("\nRouter GEMV + routing, µs per call (fused by experts per program and warps; the engine uses 1 up to 4 "
          "rows, then 2, with 4 warps)\n")
    print("| router | T | unfused (GEMV + route) | " + " | ".join(f"fused, {e}/program {w}w" for e, w in launches)
          + " | saved (best) | rows choosing other experts |")
    print("|---|---|---|" + "---|" * len(launches) + "---|---|")
    for case in router_cases:
        for t in tokens:
            print(bench_router(case, t, device, args.reps, l2_bytes, launches), flush=True)

    print("\nq/k norm + RoPE + KV store, µs per call\n")
    print("| attention layer | T | unfused (norm+rope, store_kv) | fused | saved | caches bitwise equal |")
    print("|---|---|---|---|---|---|")
    for attention in attention_cases:
        for t in tokens:
            print(bench_kv_store(attention, t, device, args.reps), flush=True)


if __name__ == "__main__":
    main()
