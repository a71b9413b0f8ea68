"""Triton ``dense_linear`` against cuBLAS ``F.linear`` at every float projection of a decode step, per model.

The shapes come from the presets: each model is built on the meta device, its q/k/v and gate/up weights fused
as the CUDA runner fuses them, and every float projection a decode step runs is listed with its calls per step
(attention q/k/v and o, dense MLP gate/up and down, Gemma 4's per-layer-input projections, the logits; not the
routers, whose GEMV runs inside the routing launch at decode: ``ops.linear_route``).
For T = 1, 2, 4, 8, 16, 32, 64 tokens each shape is timed as the engine runs it: a CUDA graph of at least 10 calls
over enough weight copies that no call finds its weights in L2 (``graph_timing``), median of ``--reps`` replays.
Printed per shape: µs per call for cuBLAS and Triton (the config the engine would use: tuned, else the
heuristic), each as a fraction of the memory limit (weight + activation bytes at 4.3 TB/s, ``roofline.py``);
then per model the sum over one step (calls x time): all cuBLAS, all Triton, what the engine runs (Triton up to
``backends.cuda.options.DENSE_GEMV_MAX_TOKENS``, except where a tuned file keeps cuBLAS), the faster of the two per
shape, and the memory-limited time; last, the largest T at which Triton's step total is at most cuBLAS's for
every model.

``--sweep`` times the candidate configs per shape (``int8_kernels.sweep``) and cuBLAS beside them; ``--write``
stores the best config per tuned token count and the counts where cuBLAS beat them all (the engine then keeps
cuBLAS for that shape and step size).

  python3 bench/dense_linear.py                       # on the H200: 4 models, ~2 min (compiles included);
                                                      # shapes that would start after --budget-s are skipped
  python3 bench/dense_linear.py --sweep --write       # tune dense_linear per shape at T = 1 and 16, ~3-5 min;
      # writes src/inference_server/kernels/configs/dense_linear/*.json (--out-dir elsewhere; --models to narrow)
  TRITON_INTERPRET=1 uv run python bench/dense_linear.py --device cpu --tiny --reps 1 --tokens 1   # dry run
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the reference oracles
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int8_kernels import LinearCase, SweptKernel, _short, linear_bytes, sweep
from kit.graph_timing import calls_per_graph, device_l2_bytes, rotation, time_calls  # bench/ is on the path
from roofline import HBM_BYTES_PER_S

MODELS = ("qwen3-30b-a3b", "gemma-4-26b-a4b", "gemma-4-31b", "gemma-4-e4b")
TOKENS = (1, 2, 4, 8, 16, 32, 64)
DENSE_SWEEP = (  # (block_n, block_k, split_k, num_warps, num_stages); block_t is the heuristic's
    (16, 256, 1, 4, 4), (16, 256, 1, 4, 6), (16, 512, 1, 4, 3), (16, 512, 1, 4, 4), (16, 256, 2, 4, 4),
    (16, 256, 4, 4, 4), (32, 128, 1, 4, 4), (32, 256, 1, 4, 3), (32, 256, 1, 4, 4), (32, 256, 2, 4, 4),
    (64, 128, 1, 4, 3), (64, 128, 1, 4, 4), (64, 64, 1, 4, 6), (64, 256, 1, 4, 3), (64, 128, 2, 4, 4),
    (64, 128, 4, 4, 4), (128, 128, 1, 8, 3), (128, 64, 1, 8, 4),
)

# The CUDA-core GEMV with bf16 weights (bench/sass_mix.py, git 6879ed5): 1.8-2.0 instructions per weight byte at
# T = 1, far from the issue limit, as the tensor-core kernel is (1.2-1.9): neither is instruction-bound on float
# weights, so these only test whether the GEMV's shorter per-program latency helps the small launch-bound shapes
# (Qwen's q/k/v and o at T = 1). block_k >= 256 x warps keeps the K loop in registers.
DENSE_GEMV_SWEEP = ((8, 1024, 1, 4, 1), (16, 256, 1, 1, 1), (8, 256, 1, 1, 1), (4, 1024, 2, 4, 1),
                    (8, 1024, 1, 4, 2), (8, 256, 1, 1, 2), (8, 512, 1, 2, 2))  # stages 2: two tiles ahead


@dataclass(frozen=True)
class Projection:
    """One float weight shape of a decode step: what runs it, ``[N, K]``, and how many times a step runs it."""

    name: str
    out_features: int
    in_features: int
    calls: int


def decode_projections(preset: str) -> list[Projection]:
    """Every float projection of one decode step of ``preset`` that goes through ``ops.linear`` (the routers'
    GEMVs run in their routing launch), built on the meta device and fused as the CUDA runner fuses it; equal
    shapes of one kind are merged (their calls added), in model order."""
    from inference_server.models.architectures.blocks import GatedMLP, SelfAttention
    from inference_server.models.architectures.gemma4 import Gemma4DecoderLayer, Gemma4Model
    from inference_server.models.loading.loader import build_model
    from inference_server.models.loading.presets import preset_config
    from inference_server.models.spec import parse_model_spec

    spec = parse_model_spec(preset_config(preset))
    model = build_model(spec, torch.bfloat16, "meta")
    shapes: Counter[tuple[str, int, int]] = Counter()

    def add(name: str, weight: torch.Tensor | None) -> None:
        if weight is not None:
            shapes[(name, weight.shape[0], weight.shape[1])] += 1

    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.fuse_qkv()
            add("qkv" if module.qkv_weight is not None else "q (shared KV)",
                module.qkv_weight if module.qkv_weight is not None else module.q_proj.weight)
            add("o", module.o_proj.weight)
        elif isinstance(module, GatedMLP):
            module.fuse_gate_up()
            add("gate_up", module.gate_up_weight)
            add("down", module.down_proj.weight)
        elif isinstance(module, Gemma4DecoderLayer) and module.ple_size:
            add("ple gate", module.per_layer_input_gate.weight)
            add("ple projection", module.per_layer_projection.weight)
        elif isinstance(module, Gemma4Model) and spec.ple_hidden_size:
            add("ple model projection", module.per_layer_model_projection.weight)
    add("logits", model.model.embed_tokens.weight if spec.tie_word_embeddings else model.lm_head.weight)
    return [Projection(name, n, k, calls) for (name, n, k), calls in shapes.items()]


def engine_config(tokens: int, n: int, k: int, device: torch.device) -> str:
    """The config ``dense_linear`` runs at this step size and shape: the tuned one, else the heuristic; marked
    where the tuned file keeps cuBLAS in the engine."""
    from inference_server.kernels.dense_linear import dense_linear_config
    from inference_server.kernels.int8_linear_configs import (
        DENSE_CONFIG_DIR,
        tuned_baseline_faster,
        tuned_int8_linear_config,
    )
    from inference_server.kernels.moe_configs import device_name

    tuned = tuned_int8_linear_config(tokens, n, k, torch.bfloat16, device_name(device), DENSE_CONFIG_DIR)
    text = ("tuned " + _short(tuned)) if tuned else _short(dense_linear_config(tokens, n, k))
    if tuned_baseline_faster(tokens, n, k, torch.bfloat16, device_name(device), DENSE_CONFIG_DIR):
        text += " (engine keeps cuBLAS)"
    return text


def engine_takes_triton(tokens: int, n: int, k: int, device: torch.device) -> bool:
    """Whether the CUDA backend's default options run this call as ``dense_linear`` (else cuBLAS)."""
    from inference_server.backends.cuda.options import DENSE_GEMV_MAX_TOKENS
    from inference_server.kernels.dense_linear import cublas_is_faster

    return (tokens <= DENSE_GEMV_MAX_TOKENS
            and not cublas_is_faster(tokens, n, k, torch.bfloat16, device))


def time_shape(n: int, k: int, tokens: list[int], device: torch.device, reps: int,
               l2_bytes: int) -> dict[int, tuple[float, float]]:
    """Seconds per call of cuBLAS and of ``dense_linear`` at each token count, over L2-missing weight copies."""
    from inference_server.kernels.dense_linear import dense_linear

    gen = torch.Generator(device).manual_seed(n + k)
    copies = rotation(n * k * 2, l2_bytes)
    weights = [torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * k ** -0.5
               for _ in range(copies)]
    timed = {}
    for t in tokens:
        x = torch.randn(t, k, generator=gen, device=device, dtype=torch.bfloat16)
        order = [weights[i % copies] for i in range(calls_per_graph(copies))]
        cublas = time_calls([lambda x=x, w=w: torch.nn.functional.linear(x, w) for w in order], device, reps)
        triton_s = time_calls([lambda x=x, w=w: dense_linear(x, w) for w in order], device, reps)
        timed[t] = (cublas, triton_s)
    del weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return timed


def limit_s(tokens: int, n: int, k: int) -> float:
    """The call's memory-limited time: bf16 weight and activations at 4.3 TB/s."""
    return linear_bytes(tokens, LinearCase("", n, k), 2) / HBM_BYTES_PER_S


ROW_HEADER = ("| projection | N x K | calls/step | T | cuBLAS µs | Triton µs | cuBLAS of limit | Triton of limit "
              "| speed-up | Triton config |\n|---|---|---|---|---|---|---|---|---|---|")
STEP_HEADER = ("| T | cuBLAS µs/step | Triton µs/step | engine µs/step | best of both µs/step | memory-limited µs/step "
               "| Triton speed-up |\n|---|---|---|---|---|---|---|")


def bench(models: list[str], tokens: list[int], device: torch.device, reps: int, budget_s: float) -> int | None:
    """Print the per-shape and per-step tables; return the largest T where Triton's step total is at most
    cuBLAS's for every model (None when not even T = tokens[0])."""
    l2_bytes = device_l2_bytes(device)
    started = time.monotonic()
    measured: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
    wins: dict[int, bool] = dict.fromkeys(tokens, True)
    for model in models:
        print(f"\n## {model}\n\n{ROW_HEADER}", flush=True)
        totals = {t: [0.0] * 5 for t in tokens}  # cuBLAS, Triton, engine, best of both, memory limit
        complete = True
        for p in decode_projections(model):
            n, k = p.out_features, p.in_features
            if (n, k) not in measured:
                if time.monotonic() - started > budget_s:
                    print(f"| {p.name} | {n}x{k} | {p.calls} | | skipped: past --budget-s {budget_s:.0f} |")
                    complete = False
                    continue
                measured[(n, k)] = time_shape(n, k, tokens, device, reps, l2_bytes)
            for t, (cublas, triton_s) in measured[(n, k)].items():
                limit = limit_s(t, n, k)
                print(f"| {p.name} | {n}x{k} | {p.calls} | {t} | {cublas * 1e6:.1f} | {triton_s * 1e6:.1f} | "
                      f"{limit / cublas:.2f} | {limit / triton_s:.2f} | {cublas / triton_s:.2f}x | "
                      f"{engine_config(t, n, k, device)} |", flush=True)
                engine = triton_s if engine_takes_triton(t, n, k, device) else cublas
                for i, value in enumerate((cublas, triton_s, engine, min(cublas, triton_s), limit)):
                    totals[t][i] += p.calls * value
        print(f"\n{model}, every float projection of one step{'' if complete else ' (incomplete)'}:\n\n"
              f"{STEP_HEADER}")
        for t, (cublas, triton_s, engine, both, limit) in totals.items():
            print(f"| {t} | {cublas * 1e6:.0f} | {triton_s * 1e6:.0f} | {engine * 1e6:.0f} | {both * 1e6:.0f} | "
                  f"{limit * 1e6:.0f} | {cublas / max(triton_s, 1e-12):.2f}x |", flush=True)
            wins[t] = wins[t] and triton_s <= cublas
    best = None
    for t in tokens:  # the threshold is a prefix: the first T where cuBLAS wins ends it
        if not wins[t]:
            break
        best = t
    print(f"\nlargest T with Triton's step total <= cuBLAS's for every model: {best} "
          "(backends.cuda.options.DENSE_GEMV_MAX_TOKENS)", flush=True)
    return best


def sweep_cases(models: list[str]) -> tuple[LinearCase, ...]:
    """The models' projection shapes, each once, named after its first use."""
    shapes: dict[tuple[int, int], str] = {}
    for model in models:
        for p in decode_projections(model):
            shapes.setdefault((p.out_features, p.in_features), f"{model} {p.name}")
    return tuple(LinearCase(name, n, k) for (n, k), name in shapes.items())


def dense_candidates(heuristic: Any, tokens: int, tiles: tuple[tuple[int, ...], ...] = DENSE_SWEEP,
                     gemv_tiles: tuple[tuple[int, ...], ...] = DENSE_GEMV_SWEEP) -> list[Any]:
    """The heuristic config first, then the sweep's tiles at its token tile (the tensor-core kernel), and at 1-2
    tokens the CUDA-core GEMV's (``block_t`` 1 or 2)."""
    found = [heuristic]
    for bn, bk, split, warps, stages in tiles:
        cfg = dataclasses.replace(heuristic, block_n=bn, block_k=bk, split_k=split, num_warps=warps,
                                  num_stages=stages)
        if cfg not in found:
            found.append(cfg)
    if tokens <= 2:
        for bn, bk, split, warps, stages in gemv_tiles:
            found.append(dataclasses.replace(heuristic, block_n=bn, block_t=tokens, block_k=bk, split_k=split,
                                             num_warps=warps, num_stages=stages))
    return found


def dense_kernel(tiles: tuple[tuple[int, ...], ...] = DENSE_SWEEP) -> SweptKernel:
    """``dense_linear`` for ``int8_kernels.sweep``: bf16 weights, ``tiles`` as the candidates."""
    from tests.kernels.reference_linear import dense_linear_reference

    from inference_server.kernels.dense_linear import dense_linear, dense_linear_config
    from inference_server.kernels.int8_linear_configs import DENSE_CONFIG_DIR

    def make_weights(n: int, k: int, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
        return (torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * k ** -0.5,)

    return SweptKernel("dense_linear", 2, make_weights, dense_linear, dense_linear_reference, dense_linear_config,
                       lambda heuristic, tokens: dense_candidates(heuristic, tokens, tiles), DENSE_CONFIG_DIR,
                       baseline=torch.nn.functional.linear)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default=",".join(MODELS), help="presets, comma separated")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--reps", type=int, default=20, help="timed graph replays per measurement")
    parser.add_argument("--tiny", action="store_true", help="the presets' -tiny variants (CPU dry run)")
    parser.add_argument("--sweep", action="store_true", help="tune dense_linear configs instead (--tokens 1,16)")
    parser.add_argument("--write", action="store_true", help="with --sweep: write the best configs for the engine")
    parser.add_argument("--out-dir", type=Path, default=None, help="with --write; default: the engine's directory")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new shape after this many seconds (default 150; --sweep: 420)")
    args = parser.parse_args()
    device = torch.device(args.device)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    models = [m.strip() + ("-tiny" if args.tiny else "") for m in args.models.split(",") if m.strip()]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# dense_linear vs cuBLAS on {name}: torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"median of {args.reps} graph replays", flush=True)
    if args.sweep:
        kernel = dense_kernel()
        cases = sweep_cases(models)
        sweep_tokens = tokens if args.tokens != parser.get_default("tokens") else [1, 16]
        sweep(kernel, device, args.reps, device_l2_bytes(device), cases, sweep_tokens,
              (args.out_dir or kernel.config_dir) if args.write else None,
              420.0 if args.budget_s is None else args.budget_s)
        return 0
    bench(models, tokens, device, args.reps, 150.0 if args.budget_s is None else args.budget_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
