"""Tune the fused MoE's launch configs on this GPU and write them where the engine reads them.

For one MoE model's expert shape (a preset: E experts, hidden H, expert intermediate I, top-k K) and each token
count, time ``kernels.fused_moe.fused_moe`` (alignment, gate/up GEMM, down GEMM, k-sum) on random bf16 inputs
with uniform random routing, over candidate configs:

* BLOCK_M in {16, 32, 64, 128} (the expert-group padding: at most twice the expected rows per active expert);
* per grouped GEMM, BLOCK_N in {32, 64, 128}, BLOCK_K in {64, 128}, warps in {4, 8}, stages in {3, 4}: first the
  gate/up GEMM's tiles with the heuristic's down tiles, then the down GEMM's with the best gate/up tiles.

A candidate counts only if its output equals the heuristic config's within bf16 rounding (same math, other
tiling: the fp32 accumulation order may differ); one that fails to compile (shared memory) or differs is
recorded and skipped. Each candidate is timed as the engine runs it: inside a CUDA graph (no host launch cost;
timing the eager call measured the Python wrapper, ~100-200 us, and picked configs that were slower in the
engine), over copies of the expert weights that together exceed twice the L2 cache, one after the other as
consecutive layers read them (so no call finds its weights in L2). The fastest (median over ``--reps`` replays)
is written per token count to ``src/inference_server/kernels/configs/fused_moe/<name>.json``
(``moe_configs.config_file_name``), with the heuristic's time beside it; ``fused_moe`` then picks the entry of the
nearest tuned token count. Tuned token counts are the runner's decode buckets and the power-of-two eager ladder,
so every config the server uses is compiled at start-up.

  python3 bench/tune_triton_launch.py --model qwen3-30b-a3b                # on the H200: minutes per model
  python3 bench/tune_triton_launch.py --model gemma-4-26b-a4b --tokens 1,16,64,256
  uv run python bench/tune_triton_launch.py --model qwen3-30b-a3b --device cpu --out-dir /tmp/moe  # dry run

``--int8`` tunes the int8-expert path (weights quantized per output row, ``reference_int8``), written to the
``dtype=int8`` file that ``fused_moe`` reads for int8 experts.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kit.graph_timing import device_l2_bytes, rotation, time_calls

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256)
EAGER_LADDER = (512, 1024, 2048, 4096)
MOE_PRESETS = ("qwen3-30b-a3b", "gemma-4-26b-a4b")


def expert_shape(preset: str) -> tuple[int, int, int, int]:
    """(E, H, I, K) of a MoE preset (``-tiny`` presets too)."""
    from inference_server.models.loading.presets import preset_config
    from inference_server.models.spec import parse_model_spec

    spec = parse_model_spec(preset_config(preset))
    if not spec.num_experts:
        raise SystemExit(f"{preset} has no routed experts")
    return spec.num_experts, spec.hidden_size, spec.moe_intermediate_size, spec.experts_top_k


def candidates(tokens: int, base, top_k: int, quick: int, current=None) -> list:
    """Configs to time for ``tokens``: the heuristic ``base`` first, then the config the engine uses today
    (``current``: the nearest entry of the file being replaced), then the sweep. BLOCK_M goes no lower than half
    the heuristic's (smaller blocks re-read each expert's weights once per block); ``quick`` > 0 keeps that many."""
    from inference_server.kernels.moe_configs import MoeGemmConfig, MoeKernelConfig

    rows = max(1, tokens * top_k)
    block_ms = [m for m in (16, 32, 64, 128) if base.block_m // 2 <= m <= max(16, 2 * triton.next_power_of_2(rows))]
    tiles = [MoeGemmConfig(n, k, 1, w, s) for n, k, w, s in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4))]
    found = [base] + ([current] if current is not None else [])
    for block_m in block_ms:
        found += [MoeKernelConfig(block_m, tile, base.down) for tile in tiles]
    found = list(dict.fromkeys(found))  # base or current may also be a sweep point: each is timed once
    return found[:quick] if quick else found


def tune_tokens(tokens: int, shape: tuple[int, int, int, int], device: torch.device, reps: int, quick: int,
                seed: int = 0, int8: bool = False, current=None) -> dict:
    """The fastest config for one token count that matches the heuristic's output; a record of the sweep, with the
    time of ``current`` (the config the engine used for this token count before) where there was one."""
    from inference_server.kernels.fused_moe import fused_moe, moe_kernel_config
    from inference_server.kernels.moe_configs import MoeKernelConfig, config_to_json

    E, H, inter, K = shape
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(seed + tokens)
    hidden = torch.randn(tokens, H, generator=gen).to(device, dtype)
    w_gate_up = (torch.randn(E, 2 * inter, H, generator=gen) * H ** -0.5).to(device, dtype)
    w_down = (torch.randn(E, H, inter, generator=gen) * inter ** -0.5).to(device, dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).to(device)
    scales: dict[str, torch.Tensor] = {}
    if int8:  # int8 experts with per-row scales (reference_int8's format)
        from inference_server.kernels.reference_int8 import quantize_int8_per_channel

        w_gate_up, gate_up_scale = quantize_int8_per_channel(w_gate_up)
        w_down, down_scale = quantize_int8_per_channel(w_down)
        scales = dict(w_gate_up_scale=gate_up_scale, w_down_scale=down_scale)
    # only the routed experts' weights are read: those bytes must exceed L2 over the copies
    touched = int(ids.unique().numel()) * (w_gate_up[0].numel() + w_down[0].numel()) * w_gate_up.element_size()
    copies = rotation(touched, device_l2_bytes(device)) if device.type == "cuda" else 1
    layers = [(w_gate_up, w_down)] + [(w_gate_up.clone(), w_down.clone()) for _ in range(copies - 1)]
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1).to(device, dtype)
    base = moe_kernel_config(tokens, H, inter, E, K)
    expected = fused_moe(hidden, w_gate_up, w_down, weights, ids, "silu", config=base, **scales)
    scale = expected.float().abs().max().item() or 1.0

    def run(config: MoeKernelConfig) -> tuple[float | None, str]:
        try:
            out = fused_moe(hidden, w_gate_up, w_down, weights, ids, "silu", config=config, **scales)
        except Exception as err:  # e.g. out of shared memory: not a candidate
            return None, f"failed: {type(err).__name__}"
        error = (out.float() - expected.float()).abs().max().item() / scale
        if error > 2 ** -6:  # a few bf16 ulps of the largest output
            return None, f"differs: {error:.2e}"
        calls = [functools.partial(fused_moe, hidden, *layer, weights, ids, "silu", config=config, **scales)
                 for layer in layers]
        return time_calls(calls, device, reps), "ok"

    results: list[tuple[float, MoeKernelConfig]] = []
    rejected: list[str] = []
    for config in candidates(tokens, base, K, quick, current):
        seconds, status = run(config)
        if seconds is None:
            rejected.append(f"{config}: {status}")
        else:
            results.append((seconds, config))
    base_seconds = next(s for s, c in results if c == base)
    best_seconds, best = min(results, key=lambda item: item[0])
    # then the down GEMM's tiles, with the best gate/up tiles
    timed = {c for _, c in results}
    for tile in {c.gate_up for c in timed}:
        config = MoeKernelConfig(best.block_m, best.gate_up, tile)
        if config in timed:
            continue
        seconds, status = run(config)
        if seconds is None:
            rejected.append(f"{config}: {status}")
        elif seconds < best_seconds:
            best_seconds, best = seconds, config
    current_seconds = next((s for s, c in results if c == current), None)
    return dict(tokens=tokens, config=config_to_json(best), us=round(best_seconds * 1e6, 2),
                heuristic_us=round(base_seconds * 1e6, 2), speedup=round(base_seconds / best_seconds, 3),
                current_us=None if current_seconds is None else round(current_seconds * 1e6, 2),
                timed=len(results), rejected=rejected[:20])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[*MOE_PRESETS, *(f"{p}-tiny" for p in MOE_PRESETS)], required=True)
    parser.add_argument("--tokens", default=",".join(map(str, DECODE_BUCKETS + EAGER_LADDER)))
    parser.add_argument("--reps", type=int, default=20, help="timed graph replays (CPU: calls) per candidate")
    parser.add_argument("--quick", type=int, default=0, help="time only the first N candidates (dry runs)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: the engine's config directory")
    parser.add_argument("--int8", action="store_true", help="tune int8 experts (bf16 activations)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads the switch when it is imported (above): run again with it set.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from inference_server.kernels.moe_configs import CONFIG_DIR, config_file_name, config_from_json, device_name

    shape = expert_shape(args.model)
    name = device_name(device)
    out_dir = args.out_dir or CONFIG_DIR
    path = out_dir / config_file_name(name, *shape, torch.int8 if args.int8 else torch.bfloat16)
    meta = dict(model=args.model, device=name, torch=torch.__version__, triton=__import__("triton").__version__,
                experts=shape[0], hidden=shape[1], intermediate=shape[2], top_k=shape[3],
                dtype="int8" if args.int8 else "bfloat16")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Token counts not tuned now keep their entries (the file name fixes the GPU, the expert shape and the dtype).
    previous = json.loads(path.read_text()) if path.exists() else {}
    kept = {int(r["tokens"]): r for r in previous.get("sweep", [])}
    used = {int(t): config_from_json(c) for t, c in previous.get("configs", {}).items()}
    for tokens in sorted({int(t) for t in args.tokens.split(",") if t}):
        current = used[min(used, key=lambda t: (abs(t - tokens), t))] if used else None
        record = tune_tokens(tokens, shape, device, args.reps, args.quick, int8=args.int8, current=current)
        kept[tokens] = record
        print(f"T={tokens}: {record['us']} us (heuristic {record['heuristic_us']} us, x{record['speedup']}; "
              f"before {record['current_us']} us) {record['config']}", flush=True)
        # Written after every token count, so a run stopped by a time limit keeps what it tuned.
        records = [kept[t] for t in sorted(kept)]
        path.write_text(json.dumps(dict(meta=meta, configs={str(r["tokens"]): r["config"] for r in records},
                                        sweep=records), indent=1) + "\n")
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
