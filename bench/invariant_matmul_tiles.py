"""Which fixed tile configuration the batch-invariant GEMM (``DETERMINISTIC=true``) should run: each candidate is
batch-invariant by construction (one config for every M), so the choice is speed alone, over the step sizes a
deterministic server meets: T = 1 (c=1 decode), 64 (c=64 decode), 512 and 2,048 (prefill chunks).

For each model, every float projection of a step (``dense_linear.decode_projections``: fused q/k/v, o, gate/up,
down, the logits up to T = 64) is timed as the engine runs it (a CUDA graph over L2-missing weight copies,
``kit.graph_timing``) for cuBLAS (``F.linear``, the default mode's large-T path) and each candidate
(``invariant_matmul(config=...)``); printed: the step's sum (calls x µs) per T, and each candidate's ratio to
cuBLAS. It also checks that each candidate gives row 0 the same bits at T = 1 and inside T = 64.

  python3 bench/invariant_matmul_tiles.py                 # on the device: 2 models, ~1-2 min with compiles
  TRITON_INTERPRET=1 uv run python bench/invariant_matmul_tiles.py --device cpu --tiny --tokens 1 --reps 1  # dry run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dense_linear import decode_projections  # bench/ is on the path
from inference_server.kernels.batch_invariant_matmul import CONFIG, MatmulConfig, invariant_matmul
from kit.graph_timing import calls_per_graph, device_l2_bytes, rotation, time_calls

CANDIDATES = {
    "64x128x64 w4 s3 (now)": CONFIG,
    "32x128x64 w4 s3": MatmulConfig(32, 128, 64, 4, 3),
    "16x128x64 w4 s3": MatmulConfig(16, 128, 64, 4, 3),
    "16x128x128 w4 s3": MatmulConfig(16, 128, 128, 4, 3),
    "16x64x128 w4 s4": MatmulConfig(16, 64, 128, 4, 4),
}
MODELS = ("gemma-4-26b-a4b", "qwen3-30b-a3b")
TOKENS = (1, 64, 512, 2048)
LOGITS_MAX_TOKENS = 64  # a prefill computes the logits of its last rows only


def same_bits(config: MatmulConfig, n: int, k: int, device: torch.device) -> bool:
    """Row 0 alone and row 0 of a 64-row call: the invariance every candidate must keep."""
    gen = torch.Generator(device).manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * k ** -0.5
    x = torch.randn(64, k, generator=gen, device=device, dtype=torch.bfloat16)
    return torch.equal(invariant_matmul(x[:1], w, config=config)[0], invariant_matmul(x, w, config=config)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny presets (dry runs)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=240.0)
    args = parser.parse_args()
    device = torch.device(args.device)
    tokens = [int(t) for t in args.tokens.split(",")]
    l2_bytes = device_l2_bytes(device)
    started = time.perf_counter()
    for model in MODELS:
        preset = f"{model}-tiny" if args.tiny else model
        projections = decode_projections(preset)
        totals = {name: dict.fromkeys(tokens, 0.0) for name in ("cuBLAS", *CANDIDATES)}
        first = projections[0]
        bits = {name: same_bits(c, first.out_features, first.in_features, device) for name, c in CANDIDATES.items()}
        for p in projections:
            if time.perf_counter() - started > args.budget_s:
                print(f"budget spent: {model} {p.name} and later shapes not timed")
                break
            gen = torch.Generator(device).manual_seed(p.out_features + p.in_features)
            copies = rotation(p.out_features * p.in_features * 2, l2_bytes)
            weights = [torch.randn(p.out_features, p.in_features, generator=gen, device=device,
                                   dtype=torch.bfloat16) * p.in_features ** -0.5 for _ in range(copies)]
            order = [weights[i % copies] for i in range(calls_per_graph(copies))]
            for t in tokens:
                if p.name == "logits" and t > LOGITS_MAX_TOKENS:
                    continue
                x = torch.randn(t, p.in_features, generator=gen, device=device, dtype=torch.bfloat16)
                totals["cuBLAS"][t] += p.calls * time_calls(
                    [lambda x=x, w=w: torch.nn.functional.linear(x, w) for w in order], device, args.reps)
                for name, config in CANDIDATES.items():
                    totals[name][t] += p.calls * time_calls(
                        [lambda x=x, w=w, c=config: invariant_matmul(x, w, config=c) for w in order], device,
                        args.reps)
            del weights
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"\n## {model}: the step's float projections, µs per step (ratio to cuBLAS)\n")
        print("| config | row bits T=1 = T=64 | " + " | ".join(f"T={t}" for t in tokens) + " |")
        print("|---|---|" + "---|" * len(tokens))
        for name, by_t in totals.items():
            cells = [f"{by_t[t] * 1e6:,.0f}" + ("" if name == "cuBLAS" else
                                                f" ({by_t[t] / max(totals['cuBLAS'][t], 1e-12):.2f})")
                     for t in tokens]
            print(f"| {name} | {'-' if name == 'cuBLAS' else bits[name]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
