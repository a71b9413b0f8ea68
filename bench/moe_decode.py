"""The routed experts of a decode step: the decode GEMVs (``kernels.moe_decode``) against the grouped GEMMs
(``kernels.fused_moe``, tuned configs), at the real expert shapes, inside CUDA graphs: µs per MoE layer.

For each model (Qwen3-30B-A3B: E=128, H=2048, I=768, top-8, silu; Gemma-4-26B-A4B: E=128, H=2816, I=704, top-8,
gelu_tanh) and token count T, one markdown row: the grouped path, the decode path with its heuristic tiles, the
best of a few candidate tiles (which the row names), each as µs per layer and as a fraction of the time the
distinct routed experts' bytes take at 4.3 TB/s; and whether the decode result agrees with the grouped one
(max error relative to the largest output). ``--int8`` runs int8 experts (``reference_int8``'s format), read
as 32-bit words at the int8 tiles (the default); ``--int8-bytes`` reads them as single bytes at the float tiles
(the path before words, now the fallback for layouts without words), so one H200 session compares the three.

Each time replays a CUDA graph of at least 10 calls over enough copies of the expert weights that one call's
routed experts are not in the 50 MB L2 (``graph_timing``), as in a model where each layer reads its own experts;
routing draws K distinct random experts per token (a fixed seed), median of ``--reps`` replays.

  python3 bench/moe_decode.py                       # on the H200: both models, T = 1, 2, 4, 8, 16; ~2-3 min
  python3 bench/moe_decode.py --int8
  python3 bench/moe_decode.py --int8-bytes --tokens 1,2   # int8 as single bytes: the words' baseline
  TRITON_INTERPRET=1 uv run python bench/moe_decode.py --device cpu --tiny --reps 1   # CPU dry run
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import calls_per_graph, device_l2_bytes, rotation, time_calls  # bench/ is on the path

HBM_BYTES_PER_S = 4.3e12
MODELS = {  # E, H, I, K, activation, routing weights dtype
    "qwen3-30b-a3b": (128, 2048, 768, 8, "silu", torch.bfloat16),
    "gemma-4-26b-a4b": (128, 2816, 704, 8, "gelu_tanh", torch.float32),
}
TINY = {"tiny": (8, 64, 48, 4, "silu", torch.bfloat16)}


GATE_UP_TILES = ((16, 256, 4), (16, 128, 2), (32, 128, 4))
DOWN_TILES = ((16, 128, 4), (32, 256, 8), (32, 128, 4), (64, 128, 8), (64, 64, 4))
"""(weight rows per program, K columns per tile, warps) tried for each kernel, in bf16 columns."""
INT8_GATE_UP_TILES = ((8, 256, 1), (16, 256, 1), (4, 256, 1), (8, 512, 2), (16, 1024, 4))
INT8_DOWN_TILES = ((16, 256, 1), (8, 256, 1), (32, 256, 1), (32, 64, 1), (16, 512, 2))
"""The same for int8 experts read as words: 256 columns a warp (the activations stay in registers,
``bench/sass_mix.py --only moe``), K depths cut to the dot's next power of two (a masked tail where they do not
divide it), and 64-column tiles that divide Gemma's I = 704."""


def candidates(hidden: int, inter: int, element_size: int, int8_words: bool = False) -> list:
    """The heuristic tiles first, then every pair of ``GATE_UP_TILES`` and ``DOWN_TILES`` (K depths cut to a
    power of two dividing the dot, as the heuristic does); for int8 words the ``INT8_`` tiles."""
    from inference_server.kernels.moe_decode import MoeDecodeConfig, moe_decode_config
    from inference_server.kernels.streamed_linear import dividing_block_k, pow2_clamp

    base = moe_decode_config(hidden, inter, element_size, int8=int8_words)
    found = [base]
    if int8_words:
        for (gu_n, gu_k, gu_w), (dn_n, dn_k, dn_w) in itertools.product(INT8_GATE_UP_TILES, INT8_DOWN_TILES):
            config = MoeDecodeConfig(gu_n, pow2_clamp(hidden, 16, gu_k), gu_w, dn_n, pow2_clamp(inter, 16, dn_k), dn_w)
            if config not in found:
                found.append(config)
        return found
    for (gu_n, gu_k, gu_w), (dn_n, dn_k, dn_w) in itertools.product(GATE_UP_TILES, DOWN_TILES):
        config = MoeDecodeConfig(gu_n, dividing_block_k(hidden, gu_k), gu_w, dn_n, dividing_block_k(inter, dn_k), dn_w)
        if config not in found:
            found.append(config)
    return found


def bench_row(model: str, shape: tuple, tokens: int, device: torch.device, reps: int, int8: bool,
              int8_words: bool = True) -> str:
    from inference_server.kernels.fused_moe import fused_moe
    from inference_server.kernels.moe_decode import fused_moe_decode
    from inference_server.kernels.reference_int8 import quantize_int8_per_channel

    E, H, inter, K, act, weights_dtype = shape
    gen = torch.Generator().manual_seed(tokens)
    dtype = torch.bfloat16
    x = torch.randn(tokens, H, generator=gen).to(device, dtype)
    w_gu = (torch.randn(E, 2 * inter, H, generator=gen) * H ** -0.5).to(device, dtype)
    w_dn = (torch.randn(E, H, inter, generator=gen) * inter ** -0.5).to(device, dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).to(device)
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1).to(device, weights_dtype)
    scales: dict[str, torch.Tensor] = {}
    if int8:
        w_gu, gu_scale = quantize_int8_per_channel(w_gu)
        w_dn, dn_scale = quantize_int8_per_channel(w_dn)
        scales = dict(w_gate_up_scale=gu_scale, w_down_scale=dn_scale)
    distinct = int(ids.unique().numel())
    touched = distinct * (w_gu[0].numel() + w_dn[0].numel()) * w_gu.element_size()  # + scales: negligible
    limit_s = touched / HBM_BYTES_PER_S
    copies = rotation(touched, device_l2_bytes(device)) if device.type == "cuda" else 1
    layers = [(w_gu, w_dn)] + [(w_gu.clone(), w_dn.clone()) for _ in range(copies - 1)]
    calls_needed = calls_per_graph(copies)

    def timed(fn, **kwargs) -> float:
        calls = [functools.partial(fn, x, *layers[i % copies], weights, ids, act, **scales, **kwargs)
                 for i in range(calls_needed)]
        return time_calls(calls, device, reps)

    grouped = fused_moe(x, w_gu, w_dn, weights, ids, act, **scales)
    scale = grouped.float().abs().max().item() or 1.0
    grouped_s = timed(fused_moe)
    results = []
    words = int8 and int8_words
    for config in candidates(H, inter, x.element_size(), words):
        try:
            out = fused_moe_decode(x, w_gu, w_dn, weights, ids, act, config=config, int8_words=words, **scales)
        except Exception as err:  # a tile the compiler rejects: not a candidate
            print(f"  {model} T={tokens} {config}: {type(err).__name__}", file=sys.stderr)
            continue
        error = (out.float() - grouped.float()).abs().max().item() / scale
        results.append((timed(fused_moe_decode, config=config, int8_words=words), config, error))
    heuristic_s, _, heuristic_err = results[0]
    best_s, best, _ = min(results, key=lambda item: item[0])

    def cell(seconds: float) -> str:
        return f"{seconds * 1e6:.1f} ({limit_s / seconds:.2f})"

    tiles = (f"gu {best.gate_up_block_n}x{best.gate_up_block_k}/{best.gate_up_warps}w, "
             f"dn {best.down_block_n}x{best.down_block_k}/{best.down_warps}w")
    kind = (" int8 words" if words else " int8 bytes") if int8 else ""
    return (f"| {model}{kind} | {tokens} | {distinct} | {cell(grouped_s)} | {cell(heuristic_s)} | "
            f"{cell(best_s)} | {tiles} | {grouped_s / best_s:.2f} | {heuristic_err:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--int8", action="store_true", help="int8 experts, read as words (the default path)")
    parser.add_argument("--int8-bytes", action="store_true",
                        help="int8 experts read as single bytes at the float tiles (the path before words)")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (CPU dry runs)")
    args = parser.parse_args()
    device = torch.device(args.device)
    print("| experts | T | distinct experts | grouped µs (of limit) | decode heuristic µs (of limit) | "
          "decode best µs (of limit) | best tiles | grouped / best | decode vs grouped max rel. error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, shape in (TINY if args.tiny else MODELS).items():
        for tokens in (int(t) for t in args.tokens.split(",")):
            print(bench_row(model, shape, tokens, device, args.reps, args.int8 or args.int8_bytes,
                            int8_words=not args.int8_bytes), flush=True)


if __name__ == "__main__":
    main()
