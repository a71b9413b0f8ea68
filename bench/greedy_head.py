"""The fused greedy head (``kernels.greedy_head``) against the unfused path the runner takes without it:
``compute_logits`` (the head GEMM through cuBLAS, Gemma's soft-cap) + ``sampler.sample`` on an all-greedy batch.

At the real head shapes (Qwen3-30B-A3B: vocabulary 151,936 x hidden 2048, untied; Gemma 4 E4B / 26B-A4B /
31B: 262,144 x 2560 / 2816 / 5376, tied, soft-cap 30), bf16, for N = 1, 16, 64 rows. Each time is device time:
a CUDA graph of at least 10 calls (as the runner would replay them), CUDA events around each replay, median of
``--reps`` replays (``graph_timing.time_calls``). The head weights (0.6-2.8 GB) are far larger than the L2, so
every call reads its weight from HBM. The fraction is of the memory limit: head bytes / 4.3e12 B/s (the measured
HBM copy rate, ``roofline.HBM_BYTES_PER_S``) over the time. Each row also says whether the two paths chose the
same tokens (they must, but for top-2 near-ties: the kernel's fp32 sums round like cuBLAS's but for summation
order).

``--int8``: the heads in int8 (``reference_int8``'s format, bf16 row scales: ``INT8_EMBEDDINGS=on``), the fused
int8 greedy head against the unfused int8 path (``kernels.int8_linear``, the runner's ``ops.int8_linear``, then the
soft-cap and the sampler); the limit counts the int8 bytes and the scales. ``--sweep`` then times int8 launch
configs (``SWEEP_INT8``: tile shapes, stages, the exponent-trick dequantisation on and off).

  python3 bench/greedy_head.py              # on the H200: the table, ~1 min (compiles included)
  python3 bench/greedy_head.py --int8 --sweep --models gemma-4-31b   # the int8 head of Gemma-4-31B, ~1-2 min
  python3 bench/greedy_head.py --sweep      # + a sweep of launch configs per shape, ~2 min more
  TRITON_INTERPRET=1 uv run python bench/greedy_head.py --device cpu --tiny --reps 1   # CPU dry run
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the reference oracles
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import calls_per_graph, device_l2_bytes, rotation, time_calls  # bench/ is on the path
from roofline import HBM_BYTES_PER_S

ROWS = (1, 16, 64)


@dataclass(frozen=True)
class Head:
    model: str
    vocab: int
    hidden: int
    softcap: float | None


HEADS = (
    Head("qwen3-30b-a3b", 151936, 2048, None),
    Head("gemma-4-e4b", 262144, 2560, 30.0),
    Head("gemma-4-26b-a4b", 262144, 2816, 30.0),
    Head("gemma-4-31b", 262144, 5376, 30.0),
)
TINY_HEADS = (Head("tiny", 1000, 64, None), Head("tiny-capped", 777, 96, 30.0))

SWEEP = (  # (block_v, block_k, num_warps, num_stages)
    (64, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (128, 128, 8, 4), (128, 64, 4, 5),
    (32, 256, 4, 4), (64, 64, 4, 6),
)
SWEEP_INT8 = (  # (block_v, block_k, num_warps, num_stages, magic_dequant): int8 tiles of 8-32 KB
    (64, 256, 4, 4, True), (64, 256, 4, 3, True), (64, 256, 4, 2, True), (64, 256, 4, 4, False),
    (64, 256, 4, 3, False), (64, 128, 4, 4, True), (64, 128, 4, 6, True), (128, 128, 4, 4, True),
    (128, 256, 8, 3, True), (64, 512, 4, 2, True), (32, 512, 4, 3, True), (128, 128, 8, 4, False),
)


HeadWeight = tuple[torch.Tensor, torch.Tensor | None]
"""(weight [V, H], scale [V] or None): a bf16 head, or an int8 one with its row scales."""


def head_bytes(head: Head, rows: int, int8: bool = False) -> int:
    """Bytes a perfect head must move: the weight (bf16, or int8 and its bf16 row scales), the hidden rows in (the
    token ids out are noise)."""
    weight = head.vocab * head.hidden + 2 * head.vocab if int8 else 2 * head.vocab * head.hidden
    return weight + 2 * rows * head.hidden


def make_head(head: Head, device: torch.device, l2_bytes: int, int8: bool = False) -> list[HeadWeight]:
    """Enough weight copies that no call finds its weight in L2 (one for every real head; one on the CPU)."""
    from inference_server.kernels.reference_int8 import quantize_int8_per_channel

    gen = torch.Generator(device).manual_seed(head.vocab + head.hidden)
    copies = rotation(head_bytes(head, 0, int8), l2_bytes) if device.type == "cuda" else 1
    weights: list[HeadWeight] = []
    for _ in range(copies):
        weight = (torch.randn(head.vocab, head.hidden, generator=gen, device=device) * head.hidden ** -0.5)
        weights.append(quantize_int8_per_channel(weight, torch.bfloat16) if int8 else (weight.to(torch.bfloat16), None))
        del weight
    return weights


def unfused(hidden: torch.Tensor, weight: HeadWeight, softcap: float | None, batch) -> torch.Tensor:
    """The runner's path without the fused head: ``compute_logits`` (as ``logits_reference`` writes it; an int8
    head through the Triton ``int8_linear``, the CUDA runner's ``ops.int8_linear``) and ``sample``; returns the
    token ids."""
    from tests.kernels.reference_greedy_head import logits_reference

    from inference_server.backends.sampler import sample
    from inference_server.models.architectures.layers import softcap as apply_softcap

    w, scale = weight
    if scale is None:
        return sample(logits_reference(hidden, w, softcap), batch).token_ids
    from inference_server.kernels.int8_linear import int8_linear

    return sample(apply_softcap(int8_linear(hidden, w, scale), softcap), batch).token_ids


def fused(hidden: torch.Tensor, weight: HeadWeight, softcap: float | None, config=None) -> tuple:
    from inference_server.kernels.greedy_head import greedy_head

    return greedy_head(hidden, weight[0], softcap, config, scale=weight[1])


def bench_head(head: Head, rows: int, weights: list[HeadWeight], device: torch.device, reps: int) -> dict:
    from inference_server.backends.sampler import SamplingBatch
    from inference_server.records.sampling_params import SamplingParams

    gen = torch.Generator(device).manual_seed(rows)
    hidden = (torch.randn(rows, head.hidden, generator=gen, device=device) * 3).to(torch.bfloat16)
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.0, max_tokens=8)] * rows, device)
    copies = len(weights)
    n = calls_per_graph(copies)
    fused_calls = [lambda w=weights[i % copies]: fused(hidden, w, head.softcap) for i in range(n)]
    unfused_calls = [lambda w=weights[i % copies]: unfused(hidden, w, head.softcap, batch) for i in range(n)]
    fused_s = time_calls(fused_calls, device, reps)
    unfused_s = time_calls(unfused_calls, device, reps)
    fused_ids = fused(hidden, weights[0], head.softcap)[0]
    same = int((fused_ids == unfused(hidden, weights[0], head.softcap, batch)).sum())
    limit_s = head_bytes(head, rows, weights[0][1] is not None) / HBM_BYTES_PER_S
    return dict(model=head.model, rows=rows, fused_us=fused_s * 1e6, unfused_us=unfused_s * 1e6,
                fused_frac=limit_s / fused_s, unfused_frac=limit_s / unfused_s, same=same)


def sweep(head: Head, rows: int, weights: list[HeadWeight], device: torch.device, reps: int) -> str:
    """The default config's time and the best of ``SWEEP`` (``SWEEP_INT8`` for int8 heads; configs that fail to
    compile or launch skipped)."""
    from inference_server.kernels.greedy_head import GreedyHeadConfig, greedy_head_config

    gen = torch.Generator(device).manual_seed(rows)
    hidden = (torch.randn(rows, head.hidden, generator=gen, device=device) * 3).to(torch.bfloat16)
    int8 = weights[0][1] is not None
    default = greedy_head_config(rows, 1 if int8 else 2)
    reference = fused(hidden, weights[0], head.softcap, default)
    timed = []
    copies = len(weights)
    for cfg in [default, *(GreedyHeadConfig(*c) for c in (SWEEP_INT8 if int8 else SWEEP))]:
        try:
            out = fused(hidden, weights[0], head.softcap, cfg)
            if not torch.equal(out[0], reference[0]):
                raise AssertionError("tokens differ from the default config's")
            calls = [lambda w=weights[i % copies], c=cfg: fused(hidden, w, head.softcap, c)
                     for i in range(calls_per_graph(copies))]
            timed.append((time_calls(calls, device, reps), cfg))
        except Exception as err:  # a config the compiler rejects (shared memory) is not a result
            print(f"  {head.model} N={rows} {cfg}: skipped ({type(err).__name__}: {str(err)[:80]})", flush=True)
    default_s = next(s for s, c in timed if c == default)
    best_s, best = min(timed, key=lambda t: t[0])
    limit_s = head_bytes(head, rows, int8) / HBM_BYTES_PER_S
    magic = ("/magic" if best.magic_dequant else "/cvt") if int8 else ""
    return (f"| {head.model} | {rows} | {default_s * 1e6:.1f} | {limit_s / default_s:.2f} | "
            f"{best.block_v}/{best.block_k}/{best.num_warps}w/{best.num_stages}s{magic} | {best_s * 1e6:.1f} | "
            f"{limit_s / best_s:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=20, help="graph replays per measurement (median)")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU dry run)")
    parser.add_argument("--sweep", action="store_true", help="also time launch configs per shape")
    parser.add_argument("--models", default="", help="comma-separated subset of the heads")
    parser.add_argument("--int8", action="store_true", help="int8 heads (INT8_EMBEDDINGS=on) against int8_linear")
    args = parser.parse_args()
    device = torch.device(args.device)
    heads = TINY_HEADS if args.tiny else HEADS
    if args.models:
        heads = tuple(h for h in heads if h.model in args.models.split(","))
    l2_bytes = device_l2_bytes(device)
    if device.type == "cuda":
        print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"{'int8' if args.int8 else 'bf16'} heads", flush=True)
    print("| head [V x H] | N | fused µs | unfused µs | speed-up | fused of limit | unfused of limit | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    sweeps = []
    for head in heads:
        weights = make_head(head, device, l2_bytes, args.int8)
        for rows in ROWS:
            r = bench_head(head, rows, weights, device, args.reps)
            print(f"| {head.model} [{head.vocab} x {head.hidden}] | {rows} | {r['fused_us']:.1f} | "
                  f"{r['unfused_us']:.1f} | {r['unfused_us'] / r['fused_us']:.2f}x | {r['fused_frac']:.2f} | "
                  f"{r['unfused_frac']:.2f} | {r['same']}/{rows} |", flush=True)
            if args.sweep:
                sweeps.append(sweep(head, rows, weights, device, args.reps))
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if sweeps:
        print("\n| head | N | default µs | default of limit | best block_v/block_k/warps/stages | best µs | "
              "best of limit |\n|---|---|---|---|---|---|---|")
        print("\n".join(sweeps))


if __name__ == "__main__":
    main()
