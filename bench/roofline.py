#!/usr/bin/env python3
"""Physical limits on one H200: the least time a decode step, a prefill or a whole offline workload can take.

Two ceilings, both measured on the lent H200 (2026-10/11): HBM traffic at 4.3 TB/s (device-to-device copy,
bytes read plus written) and bf16 matrix math at 790 TFLOP/s (8192^3 matmul on random data). A piece of
work takes at least ``max(bytes / 4.3e12, flops / 790e12)``; the *fraction of the limit* of a measurement is
``floor time / measured time`` (1.0 = at the limit).

What a decode step must move, per model (parameter counts are exact counts of the released text configs, the
same table as ../shared/bench/roofline.py):

* ``always_read``: parameters every step reads whole: lm_head, attention, dense MLPs, routers, per-layer
  projections (the embedding table is only gathered, B rows, so it is left out).
* ``expert_params``: all routed-expert weights. With uniform routing a batch of B tokens touches an
  expected ``E * (1 - (1 - k/E)^B)`` of the E experts in each layer, and only those are read.
* KV: each sequence reads its whole context on full-attention layers and at most ``window`` tokens on
  sliding layers (bf16, K and V). A KV-shared layer (Gemma-4-E2B/E4B's last layers, which reuse an earlier
  layer's cache) reads that cache again: counted by default (``kv_full_read``/``kv_sliding_read``, every attention
  layer's reads); ``rereads=False`` (``--unique-kv``) counts each cache layer once, the limit before 2026-12-04.
* FLOPs: 2 per active parameter per token (a decode step leaves the attention's out: ~6% at context 512).

Prefill reads every weight at least once and does 2 * active FLOPs per prompt token plus the attention's: 4 per
query head dimension and visible key (``attn_full``/``attn_sliding``: query heads x head_dim summed over the
full / sliding layers, from the presets), which at 30k tokens is about a third of the total. The offline floor
adds the prefill of all prompts to decode steps under continuous batching with every request admitted as
soon as a batch slot frees (KV capacity is assumed unlimited, so the floor is optimistic for Gemma-4-31B).

  python3 bench/roofline.py                                   # table: decode B=1/16/64/256 @512, offline
  python3 bench/roofline.py decode qwen3-30b-a3b --batch 1 --context 512
  python3 bench/roofline.py offline gemma-4-31b --requests 256 --int8
  python3 bench/roofline.py --unique-kv                       # each KV cache layer read once (the old limit)
"""

from __future__ import annotations

import argparse
import random
from collections import deque
from dataclasses import dataclass

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 790e12


@dataclass(frozen=True)
class ModelCost:
    """What one token costs in bytes and FLOPs (see the module docstring)."""

    always_read: int  # parameters read whole every step
    expert_params: int  # all routed-expert parameters (0: dense model)
    num_experts: int
    top_k: int
    active_params: int  # parameters multiplied per token
    kv_full: int  # KV bytes per token over the full-attention layers (bf16)
    kv_sliding: int  # KV bytes per token over the sliding-window layers (bf16)
    window: int  # sliding window in tokens (0: no sliding layers)
    lm_head: int = 0  # of always_read: the lm_head (or tied embedding), which QUANTIZATION=int8 keeps in bf16
    attn_full: int = 0  # query heads x head_dim summed over the full-attention layers (KV-sharing ones too)
    attn_sliding: int = 0  # the same over the sliding-window layers
    kv_full_read: int = 0  # KV bytes per token the full-attention layers read, KV-shared ones too (0: kv_full)
    kv_sliding_read: int = 0  # the same over the sliding-window layers (0: kv_sliding)

    @property
    def total_params(self) -> int:
        return self.always_read + self.expert_params

    def experts_touched(self, batch: int) -> float:
        """Expected fraction of expert weights a batch of ``batch`` tokens reads (uniform routing)."""
        if not self.expert_params:
            return 0.0
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** batch

    def attention_flops(self, prompt_len: int) -> float:
        """Score and value FLOPs of a causal prefill of ``prompt_len`` tokens from position 0: 4 per query head
        dimension and visible key (QK^T and PV), each query seeing its prefix (at most ``window`` keys on sliding
        layers)."""
        n, w = prompt_len, self.window or prompt_len
        full_keys = n * (n + 1) / 2
        sliding_keys = w * (w + 1) / 2 + (n - w) * w if n > w else full_keys
        return 4.0 * (self.attn_full * full_keys + self.attn_sliding * sliding_keys)

    def kv_bytes(self, context: int, rereads: bool = True) -> int:
        """KV bytes one sequence's decode step reads at ``context`` tokens: every attention layer's, the KV-shared
        layers' re-reads of another layer's cache included; ``rereads=False``: each cache layer's once."""
        full = (self.kv_full_read or self.kv_full) if rereads else self.kv_full
        sliding = (self.kv_sliding_read or self.kv_sliding) if rereads else self.kv_sliding
        return full * context + sliding * min(context, self.window)


MODELS: dict[str, ModelCost] = {
    "qwen3-30b-a3b": ModelCost(
        always_read=311_164_928 + 905_969_664 + 12_582_912,  # lm_head, attention, routers
        expert_params=28_991_029_248, num_experts=128, top_k=8, active_params=3_346_000_000,
        kv_full=98_304, kv_sliding=0, window=0, lm_head=311_164_928, attn_full=196_608),
    "gemma-4-26b-a4b": ModelCost(
        always_read=738_197_504 + 1_110_179_840 + 535_265_280 + 10_901_760,  # tied lm_head, attn, MLP, routers
        expert_params=22_837_985_280, num_experts=128, top_k=8, active_params=3_822_530_560,
        kv_full=20_480, kv_sliding=204_800, window=1024, lm_head=738_197_504, attn_full=40_960, attn_sliding=102_400),
    "gemma-4-e2b": ModelCost(
        # tied lm_head + everything else but the gathered tables (embedding, per-layer embedding 2.349 B);
        # counted on the meta build of the preset. KV: 3 full layers of 15 cached (20 share their KV).
        always_read=402_653_184 + 1_877_105_920, expert_params=0, num_experts=1, top_k=1,
        active_params=2_279_759_104, kv_full=6_144, kv_sliding=12_288, window=512, lm_head=402_653_184,
        attn_full=28_672, attn_sliding=57_344, kv_full_read=14_336, kv_sliding_read=28_672),  # 7 full, 28 sliding
    "gemma-4-e4b": ModelCost(
        # tied lm_head + everything else but the gathered tables (embedding, per-layer embedding 2.819 B);
        # counted on the meta build of the preset. KV: 4 full layers of 24 cached (18 share their KV).
        always_read=671_088_640 + 3_973_352_448, expert_params=0, num_experts=1, top_k=1,
        active_params=4_644_441_088, kv_full=16_384, kv_sliding=40_960, window=512, lm_head=671_088_640,
        attn_full=28_672, attn_sliding=71_680, kv_full_read=28_672, kv_sliding_read=71_680),  # 7 full, 35 sliding
    "gemma-4-31b": ModelCost(
        always_read=1_409_286_144 + 8_477_736_960 + 20_808_990_720,  # tied lm_head, attention, MLP
        expert_params=0, num_experts=1, top_k=1, active_params=30_697_345_280,
        kv_full=81_920, kv_sliding=819_200, window=1024, lm_head=1_409_286_144,
        attn_full=163_840, attn_sliding=409_600),
}


@dataclass(frozen=True)
class Floor:
    seconds: float
    bytes: float
    flops: float

    @property
    def bound(self) -> str:
        return "memory" if self.bytes / HBM_BYTES_PER_S >= self.flops / BF16_FLOPS_PER_S else "compute"


def _floor(num_bytes: float, flops: float) -> Floor:
    return Floor(max(num_bytes / HBM_BYTES_PER_S, flops / BF16_FLOPS_PER_S), num_bytes, flops)


def decode_step_floor(model: ModelCost, contexts: list[int], weight_bytes: float = 2.0,
                      head_bytes: float | None = None, rereads: bool = True) -> Floor:
    """One decode step of ``len(contexts)`` sequences at those context lengths; the lm_head's parameters take
    ``head_bytes`` each (default ``weight_bytes``; 2 for the engine's int8, which keeps the head in bf16).
    ``rereads``: the KV-shared layers' reads counted (``ModelCost.kv_bytes``)."""
    batch = len(contexts)
    params = model.always_read - model.lm_head + model.expert_params * model.experts_touched(batch)
    head = model.lm_head * (weight_bytes if head_bytes is None else head_bytes)
    kv = sum(model.kv_bytes(c, rereads) for c in contexts)
    return _floor(params * weight_bytes + head + kv, 2.0 * model.active_params * batch)


def prefill_floor(model: ModelCost, prompt_lens: int | list[int], weight_bytes: float = 2.0) -> Floor:
    """Prefill of one prompt of ``prompt_lens`` tokens (or of each prompt of a list): every weight read once,
    2 FLOPs per active param per token plus the attention's (``ModelCost.attention_flops``)."""
    lens = [prompt_lens] if isinstance(prompt_lens, int) else prompt_lens
    flops = 2.0 * model.active_params * sum(lens) + sum(model.attention_flops(n) for n in lens)
    return _floor(model.total_params * weight_bytes, flops)


def nano_vllm_workload(num_requests: int = 256, seed: int = 0, max_input: int = 1024,
                       max_output: int = 1024) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py workload: prompts of U[100, max_input] random ids < 10000, then output lengths
    U[100, max_output], drawn in that order from one ``random.Random(seed)`` (its ``random.seed(0)``)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input))] for _ in range(num_requests)]
    outputs = [rng.randint(100, max_output) for _ in range(num_requests)]
    return prompts, outputs


def offline_floor(model: ModelCost, prompt_lens: list[int], output_lens: list[int], max_batch: int = 256,
                  weight_bytes: float = 2.0, rereads: bool = True) -> tuple[float, int]:
    """(seconds, output tokens) of the least time the workload can take. Prefill yields each request's first
    token; every further token is one decode step of whatever runs then."""
    seconds = prefill_floor(model, prompt_lens, weight_bytes).seconds
    waiting = deque(zip(prompt_lens, output_lens, strict=True))
    running: list[list[int]] = []  # [context, tokens still to decode]
    while waiting or running:
        while waiting and len(running) < max_batch:
            prompt, output = waiting.popleft()
            running.append([prompt + 1, output - 1])
        running = [r for r in running if r[1] > 0]
        if not running:
            continue
        seconds += decode_step_floor(model, [r[0] for r in running], weight_bytes, rereads=rereads).seconds
        for r in running:
            r[0] += 1
            r[1] -= 1
    return seconds, sum(output_lens)


def decode_tok_s(model: str, batch: int, context: int, weight_bytes: float = 2.0,
                 head_bytes: float | None = None, rereads: bool = True) -> float:
    """Ideal decode throughput (tokens/s) at ``batch`` sequences of ``context`` tokens (``rereads``: see
    ``decode_step_floor``)."""
    return batch / decode_step_floor(MODELS[model], [context] * batch, weight_bytes, head_bytes, rereads).seconds


def engine_weight_bytes(quantization: str, int8_head: bool = False) -> tuple[float, float]:
    """(bytes per weight, bytes per lm_head weight) of the engine's ``QUANTIZATION`` on a GPU; ``int8_head``: the
    embeddings and lm_head int8 too (``INT8_EMBEDDINGS=on``; the GPU default keeps them bf16)."""
    if quantization != "int8":
        return (2.0, 2.0)
    return (1.0, 1.0 if int8_head else 2.0)


def offline_tok_s(model: str, num_requests: int = 256, seed: int = 0, weight_bytes: float = 2.0,
                  rereads: bool = True) -> float:
    """Ideal output tokens/s of the nano-vllm offline workload."""
    prompts, outputs = nano_vllm_workload(num_requests, seed)
    seconds, tokens = offline_floor(MODELS[model], [len(p) for p in prompts], outputs, weight_bytes=weight_bytes,
                                    rereads=rereads)
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", choices=("table", "decode", "offline"), default="table")
    ap.add_argument("model", nargs="?", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--int8", action="store_true",
                    help="int8 weight-only: 1 byte a weight, the lm_head in bf16 (QUANTIZATION=int8)")
    ap.add_argument("--int8-head", action="store_true",
                    help="with --int8: the lm_head int8 too (INT8_EMBEDDINGS=on)")
    ap.add_argument("--unique-kv", action="store_true",
                    help="each KV cache layer read once a step (the KV-shared layers' re-reads left out)")
    a = ap.parse_args()
    rereads = not a.unique_kv
    wb, hb = engine_weight_bytes("int8" if a.int8 else "none", a.int8_head)
    if a.what == "decode":
        step = decode_step_floor(MODELS[a.model], [a.context] * a.batch, wb, hb, rereads)
        print(f"{a.model} decode B={a.batch} ctx={a.context}: floor {step.seconds * 1e3:.2f} ms/step "
              f"({step.bound}-bound), {a.batch / step.seconds:,.0f} tok/s")
    elif a.what == "offline":
        tok_s = offline_tok_s(a.model, a.requests, 0, wb, rereads)
        print(f"{a.model} offline {a.requests} requests: {tok_s:,.0f} tok/s")
    else:
        print("| model | B=1 | B=16 | B=64 | B=256 | offline 256 |")
        print("|---|---|---|---|---|---|")
        for name in MODELS:
            cells = [f"{decode_tok_s(name, b, a.context, wb, hb, rereads):,.0f}" for b in (1, 16, 64, 256)]
            print(f"| {name} | {' | '.join(cells)} | {offline_tok_s(name, a.requests, 0, wb, rereads):,.0f} |")


if __name__ == "__main__":
    main()
