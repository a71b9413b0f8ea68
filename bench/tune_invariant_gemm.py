#!/usr/bin/env python3
"""Time ``DETERMINISTIC``'s batch-invariant GEMM (``kernels.batch_invariant_matmul``) under candidate configurations
on this GPU, over the projections a model's deterministic step runs, against cuBLAS (``F.linear``).

Any one configuration is batch-invariant (``MatmulConfig`` and ``TARGET_PROGRAMS`` are functions of nothing but the
code), so which one runs is a question of speed alone: the tile (``MatmulConfig``) and the K split's target
(``TARGET_PROGRAMS``: programs per M-tile that ``split_k`` aims at) set the decode GEMM's bandwidth and the prefill
GEMM's compute rate together. A change of configuration changes the deterministic mode's bits (the same on every
schedule, but not the same as before): the GPU suite's deterministic tests then decide, as for any GPU change.

For each of ``--models`` (dummy shapes from the preset, built on the meta device and fused as the CUDA runner fuses
them: q/k/v and gate/up one matrix each), every distinct ``[N, K]`` weight the step multiplies (the layers' and, apart,
the head's) is timed at each of ``--tokens`` rows: ``kit.graph_timing.time_calls`` over copies of the weight cycled so
that each call reads it from HBM, as a step's layers do. A row of the table is a candidate; its cells are the step's
GEMM time summed over the layers (µs), and the head's. Today's configuration is first; cuBLAS last. Then, per
shape and M, the fastest candidate: the configuration may follow N and K (never M), so a per-shape choice is allowed.

  python3 bench/tune_invariant_gemm.py                       # 26B-A4B and Qwen3-30B-A3B, M = 1, 64, 2048 (~2 min)
  TRITON_INTERPRET=1 uv run python bench/tune_invariant_gemm.py --smoke   # tiny presets, M = 1, 3 (a dry run)
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from inference_server.kernels import batch_invariant_matmul as bim  # noqa: E402
from kit.graph_timing import calls_per_graph, device_l2_bytes, rotation, time_calls  # noqa: E402

CANDIDATES: list[tuple[bim.MatmulConfig, int]] = [
    (bim.CONFIG, bim.TARGET_PROGRAMS),
    (bim.CONFIG, 512),
    (bim.CONFIG, 1024),
    (bim.MatmulConfig(64, 64, 64, 4, 4), 256),
    (bim.MatmulConfig(64, 64, 128, 4, 3), 512),
    (bim.MatmulConfig(64, 128, 128, 8, 3), 256),
    (bim.MatmulConfig(64, 256, 64, 8, 3), 256),
    (bim.MatmulConfig(128, 128, 64, 8, 3), 256),
]
"""(tile, TARGET_PROGRAMS) to time; today's first."""


def step_shapes(preset: str) -> tuple[collections.Counter[tuple[int, int]], tuple[int, int]]:
    """(``{(N, K): launches a step}`` of the layers' projections, the head's ``(N, K)``): the CUDA runner's fused
    weights (``fuse_model_weights``) of the preset, built on the meta device (no memory, no weights)."""
    from inference_server.backends.cuda.runner import fuse_model_weights
    from inference_server.models.loading.loader import build_model
    from inference_server.models.loading.presets import preset_config
    from inference_server.models.spec import parse_model_spec

    spec = parse_model_spec(preset_config(preset))
    model = build_model(spec, torch.bfloat16, torch.device("meta"), "none", "auto")
    fuse_model_weights(model)
    shapes: collections.Counter[tuple[int, int]] = collections.Counter()
    fused_parts: set[int] = set()
    for module in model.modules():
        for attr, parts in (("qkv_weight", ("q_proj", "k_proj", "v_proj")),
                            ("gate_up_weight", ("gate_proj", "up_proj"))):
            weight = getattr(module, attr, None)
            if weight is not None:
                shapes[tuple(weight.shape)] += 1
                fused_parts.update(id(getattr(module, p).weight) for p in parts if getattr(module, p, None) is not None)
    for name, param in model.named_parameters():
        if param.dim() == 2 and id(param) not in fused_parts and "embed" not in name and "lm_head" not in name:
            shapes[tuple(param.shape)] += 1
    return shapes, (spec.vocab_size, spec.hidden_size)


@functools.cache
def operands(n: int, k: int, m: int, device: torch.device) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``x [m, k]`` and copies of a weight ``[n, k]`` (bf16, made on the device), enough that each call of a graph
    reads its copy from HBM (``rotation``); kept for every candidate."""
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    copies = rotation(n * k * 2, device_l2_bytes(device)) if device.type == "cuda" else 1
    weights = tuple((torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(torch.bfloat16)
                    for _ in range(copies))
    return torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16), weights


def time_shape(linear, n: int, k: int, m: int, device: torch.device, reps: int) -> float:
    """Seconds per call of ``linear(x [m, k], w [n, k])``, each call reading its weight copy from HBM."""
    x, weights = operands(n, k, m, device)
    calls = [functools.partial(linear, x, weights[i % len(weights)]) for i in range(calls_per_graph(len(weights)))]
    return time_calls(calls, device, reps)


def invariant_with(config: bim.MatmulConfig, target: int):
    """``invariant_matmul`` under ``config`` and ``target`` programs (module globals set around each call)."""
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        saved = bim.CONFIG, bim.TARGET_PROGRAMS
        bim.CONFIG, bim.TARGET_PROGRAMS = config, target
        try:
            return bim.invariant_matmul(x, weight)
        finally:
            bim.CONFIG, bim.TARGET_PROGRAMS = saved
    return linear


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma-4-26b-a4b,qwen3-30b-a3b")
    parser.add_argument("--tokens", default="1,64,2048", help="rows a call multiplies (decode batches, a chunk)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--time-limit", type=float, default=420.0, help="seconds after which no candidate starts")
    parser.add_argument("--smoke", action="store_true", help="the -tiny presets, M = 1 and 3, two candidates")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = [m + "-tiny" if args.smoke else m for m in args.models.split(",")]
    tokens = (1, 3) if args.smoke else tuple(int(t) for t in args.tokens.split(","))
    candidates = CANDIDATES[:2] if args.smoke else CANDIDATES
    started = time.monotonic()
    for model in models:
        shapes, head = step_shapes(model)
        print(f"\n{model}: {sum(shapes.values())} projections a step over {len(shapes)} shapes "
              f"{dict(shapes)}; head {head}\n"
              "| tile (M, N, K, warps, stages) | target programs | " + " | ".join(
                  f"layers M={m} µs | head M={m} µs" for m in tokens) + " |\n" + "|---" * (2 + 2 * len(tokens)) + "|",
              flush=True)
        rows = [(f"{c.block_m}, {c.block_n}, {c.block_k}, {c.num_warps}, {c.num_stages}", str(t), invariant_with(c, t))
                for c, t in candidates]
        rows.append(("cuBLAS (F.linear)", "-", torch.nn.functional.linear))
        times: dict[tuple[tuple[int, int], int], dict[str, float]] = collections.defaultdict(dict)
        for tile, target, linear in rows:
            if time.monotonic() - started > args.time_limit:
                print(f"| {tile} | {target} | skipped past --time-limit |", flush=True)
                continue
            cells = []
            try:
                for m in tokens:
                    per_shape = {shape: time_shape(linear, *shape, m, device, args.reps) for shape in shapes}
                    for shape, seconds in per_shape.items():
                        times[shape, m][f"{tile} / {target}"] = seconds
                    layers = sum(count * per_shape[shape] for shape, count in shapes.items())
                    # the head at decode sizes only (a chunk's logits are one row a sequence)
                    head_s = time_shape(linear, *head, m, device, args.reps) if m <= 64 else None
                    cells += [f"{layers * 1e6:.0f}", f"{head_s * 1e6:.0f}" if head_s else "-"]
            except Exception as err:  # shared memory or registers: not a candidate
                cells = [f"failed: {type(err).__name__}: {str(err)[:80]}"]
            print(f"| {tile} | {target} | {' | '.join(cells)} |", flush=True)
        # N and K may choose the configuration (a row's bits only must not follow M): the fastest per shape
        print("\n| shape (N, K) x launches | M | fastest invariant (tile / target): µs | today's µs | cuBLAS µs |\n"
              "|---|---|---|---|---|")
        today = f"{rows[0][0]} / {rows[0][1]}"
        for (shape, m), by_candidate in sorted(times.items()):
            ours = {name: t for name, t in by_candidate.items() if not name.startswith("cuBLAS")}
            if not ours:
                continue
            best = min(ours, key=ours.__getitem__)
            blas = by_candidate.get("cuBLAS (F.linear) / -")
            blas_us = f"{blas * 1e6:.1f}" if blas else "-"
            print(f"| {shape} x {shapes[shape]} | {m} | {best}: {ours[best] * 1e6:.1f} | "
                  f"{ours.get(today, float('nan')) * 1e6:.1f} | {blas_us} |", flush=True)
    print(f"\ndone in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
