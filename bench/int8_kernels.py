"""int8 weight-only kernels against bf16 at the real shapes: time, achieved HBM bandwidth, fraction of the limit.

Two tables (markdown, to paste):

* dense: ``kernels.int8_linear.int8_linear`` vs bf16 ``torch.nn.functional.linear`` (cuBLAS) at Gemma-4-31B's
  projections as the model runs them (fused q/k/v and gate/up) and Qwen3-30B-A3B's attention;
* MoE: ``kernels.fused_moe.fused_moe`` with int8 experts vs bf16 experts at Qwen3-30B-A3B's (E=128, H=2048,
  I=768, top-8) and Gemma-4-26B-A4B's (E=128, H=2816, I=704, top-8) expert shapes, uniform random routing;

for T = 1, 16, 64, 256 tokens. Times are device times: each measurement replays a CUDA graph of at least 10
calls (as the engine's decode steps run) timed with CUDA events, median of ``--reps`` replays. Calls rotate over
enough weight copies (dense) or fresh routings (MoE) that one call's weights are not in the 50 MB L2 from the
previous call, as in a model where each layer reads its own weights.

Bandwidth counts the bytes a perfect kernel must move: the weights (int8: plus the scales), the activations in
and the output out (MoE: the experts the routing touches, counted per call). The fraction is of the measured HBM
limit in ``bench/roofline.py`` (4.3 TB/s device-to-device copy on the lent H200) and of the 4.8 TB/s data-sheet
figure. Past T ~ 100 (dense int8) the work is compute-bound and the fraction stops meaning much.

  python3 bench/int8_kernels.py                  # on the H200: both tables, ~1-2 min (compiles included); rows
                                                 # that would start after --budget-s (165 s) are listed as skipped
  python3 bench/int8_kernels.py --sweep --write  # int8_linear configs at T = 1, 16 per dense shape, ~2 min;
                                                 # writes src/inference_server/kernels/configs/int8_linear/*.json
                                                 # (merged: token counts not swept keep their entries)
  python3 bench/int8_kernels.py --sweep --write --tokens 1,4 --paths gemv --cases gemma-4-31b
                                                 # the CUDA-core GEMV against the tuned configs, 31B only
  TRITON_INTERPRET=1 uv run python bench/int8_kernels.py --device cpu --tiny --reps 1   # CPU dry run
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kit.graph_timing import calls_per_graph, device_l2_bytes, rotation, time_calls  # bench/ is on the path
from roofline import HBM_BYTES_PER_S

HBM_SPEC_BYTES_PER_S = 4.8e12  # H200 data sheet
TOKENS = (1, 16, 64, 256)


@dataclass(frozen=True)
class LinearCase:
    name: str
    out_features: int  # N
    in_features: int  # K


@dataclass(frozen=True)
class MoeCase:
    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    activation: str
    routing_dtype: torch.dtype  # Qwen3-MoE weights in bf16, Gemma 4 in fp32


LINEAR_CASES = (
    LinearCase("gemma-4-31b qkv (sliding)", 16384, 5376),
    LinearCase("gemma-4-31b qk (full, k=v)", 18432, 5376),
    LinearCase("gemma-4-31b o (sliding)", 5376, 8192),
    LinearCase("gemma-4-31b o (full)", 5376, 16384),
    LinearCase("gemma-4-31b gate_up", 43008, 5376),
    LinearCase("gemma-4-31b down", 5376, 21504),
    LinearCase("qwen3-30b-a3b qkv", 5120, 2048),
    LinearCase("qwen3-30b-a3b o", 2048, 4096),
)
MOE_CASES = (
    MoeCase("qwen3-30b-a3b experts", 128, 2048, 768, 8, "silu", torch.bfloat16),
    MoeCase("gemma-4-26b-a4b experts", 128, 2816, 704, 8, "gelu_tanh", torch.float32),
)
TINY_LINEAR_CASES = (LinearCase("tiny", 37, 100),)
TINY_MOE_CASES = (MoeCase("tiny experts", 8, 64, 24, 2, "silu", torch.bfloat16),)


def linear_bytes(tokens: int, case: LinearCase, weight_bytes: int, act_bytes: int = 2) -> int:
    """Bytes one linear call must move: weight (+ per-row scale for int8), input and output activations."""
    n, k = case.out_features, case.in_features
    scales = n * act_bytes if weight_bytes == 1 else 0
    return n * k * weight_bytes + scales + tokens * (k + n) * act_bytes


def moe_bytes(tokens: int, touched_experts: float, case: MoeCase, weight_bytes: int, act_bytes: int = 2) -> float:
    """Bytes one MoE call must move: the touched experts' gate/up and down weights (+ their scales for int8),
    the hidden states in and out."""
    h, i = case.hidden, case.intermediate
    per_expert = 3 * i * h * weight_bytes + ((2 * i + h) * act_bytes if weight_bytes == 1 else 0)
    return touched_experts * per_expert + 2 * tokens * h * act_bytes


def fraction_row(label: str, tokens: int, bf16_s: float, bf16_bytes: float, int8_s: float, int8_bytes: float) -> str:
    """One markdown row: times, achieved bandwidths, int8's fraction of the measured and data-sheet limits."""
    int8_bw = int8_bytes / int8_s
    return (f"| {label} | {tokens} | {bf16_s * 1e6:.1f} | {bf16_bytes / bf16_s / 1e12:.2f} | {int8_s * 1e6:.1f} | "
            f"{int8_bw / 1e12:.2f} | {int8_bw / HBM_BYTES_PER_S:.2f} | {int8_bw / HBM_SPEC_BYTES_PER_S:.2f} | "
            f"{bf16_s / int8_s:.2f}x |")


TABLE_HEADER = ("| case | T | bf16 µs | bf16 TB/s | int8 µs | int8 TB/s | int8 of 4.3 TB/s | int8 of 4.8 TB/s "
                "| int8 speed-up |\n|---|---|---|---|---|---|---|---|---|")


MOE_TABLE_HEADER = (TABLE_HEADER.split("\n")[0] + " int8, exponent-trick dequant: µs (of 4.3 TB/s) |\n"
                    + TABLE_HEADER.split("\n")[1] + "---|")


def bench_linear(case: LinearCase, tokens: int, device: torch.device, reps: int, l2_bytes: int) -> str:
    from inference_server.kernels.int8_linear import int8_linear
    from inference_server.kernels.reference_int8 import quantize_int8_per_channel

    gen = torch.Generator(device).manual_seed(tokens)
    n, k = case.out_features, case.in_features
    x = torch.randn(tokens, k, generator=gen, device=device, dtype=torch.bfloat16)
    results = []
    for weight_bytes in (2, 1):
        copies = rotation(n * k * weight_bytes, l2_bytes)
        weights = [torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * k ** -0.5
                   for _ in range(copies)]
        if weight_bytes == 2:
            fns = [lambda w=w: torch.nn.functional.linear(x, w) for w in weights]
        else:
            quantized = [quantize_int8_per_channel(w) for w in weights]
            del weights
            fns = [lambda q=q, s=s: int8_linear(x, q, s) for q, s in quantized]
        calls = [fns[i % copies] for i in range(calls_per_graph(copies))]
        results.append((time_calls(calls, device, reps), linear_bytes(tokens, case, weight_bytes)))
        del fns, calls
    (bf16_s, bf16_b), (int8_s, int8_b) = results
    return fraction_row(f"{case.name} [{n}x{k}]", tokens, bf16_s, bf16_b, int8_s, int8_b)


def bench_moe(case: MoeCase, tokens: int, device: torch.device, reps: int, experts: tuple) -> str:
    from inference_server.kernels.fused_moe import fused_moe, moe_kernel_config

    w_gu, w_dn, q_gu, s_gu, q_dn, s_dn = experts
    gen = torch.Generator(device).manual_seed(tokens)
    x = torch.randn(tokens, case.hidden, generator=gen, device=device, dtype=torch.bfloat16)
    routings = []
    for _ in range(calls_per_graph(1)):  # a fresh routing per call: the touched experts change, as across layers
        ids = torch.rand(tokens, case.experts, generator=gen, device=device).argsort(dim=1)[:, :case.top_k]
        weights = torch.softmax(torch.randn(tokens, case.top_k, generator=gen, device=device), -1)
        routings.append((ids, weights.to(case.routing_dtype)))
    touched = statistics.mean(float(ids.unique().numel()) for ids, _ in routings)
    bf16 = [lambda r=r: fused_moe(x, w_gu, w_dn, r[1], r[0], case.activation) for r in routings]
    int8 = [lambda r=r: fused_moe(x, q_gu, q_dn, r[1], r[0], case.activation, w_gate_up_scale=s_gu,
                                  w_down_scale=s_dn) for r in routings]
    base = moe_kernel_config(tokens, case.hidden, case.intermediate, case.experts, case.top_k)
    magic = dataclasses.replace(base, gate_up=dataclasses.replace(base.gate_up, magic_dequant=1),
                                down=dataclasses.replace(base.down, magic_dequant=1))
    int8_magic = [lambda r=r: fused_moe(x, q_gu, q_dn, r[1], r[0], case.activation, w_gate_up_scale=s_gu,
                                        w_down_scale=s_dn, config=magic) for r in routings]
    bf16_s, int8_s = time_calls(bf16, device, reps), time_calls(int8, device, reps)
    magic_s = time_calls(int8_magic, device, reps)
    int8_bytes = moe_bytes(tokens, touched, case, 1)
    label = f"{case.name} [E={case.experts} H={case.hidden} I={case.intermediate} K={case.top_k}]"
    return (fraction_row(label, tokens, bf16_s, moe_bytes(tokens, touched, case, 2), int8_s, int8_bytes)
            + f" {magic_s * 1e6:.1f} ({int8_bytes / magic_s / HBM_BYTES_PER_S:.2f}) |")


def make_experts(case: MoeCase, device: torch.device) -> tuple:
    from inference_server.kernels.reference_int8 import quantize_int8_per_channel

    gen = torch.Generator(device).manual_seed(0)
    e, h, i = case.experts, case.hidden, case.intermediate
    w_gu = torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=torch.bfloat16) * h ** -0.5
    w_dn = torch.randn(e, h, i, generator=gen, device=device, dtype=torch.bfloat16) * i ** -0.5
    return (w_gu, w_dn, *quantize_int8_per_channel(w_gu), *quantize_int8_per_channel(w_dn))


SWEEP = (  # (block_n, block_k, split_k, num_warps, num_stages); block_t is the heuristic's for the token count
    (32, 128, 1, 4, 4), (32, 256, 1, 4, 3), (64, 128, 1, 4, 4), (64, 128, 1, 4, 6), (64, 256, 1, 4, 3),
    (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (64, 256, 4, 4, 3), (64, 128, 8, 4, 4), (128, 128, 1, 8, 3),
    (128, 128, 2, 8, 3), (128, 64, 4, 8, 4),
)


GEMV_SWEEP = (  # the CUDA-core GEMV (block_t < 16): (block_n, block_k, split_k, num_warps, num_stages)
    # bench/sass_mix.py (git 6879ed5): with bf16 activations the K loop stays in registers only where
    # block_k >= 256 x warps
    # (a thread's 16-byte activation load must hold its weight columns); 8-16 rows x 1024 columns issue 3.8-4.0
    # instructions per int8 byte at T = 1 (32-34 B/clk/SM, HBM needs ~18), 5.0-5.4 at T = 2, 7.3-7.9 at T = 4
    # 256 columns a warp: one warp with 256-column tiles divides K = 5376 (whole tiles, no masks), 4 warps with 1024
    # do not (a masked tail: 4.2-4.5 instructions per byte)
    (16, 256, 1, 1, 1), (8, 256, 1, 1, 1), (16, 1024, 1, 4, 1), (8, 1024, 1, 4, 1), (8, 2048, 1, 8, 1),
    (16, 512, 2, 2, 1),
    # num_stages 2: weight tiles two iterations ahead (whole K tiles only; a ragged K runs the stages-1 loop)
    (8, 256, 1, 1, 2), (16, 256, 1, 1, 2), (8, 512, 1, 2, 2), (8, 1024, 1, 4, 2),
    # four rows a program: twice the programs for the narrow shapes (o, down: N = 5376 rows)
    (4, 1024, 1, 2, 1), (4, 1024, 1, 2, 2),
)
GEMV_SWEEP_T4 = ((16, 256, 1, 1, 1), (16, 1024, 1, 4, 1))  # at 3-4 tokens the SASS bound is below HBM's: a check
MAGIC_SWEEP = ((32, 256, 1, 4, 3), (64, 128, 1, 4, 4), (64, 256, 4, 4, 3), (128, 128, 1, 8, 3))


PATHS = ("dot", "magic", "gemv")


def sweep_candidates(heuristic: Any, tokens: int, paths: tuple[str, ...] = PATHS) -> list[Any]:
    """The heuristic config first, then the sweep's tiles at its token tile ("dot"), the tensor-core kernel with
    the exponent-trick dequantisation ("magic"), and (at 4 tokens or fewer) the CUDA-core GEMV with up to 4
    tokens a program ("gemv")."""
    from inference_server.kernels.int8_linear_configs import Int8LinearConfig

    found = [heuristic]
    configs = []
    if "dot" in paths:
        configs += [Int8LinearConfig(bn, heuristic.block_t, bk, split, warps, stages)
                    for bn, bk, split, warps, stages in SWEEP]
    if "magic" in paths:
        configs += [Int8LinearConfig(bn, heuristic.block_t, bk, split, warps, stages, magic_dequant=1)
                    for bn, bk, split, warps, stages in MAGIC_SWEEP]
    if tokens <= 4 and "gemv" in paths:  # the GEMV keeps one accumulator per token: at most 4 a program
        block_t = 1 << (tokens - 1).bit_length()
        configs += [Int8LinearConfig(bn, block_t, bk, split, warps, stages)
                    for bn, bk, split, warps, stages in (GEMV_SWEEP if tokens <= 2 else GEMV_SWEEP_T4)]
    for cfg in configs:
        if cfg not in found:
            found.append(cfg)
    return found


@dataclass(frozen=True)
class SweptKernel:
    """What ``sweep`` needs of a ``streamed_linear`` front (``int8_linear`` here, ``dense_linear`` in
    ``bench/dense_linear.py``): its weights for a shape, a call with a config, its reference, its heuristic, its
    candidate configs for a token count, and where the engine reads its tuned configs."""

    name: str
    weight_bytes: int  # bytes of one weight element (the byte count of the fraction column)
    make_weights: Callable[[int, int, torch.Generator, torch.device], tuple[torch.Tensor, ...]]  # (n, k, ...)
    run: Callable[..., torch.Tensor]  # (x, *weights, config=...)
    reference: Callable[..., torch.Tensor]  # (x, *weights)
    heuristic: Callable[[int, int, int], Any]  # (tokens, n, k) -> config
    candidates: Callable[[Any, int], list[Any]]  # (heuristic config, tokens) -> configs, the heuristic's first
    config_dir: Path
    baseline: Callable[..., torch.Tensor] | None = None  # (x, *weights): what the engine runs otherwise (cuBLAS)


def int8_kernel(paths: tuple[str, ...] = PATHS) -> SweptKernel:
    """``int8_linear`` for ``sweep``: bf16 weights quantized per row, the candidates of ``paths``."""
    from inference_server.kernels.int8_linear import int8_linear, int8_linear_config
    from inference_server.kernels.int8_linear_configs import CONFIG_DIR
    from inference_server.kernels.reference_int8 import int8_linear_reference, quantize_int8_per_channel

    def make_weights(n: int, k: int, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
        return quantize_int8_per_channel(torch.randn(n, k, generator=gen, device=device) * k ** -0.5, torch.bfloat16)

    return SweptKernel("int8_linear", 1, make_weights, int8_linear, int8_linear_reference, int8_linear_config,
                       lambda heuristic, tokens: sweep_candidates(heuristic, tokens, paths), CONFIG_DIR)


def sweep(kernel: SweptKernel, device: torch.device, reps: int, l2_bytes: int, cases: tuple[LinearCase, ...],
          tokens: list[int], out_dir: Path | None, budget_s: float = float("inf")) -> None:
    """Time the kernel's candidate configs per shape and token count; print the heuristic's and the best time (and
    the baseline's, where the kernel has one); with ``out_dir``, write each shape's best configs where the kernel
    reads them, and the token counts where the baseline beat them all (``baseline_faster``). Shapes that would
    start after ``budget_s`` seconds are listed as skipped."""
    import json

    import triton

    from inference_server.kernels.int8_linear_configs import config_file_name, config_from_json, config_to_json
    from inference_server.kernels.moe_configs import device_name

    started = time.monotonic()
    extra = ("", "") if kernel.baseline is None else (" baseline µs |", "---|")
    print(f"| case | T | heuristic config | heuristic µs | best config | best µs | best of 4.3 TB/s |{extra[0]}"
          f"  ({kernel.name})\n|---|---|---|---|---|---|---|{extra[1]}")
    for case in cases:
        n, k = case.out_features, case.in_features
        if time.monotonic() - started > budget_s:
            print(f"| {case.name} [{n}x{k}] | | skipped: past --budget-s {budget_s:.0f} |", flush=True)
            continue
        gen = torch.Generator(device).manual_seed(1)
        path = (out_dir or kernel.config_dir) / config_file_name(device_name(device), n, k, torch.bfloat16)
        old_body = json.loads(path.read_text()) if path.is_file() else {}
        previous = {int(t): config_from_json(c) for t, c in old_body.get("configs", {}).items()}
        copies = rotation(n * k * kernel.weight_bytes, l2_bytes)
        weights = [kernel.make_weights(n, k, gen, device) for _ in range(copies)]
        best_configs: dict[str, dict[str, int]] = {}
        records = []
        baseline_faster = []
        for t in tokens:
            x = torch.randn(t, k, generator=gen, device=device, dtype=torch.bfloat16)
            expected = kernel.reference(x, *weights[0]).float()
            heuristic = kernel.heuristic(t, n, k)
            timed: dict[Any, float] = {}
            tuned = previous.get(t)  # the file's config for this count competes again
            for cfg in kernel.candidates(heuristic, t) + ([tuned] if tuned is not None else []):
                if cfg in timed:
                    continue
                try:
                    got = kernel.run(x, *weights[0], config=cfg).float()
                except Exception as err:  # out of shared memory and the like: not a candidate
                    print(f"  skip {_short(cfg)}: {type(err).__name__}", file=sys.stderr)
                    continue
                if (got - expected).abs().max() > 2**-6 * expected.abs().max():
                    print(f"  skip {_short(cfg)}: output differs", file=sys.stderr)
                    continue
                calls = [lambda x=x, w=w, c=cfg: kernel.run(x, *w, config=c) for w in weights]
                timed[cfg] = time_calls([calls[i % copies] for i in range(calls_per_graph(copies))], device, reps)
            best = min(timed, key=timed.__getitem__)
            best_bw = linear_bytes(t, case, kernel.weight_bytes) / timed[best]
            record = dict(tokens=t, best=_short(best), us=round(timed[best] * 1e6, 2),
                          heuristic_us=round(timed[heuristic] * 1e6, 2))
            row = (f"| {case.name} [{n}x{k}] | {t} | {_short(heuristic)} | {timed[heuristic] * 1e6:.1f} | "
                   f"{_short(best)} | {timed[best] * 1e6:.1f} | {best_bw / HBM_BYTES_PER_S:.2f} |")
            if kernel.baseline is not None:
                base = [lambda x=x, w=w, f=kernel.baseline: f(x, *w) for w in weights]
                base_s = time_calls([base[i % copies] for i in range(calls_per_graph(copies))], device, reps)
                record["baseline_us"] = round(base_s * 1e6, 2)
                row += f" {base_s * 1e6:.1f}{' (faster)' if base_s < timed[best] else ''} |"
                if base_s < timed[best]:
                    baseline_faster.append(t)
            print(row, flush=True)
            best_configs[str(t)] = config_to_json(best)
            records.append(record)
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if out_dir is not None:  # merged into the file: token counts not swept now keep their entries
            out_dir.mkdir(parents=True, exist_ok=True)
            meta = dict(case=case.name, torch=torch.__version__, triton=triton.__version__)
            swept = {int(t) for t in best_configs}
            configs = {t: c for t, c in old_body.get("configs", {}).items() if int(t) not in swept} | best_configs
            records = [r for r in old_body.get("sweep", []) if r.get("tokens") not in swept] + records
            body: dict[str, Any] = dict(meta=meta, configs=dict(sorted(configs.items(), key=lambda i: int(i[0]))),
                                        sweep=sorted(records, key=lambda r: r["tokens"]))
            if kernel.baseline is not None:
                kept = [t for t in old_body.get("baseline_faster", []) if t not in swept]
                body["baseline_faster"] = sorted(kept + baseline_faster)
            path.write_text(json.dumps(body, indent=1) + "\n")
            print(f"  wrote {path}", flush=True)


def _short(cfg: Any) -> str:
    c = cfg.__dict__
    path = " gemv" if c["block_t"] < 16 else (" magic" if c.get("magic_dequant") else "")
    return (f"n{c['block_n']} t{c['block_t']} k{c['block_k']} s{c['split_k']} w{c['num_warps']} "
            f"st{c['num_stages']}{path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--reps", type=int, default=20, help="timed graph replays per measurement")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run under TRITON_INTERPRET=1)")
    parser.add_argument("--sweep", action="store_true", help="time int8_linear configs instead (--tokens 1,16)")
    parser.add_argument("--write", action="store_true", help="with --sweep: write the best configs for int8_linear")
    parser.add_argument("--out-dir", type=Path, default=None, help="with --write; default: the engine's directory")
    parser.add_argument("--only", choices=("dense", "moe"), default=None)
    parser.add_argument("--paths", default=",".join(PATHS), help="with --sweep: kernel paths to try (dot,magic,gemv)")
    parser.add_argument("--cases", default="", help="dense cases whose name holds one of these, comma separated "
                        "(e.g. gemma-4-31b); default all")
    parser.add_argument("--models", default="", help="dense cases: these presets' projection shapes (comma "
                        "separated; the lm_head stays bf16, so not its shape) instead of the built-in list")
    parser.add_argument("--budget-s", type=float, default=165.0,
                        help="start no new row after this many seconds (the rows left are listed as skipped)")
    args = parser.parse_args()
    device = torch.device(args.device)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    linear_cases = TINY_LINEAR_CASES if args.tiny else LINEAR_CASES
    if args.models:
        from dense_linear import sweep_cases  # bench/ is on the path

        linear_cases = tuple(LinearCase(c.name, c.out_features, c.in_features)
                             for c in sweep_cases(args.models.split(",")) if not c.name.endswith(" logits"))
    wanted = [c for c in args.cases.split(",") if c]
    linear_cases = tuple(c for c in linear_cases if not wanted or any(w in c.name for w in wanted))
    moe_cases = TINY_MOE_CASES if args.tiny else MOE_CASES
    l2_bytes = device_l2_bytes(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# int8 kernels on {name}: torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"median of {args.reps} graph replays", flush=True)
    if args.sweep:
        from inference_server.kernels.int8_linear_configs import CONFIG_DIR

        sweep_tokens = tokens if args.tokens != parser.get_default("tokens") else [1, 16]
        sweep(int8_kernel(tuple(args.paths.split(","))), device, args.reps, l2_bytes, linear_cases, sweep_tokens,
              (args.out_dir or CONFIG_DIR) if args.write else None, args.budget_s)
        return 0
    started = time.monotonic()

    def in_budget(label: str, t: int) -> bool:
        if time.monotonic() - started < args.budget_s:
            return True
        print(f"| {label} | {t} | skipped: past --budget-s {args.budget_s:.0f} |", flush=True)
        return False

    if args.only in (None, "dense"):
        print("\n" + TABLE_HEADER, flush=True)
        for case in linear_cases:
            for t in tokens:
                if in_budget(case.name, t):
                    print(bench_linear(case, t, device, args.reps, l2_bytes), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next shape's weight copies
    if args.only in (None, "moe"):
        print("\n" + MOE_TABLE_HEADER, flush=True)
        for case in moe_cases:
            experts = make_experts(case, device)
            for t in tokens:
                if in_budget(case.name, t):
                    print(bench_moe(case, t, device, args.reps, experts), flush=True)
            del experts
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
