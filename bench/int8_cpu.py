"""Decode speed of the embedded Gemma 3 270M on the CPU, fp32 vs QUANTIZATION=int8 (median of 3), and the
candidate int8 matmuls on its tied lm_head (the matrix that dominates a CPU decode step).

Decode: one engine per setting (``inference_server.offline.LLM``, the same actors as the server), one greedy
request of ``--tokens`` tokens (EOS ignored) after a warm-up request; tok/s = tokens / wall time of the request
(prefill of the 6-token prompt included, as the issue's "128 greedy tokens in ~19 s" figure).
Kernels: ``[1, 640] x [262144, 640]`` per call, median of 10, for fp32 ``F.linear``, the weight-only reference,
``torch._weight_int8pack_mm`` with bf16 activations, fbgemm with per-row 8-bit activations (what the CPU engine
runs for this matrix, ``kernels/cpu_int8.py``).

Figures depend on the machine being quiet: the load average is printed with them.

    uv run python bench/int8_cpu.py                    # ~2 minutes on 2 cores
    uv run python bench/int8_cpu.py --threads 1        # torch.set_num_threads(1) first
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from inference_server.config import Settings
from inference_server.kernels import cpu_int8
from inference_server.kernels.reference_int8 import int8_linear_reference, quantize_int8_per_channel
from inference_server.offline import LLM
from inference_server.records.sampling_params import SamplingParams

PROMPT = "The capital of France is"


def decode_rate(quantization: str, tokens: int, repeats: int) -> float:
    """Median tok/s of ``repeats`` greedy requests of ``tokens`` tokens on an engine with ``quantization``."""
    llm = LLM(Settings(device="cpu", quantization=quantization))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up (fbgemm packs its weight)
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        [completion] = llm.generate([PROMPT], params)
        rates.append(len(completion.token_ids) / (time.perf_counter() - started))
    return statistics.median(rates)


def kernel_ms(fn: Callable[[], torch.Tensor], repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    if not args.skip_kernels:
        weight = torch.randn(262144, 640) * 640 ** -0.5
        qweight, scale = quantize_int8_per_channel(weight)
        x = torch.randn(1, 640)
        candidates: dict[str, Callable[[], torch.Tensor]] = {
            "fp32 F.linear": lambda: torch.nn.functional.linear(x, weight),
            "int8 reference (dequantize + fp32)": lambda: int8_linear_reference(x, qweight, scale),
            "int8 _weight_int8pack_mm, bf16 x": lambda: cpu_int8.int8pack_linear(x, qweight, scale),
        }
        if cpu_int8._fbgemm_8bit_safe():
            candidates["int8 fbgemm, per-row 8-bit x"] = lambda: cpu_int8.fbgemm_row_quantized_linear(x, qweight,
                                                                                                     scale)
        print("lm_head [1, 640] x [262144, 640], median ms per call:")
        for name, fn in candidates.items():
            print(f"  {name:<38} {kernel_ms(fn):8.1f}")
        del weight, qweight
    rates = {q: decode_rate(q, args.tokens, args.repeats) for q in ("none", "int8")}
    print(f"decode, {args.tokens} greedy tokens, median of {args.repeats}: fp32 {rates['none']:.1f} tok/s, "
          f"int8 {rates['int8']:.1f} tok/s ({rates['int8'] / rates['none']:.2f}x); "
          f"load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
