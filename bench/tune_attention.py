#!/usr/bin/env python3
"""Time the paged attention kernels' launch configs on this GPU, per attention layer kind of the served models.

``prefill`` (the default): for each layer kind of the MoE models (Qwen3-30B-A3B head_dim 128; Gemma-4-26B-A4B sliding
head_dim 256 and full head_dim 512, heads and window from the presets) one chunk of ``--chunk`` queries at the end of a
``--context``-token prompt (the last chunk of a chunked prefill, random bf16 K/V in 16-token pages) runs
``kernels.prefill_attention`` with each ``(BLOCK_M, BLOCK_N, num_warps, num_stages, value slices)`` candidate, timed by
``kit.graph_timing.time_calls`` (median of ``--reps`` CUDA-graph replays after a warm-up; wall time on the CPU); a
candidate counts only if its output equals the current config's within bf16 rounding, and one that fails to compile
(shared memory, registers) is listed as such. Prints one table per layer kind, fastest first, with the attention
TFLOP/s (causal: 2 x 2 x visible keys x head_dim FLOPs per query and head; a candidate with value slices computes
(1 + slices) / 2 times that and is credited only the same FLOPs, so its figure compares directly).

``decode``: for each decode layer kind (query heads, kv heads, head_dim, window) of ``--models`` (Gemma-4-E2B, E4B,
26B-A4B, 31B and Qwen3-30B-A3B) at each batch of ``--batches`` and context of ``--contexts`` (every sequence at that
length; a windowed kind past its window reads the same keys, so those points are timed once), one
``kernels.decode_attention`` call with today's plan (``decode_plan``: ``decode_config``'s tiles and
``choose_num_splits``'s splits) and each candidate ``DecodePlan`` (key tile, warps, stages, splits, block table a tile
ahead). The visible keys sit in pages scattered over a cache that holds only them, cycled over copies so that 2x the L2
lies between two reads of one copy (``kit.graph_timing.rotation``): what a step's layer reads, from HBM. Each row has
µs per call and the GB/s of the K and V bytes read (visible keys x kv heads x head_dim x 2 x 2 bytes) against
``--hbm`` (4.3 TB/s); a final table puts today's plan beside the fastest per point. Points run context by context, so
a ``--time-limit`` (seconds) that stops before the end drops the longest contexts first (the tables say what was
skipped).

  python3 bench/tune_attention.py                             # prefill, on the H200, ~1-2 minutes
  python3 bench/tune_attention.py decode                      # decode, on the H200, under 150 s (--time-limit 90)
  python3 bench/tune_attention.py decode --tiles --models gemma-4-e4b,gemma-4-e2b --contexts 512 --batches 64,256
  python3 bench/tune_attention.py invariant --time-limit 400   # DETERMINISTIC's tiles and splits, bits checked
  TRITON_INTERPRET=1 uv run python bench/tune_attention.py --context 40 --chunk 16 --quick 2  # prefill dry run
  TRITON_INTERPRET=1 uv run python bench/tune_attention.py decode --models gemma-4-e2b --batches 1,16 \
      --contexts 40 --quick 3 --reps 1                        # decode dry run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import multiprocessing
import sys
import time
from pathlib import Path

import attrs
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from inference_server.kernels import decode_attention, prefill_attention  # noqa: E402
from inference_server.kernels.decode_attention import (  # noqa: E402
    DecodePlan,
    decode_plan,
    paged_decode_attention,
)
from inference_server.models.loading.presets import preset_config  # noqa: E402
from inference_server.models.spec import parse_model_spec  # noqa: E402
from kit.graph_timing import calls_per_graph, device_l2_bytes, rotation, time_calls  # noqa: E402

CANDIDATES = {  # head_dim: (BLOCK_M, BLOCK_N, num_warps, num_stages, value slices) to try
    128: list(itertools.product((128,), (64, 128), (4, 8), (2, 3, 4), (1,))),
    256: list(itertools.product((64, 128), (16, 32, 64), (8,), (2, 3), (1,))),
    512: list(itertools.product((32, 64), (16, 32, 64), (8,), (1, 2), (1,)))
    # prefill_attention._value_slices
    + list(itertools.product((64, 128), (16, 32, 64), (4, 8), (1, 2), (2,))),
}
"""Head_dim 512 also tries 16-key tiles and 2 value slices (the latter won on the H100, 2026-12-05:
``bench/results/prefill-experiments-2026-12-05.md``)."""


def layer_kinds() -> list[tuple[str, int, int, int, int | None]]:
    """(name, query heads, kv heads, head_dim, window) of each attention layer kind of the two MoE models."""
    kinds = []
    for model in ("qwen3-30b-a3b", "gemma-4-26b-a4b"):
        spec = parse_model_spec(preset_config(model))
        seen = set()
        for layer in spec.cache_layers:
            key = (layer.num_kv_heads, layer.head_dim, layer.window)
            if key not in seen:
                seen.add(key)
                kinds.append((f"{model} D={layer.head_dim}" + (f" window {layer.window}" if layer.window else ""),
                              spec.num_attention_heads, *key))
    return kinds


def time_kind(heads: int, kv_heads: int, head_dim: int, window: int | None, context: int, chunk: int, reps: int,
              quick: int, device: torch.device) -> list[tuple[str, float | None, tuple[int, int, int, int, int]]]:
    page = 16
    gen = torch.Generator(device="cpu").manual_seed(head_dim)
    blocks = -(-context // page)
    k_cache = (torch.randn(blocks, page, kv_heads, head_dim, generator=gen) * head_dim ** -0.25).to(device,
                                                                                                    torch.bfloat16)
    v_cache = torch.randn(blocks, page, kv_heads, head_dim, generator=gen).to(device, torch.bfloat16)
    q = (torch.randn(chunk, heads, head_dim, generator=gen) * head_dim ** -0.25).to(device, torch.bfloat16)
    tables = torch.randperm(blocks, generator=gen).to(device, torch.int32)[None, :]
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    ctx = torch.tensor([context], dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, tables, cu, ctx, head_dim ** -0.5, window)
    current = (*prefill_attention._prefill_config(head_dim, small_tiles=False),
               prefill_attention._value_slices(head_dim, small_tiles=False))
    expected = prefill_attention.paged_prefill_attention(*args).float()
    results = []
    original, original_slices = prefill_attention._prefill_config, prefill_attention._value_slices
    candidates = [current] + [c for c in CANDIDATES[max(k for k in CANDIDATES if k <= max(head_dim, 128))]
                              if c != current]
    for config in candidates[:quick] if quick else candidates:
        prefill_attention._prefill_config = lambda _d, _small=True, config=config: config[:4]
        prefill_attention._value_slices = lambda _d, _small, config=config: config[4]
        try:
            out = prefill_attention.paged_prefill_attention(*args)
            error = (out.float() - expected).abs().max().item()
            if error > 2 ** -6 * expected.abs().max().item():
                results.append((f"differs {error:.1e}", None, config))
                continue
            call = functools.partial(prefill_attention.paged_prefill_attention, *args, out=out)
            results.append(("ok", time_calls([call], device, reps), config))
        except Exception as err:  # out of shared memory or registers: not a candidate
            results.append((f"failed: {type(err).__name__}", None, config))
        finally:
            prefill_attention._prefill_config, prefill_attention._value_slices = original, original_slices
    return results


DECODE_MODELS = ("gemma-4-e4b", "gemma-4-e2b", "gemma-4-26b-a4b", "gemma-4-31b", "qwen3-30b-a3b")
SWEEP_FROM_BATCH = 16
"""Batch from which head_dim > 128 points time today's plan with other splits and stages too (``decode_candidates``)."""
DECODE_TILES = {  # head_dim: (BLOCK_N, num_warps, num_stages) tried beside today's plan's, from SWEEP_FROM_BATCH seqs
    128: [(64, 4, 3), (64, 8, 2)],
    256: [(32, 4, 3), (32, 4, 2), (64, 4, 2), (32, 8, 3), (16, 4, 4)],
    512: [(16, 4, 3), (32, 4, 3), (32, 4, 2), (16, 8, 4), (32, 8, 2)],
}
PAGE = 16


@attrs.frozen
class DecodeKind:
    """One decode attention layer kind: its models, query heads, kv heads, head_dim and window."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None


def decode_kinds(models: list[str]) -> list[DecodeKind]:
    """The distinct (query heads, kv heads, head_dim, window) of the models' cache layers, in model order."""
    kinds: list[DecodeKind] = []
    seen = set()
    for model in models:
        spec = parse_model_spec(preset_config(model))
        for layer in spec.cache_layers:
            key = (spec.num_attention_heads, layer.num_kv_heads, layer.head_dim, layer.window)
            if key not in seen:
                seen.add(key)
                kinds.append(DecodeKind(f"{model} D={layer.head_dim}" + (f" W={layer.window}" if layer.window else ""),
                                        *key))
    return kinds


def today_plan(kind: DecodeKind, batch: int, visible: int, num_sms: int) -> DecodePlan:
    """The plan ``paged_decode_attention`` launches by default (``decode_plan``)."""
    return decode_plan(kind.head_dim, batch, kind.kv_heads, visible, num_sms)


def decode_candidates(kind: DecodeKind, batch: int, visible: int, num_sms: int,
                      tiles: bool = False) -> list[tuple[str, DecodePlan]]:
    """(label, plan) to time, today's first, no plan twice: today's, today's with the block table a tile ahead, from
    ``SWEEP_FROM_BATCH`` at head_dim > 128 today's with the table ahead and half (rounded up) or twice its splits, or
    4 stages (two tiles ahead), and with ``tiles`` from ``SWEEP_FROM_BATCH`` the ``DECODE_TILES`` of the head_dim
    with 1 split and today's splits (many more kernels to compile: a run of its own, on fewer points)."""
    today = today_plan(kind, batch, visible, num_sms)
    ahead = attrs.evolve(today, table_ahead=True)
    plans = [("today", today), ("today+ahead", ahead)]
    if kind.head_dim > 128 and batch >= SWEEP_FROM_BATCH:
        plans += [("today/2 splits+ahead", attrs.evolve(ahead, num_splits=-(-today.num_splits // 2))),
                  ("today x2 splits+ahead", attrs.evolve(ahead, num_splits=min(decode_attention.MAX_SPLITS,
                                                                               2 * today.num_splits))),
                  ("today+ahead 4 stages", attrs.evolve(ahead, num_stages=4))]
    if tiles and batch >= SWEEP_FROM_BATCH:
        tiles = DECODE_TILES[max(d for d in DECODE_TILES if d <= max(kind.head_dim, 128))]
        for (block_n, warps, stages), splits in itertools.product(tiles, sorted({1, today.num_splits})):
            plans.append(("tiles", DecodePlan(block_n, warps, stages, splits)))
    unique: dict[DecodePlan, str] = {}
    for label, plan in plans:
        if plan in unique:
            unique[plan] += f"={label}" if label != "tiles" else ""
        else:
            unique[plan] = label
    return [(label, plan) for plan, label in unique.items()]


def decode_case(kind: DecodeKind, batch: int, context: int, copies: int, device: torch.device,
                compile_only: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """q, the K and V caches, one block table per copy and the context lengths: every sequence at ``context`` keys,
    its visible keys' pages at scattered blocks of a cache that holds only those (other table entries 0, unread).
    ``compile_only``: the same shapes and strides over a cache of one block that every table entry names."""
    visible = min(context, kind.window or context)
    first_page, last_page = (context - visible) // PAGE, (context - 1) // PAGE
    pages = last_page - first_page + 1
    blocks = 1 if compile_only else copies * batch * pages
    gen = torch.Generator(device=device).manual_seed(kind.head_dim * 131 + batch)
    shape = (blocks, PAGE, kind.kv_heads, kind.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * kind.head_dim ** -0.25
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    q = torch.randn((batch, kind.heads, kind.head_dim), generator=gen, device=device,
                    dtype=torch.bfloat16) * kind.head_dim ** -0.25
    order = torch.randperm(blocks, generator=gen, device=device).to(torch.int32)
    order = order.expand(copies * batch * pages) if compile_only else order
    order = order.reshape(copies, batch, pages)
    tables = []
    for c in range(copies):
        table = torch.zeros((batch, last_page + 1), dtype=torch.int32, device=device)
        table[:, first_page:] = order[c]
        tables.append(table)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, lens


def time_decode_point(kind: DecodeKind, batch: int, context: int, reps: int, quick: int, device: torch.device,
                      num_sms: int, tiles: bool) -> list[tuple[str, str, float | None, DecodePlan]]:
    """(label, status, seconds per call or None, plan) of each candidate at one (kind, batch, context)."""
    visible = min(context, kind.window or context)
    call_bytes = decode_bytes(kind, batch, visible)
    copies = rotation(call_bytes, device_l2_bytes(device), max_copies=256)
    q, k_cache, v_cache, tables, lens = decode_case(kind, batch, context, copies, device)
    scale = kind.head_dim ** -0.5
    candidates = decode_candidates(kind, batch, visible, num_sms, tiles)
    results: list[tuple[str, str, float | None, DecodePlan]] = []
    expected: torch.Tensor | None = None
    for label, plan in candidates[:quick] if quick else candidates:
        try:
            out = paged_decode_attention(q, k_cache, v_cache, tables[0], lens, scale, kind.window,
                                         max_context_len=context, plan=plan)
            if expected is None:
                expected = out.float()
            error = (out.float() - expected).abs().max().item()
            if error > 2 ** -6 * expected.abs().max().item():
                results.append((label, f"differs {error:.1e}", None, plan))
                continue
            calls = [functools.partial(paged_decode_attention, q, k_cache, v_cache, tables[c % copies], lens, scale,
                                       kind.window, max_context_len=context, plan=plan, out=torch.empty_like(q))
                     for c in range(calls_per_graph(copies, at_least=4))]
            results.append((label, "ok", time_calls(calls, device, reps), plan))
        except Exception as err:  # out of shared memory or registers: not a candidate
            results.append((label, f"failed: {type(err).__name__}", None, plan))
    return results


def _compile_decode_jobs(device_type: str, jobs: list[tuple[DecodeKind, int, int, DecodePlan]]) -> int:
    """Run each (kind, batch, context, plan) once over a one-block cache (``decode_case``'s ``compile_only``): in a
    worker process, this compiles the kernels the timed run launches into Triton's disk cache, which the timing
    process then loads instead of compiling them one after another."""
    device = torch.device(device_type)
    for kind, batch, context, plan in jobs:
        q, k_cache, v_cache, tables, lens = decode_case(kind, batch, context, 1, device, compile_only=True)
        paged_decode_attention(q, k_cache, v_cache, tables[0], lens, kind.head_dim ** -0.5, kind.window,
                               max_context_len=context, plan=plan, out=torch.empty_like(q))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return len(jobs)


def precompile_decode(points: list[tuple[DecodeKind, int, int]], args: argparse.Namespace, num_sms: int,
                      device: torch.device) -> str:
    """Compile every kernel variant the points' candidates launch, in ``--compile-workers`` processes at once (one
    variant takes a second or two to compile, and a full run launches about a hundred)."""
    jobs: dict[tuple[object, ...], tuple[DecodeKind, int, int, DecodePlan]] = {}
    for kind, batch, context in points:
        visible = min(context, kind.window or context)
        candidates = decode_candidates(kind, batch, visible, num_sms, args.tiles)
        for _, plan in candidates[:args.quick] if args.quick else candidates:
            # what the launch specialises on: constexprs (the plan, the group, head_dim, splits padded) and the
            # integers' divisibility by 16 (the split count, the window, the strides of the block table and caches)
            key = (kind.heads // kind.kv_heads, kind.head_dim, kind.kv_heads % 16, kind.window, plan,
                   plan.num_splits % 16, ((context - 1) // PAGE + 1) % 16, batch == 1)
            jobs.setdefault(key, (kind, batch, context, plan))
    work = list(jobs.values())
    workers = max(1, min(args.compile_workers, len(work)))
    started = time.monotonic()
    chunks = [work[i::workers] for i in range(workers)]
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = sum(pool.map(_compile_decode_jobs, [device.type] * workers, chunks))
    return f"compiled {done} kernel variants in {workers} processes in {time.monotonic() - started:.0f} s"


def decode_bytes(kind: DecodeKind, batch: int, visible: int) -> int:
    """K and V bytes one decode call reads: the visible keys of each sequence and kv head, bf16."""
    return batch * visible * kind.kv_heads * kind.head_dim * 2 * 2


def plan_text(plan: DecodePlan) -> str:
    ahead = "y" if plan.table_ahead else "-"
    return f"{plan.block_n} | {plan.num_warps} | {plan.num_stages} | {plan.num_splits} | {ahead}"


def compiled_variants() -> list[str]:
    """A row per ``_paged_decode_kernel`` variant this process launched on the GPU: its group, head_dim, key tile,
    warps, stages, split, table a tile ahead, shared memory bytes (two K/V tiles' worth or more: the pipeliner
    double-buffers them), registers a thread and spilled bytes. From Triton's in-memory kernel cache, whose layout
    changes between Triton versions: an unreadable cache gives one row that says so."""
    fn = decode_attention._paged_decode_kernel
    try:
        rows = set()
        for entry in fn.device_caches.values():
            for kernel in entry[0].values():
                consts = getattr(kernel.src, "constants", {})

                def const(name: str, consts: dict[object, object] = consts) -> object:
                    return consts.get((fn.arg_names.index(name),), consts.get(name, "?"))

                md = kernel.metadata
                rows.add((const("G"), const("D"), const("BLOCK_N"), md.num_warps, md.num_stages, const("SPLIT"),
                          const("TABLE_AHEAD"), md.shared, getattr(kernel, "n_regs", "?"),
                          getattr(kernel, "n_spills", "?")))
        return ["| " + " | ".join(str(v) for v in row) + " |" for row in sorted(rows, key=str)]
    except Exception as err:  # another Triton's cache layout
        return [f"| unreadable: {type(err).__name__}: {err} |"]


def run_decode(args: argparse.Namespace, device: torch.device) -> None:
    started = time.monotonic()
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
        else decode_attention.H200_NUM_SMS
    kinds = decode_kinds(args.models.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    hbm = args.hbm * 1e12
    summary: list[tuple[DecodeKind, int, int, list[tuple[str, str, float | None, DecodePlan]]]] = []
    seen, skipped = set(), []
    print(f"decode: {len(kinds)} layer kinds, batches {batches}, contexts {contexts}; GB/s of the K and V read "
          f"(% of {args.hbm} TB/s)")
    points = []
    for context in contexts:
        for kind in kinds:
            visible = min(context, kind.window or context)
            for batch in batches:
                if (kind, batch, visible) not in seen:  # else a window's keys, as at the shorter context
                    seen.add((kind, batch, visible))
                    points.append((kind, batch, context))
    workers = args.compile_workers if args.compile_workers is not None else 12 if device.type == "cuda" else 0
    if workers:
        args.compile_workers = workers
        print(precompile_decode(points, args, num_sms, device), flush=True)
    for kind, batch, context in points:
        visible = min(context, kind.window or context)
        if time.monotonic() - started > args.time_limit:
            skipped.append(f"{kind.name} B={batch} ctx={context}")
            continue
        rows = time_decode_point(kind, batch, context, args.reps, args.quick, device, num_sms, args.tiles)
        summary.append((kind, batch, context, rows))
        nbytes = decode_bytes(kind, batch, visible)
        print(f"\n{kind.name}: {kind.heads}/{kind.kv_heads} heads, B={batch}, context {context} "
              f"({visible} keys visible, {nbytes / 1e6:.1f} MB of K+V)")
        print("| plan | BLOCK_N | warps | stages | splits | ahead | us | GB/s | % HBM | status |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
        for label, status, seconds, plan in sorted(rows, key=lambda r: (r[2] is None, r[2] or 0.0)):
            us = f"{seconds * 1e6:.1f}" if seconds else "-"
            gbs = f"{nbytes / seconds / 1e9:.0f}" if seconds else "-"
            pct = f"{100 * nbytes / seconds / hbm:.0f}" if seconds else "-"
            print(f"| {label} | {plan_text(plan)} | {us} | {gbs} | {pct} | {status} |", flush=True)
    print("\nSummary: today's plan and the fastest per point (µs per call, % of HBM bandwidth)")
    print("| kind | B | ctx | today us | today % | best | best plan (BLOCK_N, warps, stages, splits, ahead) | "
          "best us | best % | today / best |\n" + "|---" * 10 + "|")
    for kind, batch, context, rows in summary:
        nbytes = decode_bytes(kind, batch, min(context, kind.window or context))
        timed = [r for r in rows if r[2]]
        if not timed:
            print(f"| {kind.name} | {batch} | {context} | - | - | - | none timed | - | - | - |")
            continue
        today = rows[0]
        best = min(timed, key=lambda r: r[2] or 0.0)

        def cells(row: tuple[str, str, float | None, DecodePlan], nbytes: int = nbytes) -> str:
            seconds = row[2]
            return f"{seconds * 1e6:.1f} | {100 * nbytes / seconds / hbm:.0f}" if seconds else "- | -"

        ratio = f"{today[2] / best[2]:.2f}" if today[2] and best[2] else "-"
        print(f"| {kind.name} | {batch} | {context} | {cells(today)} | {best[0]} | "
              f"{plan_text(best[3]).replace(' | ', ', ')} | {cells(best)} | {ratio} |", flush=True)
    if device.type == "cuda":
        print("\nCompiled variants (shared memory in bytes; regs a thread; spilled bytes)\n"
              "| G | D | BLOCK_N | warps | stages | split | ahead | shared | regs | spills |\n" + "|---" * 10 + "|")
        print("\n".join(compiled_variants()))
    if skipped:
        print(f"\nskipped past --time-limit {args.time_limit:.0f} s ({len(skipped)}): " + "; ".join(skipped))
    print(f"\ndecode done in {time.monotonic() - started:.0f} s")


def run_prefill(args: argparse.Namespace, device: torch.device) -> None:
    for name, heads, kv_heads, head_dim, window in layer_kinds():
        keys = sum(min(args.context - args.chunk + i + 1, window or args.context) for i in range(args.chunk))
        flops = 4.0 * keys * head_dim * heads
        print(f"\n{name}: {heads} heads / {kv_heads} kv heads, {args.chunk} queries at the end of {args.context} keys")
        print("| BLOCK_M | BLOCK_N | warps | stages | value slices | us | TFLOP/s | status |\n"
              "|---|---|---|---|---|---|---|---|")
        rows = time_kind(heads, kv_heads, head_dim, window, args.context, args.chunk, args.reps, args.quick, device)
        current = rows[0][2]
        for status, seconds, config in sorted(rows, key=lambda r: (r[1] is None, r[1] or 0.0)):
            mark = " (current)" if config == current else ""
            us = f"{seconds * 1e6:.1f}" if seconds else "-"
            tflops = f"{flops / seconds / 1e12:.0f}" if seconds else "-"
            print(f"| {config[0]} | {config[1]} | {config[2]} | {config[3]} | {config[4]} | {us} | {tflops} "
                  f"| {status}{mark} |", flush=True)


INVARIANT_TILES = {  # head_dim: DETERMINISTIC's (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates beside today's
    128: [(64, 64, 4, 2), (128, 64, 4, 2), (64, 32, 4, 2)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2)],
    512: [(32, 32, 4, 2), (32, 16, 4, 2), (64, 32, 8, 2)],
}
"""16-row tiles are not among them: they kept the bits but made the aligned prefill 1.4-2.8x slower (docs/benchmarks.md,
Retired experiments)."""
INVARIANT_SPLIT_KEYS = (256, 128)
"""KV split sizes tried with today's tile (the other tiles: today's split, ``KV_SPLIT_KEYS``)."""
INVARIANT_BIT_CONTEXTS = (300, 512, 1000, 2100)
"""Contexts of the sequences whose decode rows must equal the aligned prefill's last query, bitwise."""


def aligned_prefill_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                         contexts: list[int], window: int | None, split_keys: int, chunk: int = 48) -> torch.Tensor:
    """``[B, nH, D]``: for each sequence, the last query row of an aligned prefill chunk of ``chunk`` queries ending
    at its context (the query at ``context - 1`` is ``q[b]``; the chunk's other queries are random), one call each."""
    rows = []
    head_dim = q.shape[-1]
    gen = torch.Generator(device="cpu").manual_seed(7)
    for b, context in enumerate(contexts):
        extra = (torch.randn(chunk - 1, *q.shape[1:], generator=gen) * head_dim ** -0.25).to(q.device, q.dtype)
        queries = torch.cat([extra, q[b : b + 1]])
        cu = torch.tensor([0, chunk], dtype=torch.int32, device=q.device)
        ctx = torch.tensor([context], dtype=torch.int32, device=q.device)
        out = prefill_attention.paged_prefill_attention(queries, k_cache, v_cache, tables[b : b + 1], cu, ctx,
                                                        head_dim ** -0.5, window, align_kv=True,
                                                        split_keys=split_keys)
        rows.append(out[-1])
    return torch.stack(rows)


def run_invariant(args: argparse.Namespace, device: torch.device) -> None:
    """DETERMINISTIC's attention tiles: per layer kind of Qwen3-30B-A3B and Gemma-4-26B-A4B, today's small tile and
    ``INVARIANT_TILES`` (with ``INVARIANT_SPLIT_KEYS`` for today's), each timed as the aligned prefill of a
    ``--chunk``-query chunk at the end of ``--context`` keys, and as ``invariant_decode_attention`` at batch 1 and 64
    over 512 keys (``decode_case``: the keys' pages scattered, cycled over copies that miss L2, as the decode sweep
    times). Bits: the decode rows of ``INVARIANT_BIT_CONTEXTS`` against the aligned prefill's last query (a 48-query
    chunk), equal or not; a tile whose decode differs cannot be used, and equal here is not enough: on random K/V a
    decode on 16 query rows equalled the prefill on 32-128 everywhere (H100, 2026-12-05), yet the engine's
    deterministic GPU tests then failed with it (tests/test_deterministic_cuda.py decides)."""
    from inference_server.kernels.invariant_decode_attention import invariant_decode_attention

    started = time.monotonic()
    for name, heads, kv_heads, head_dim, window in layer_kinds():
        group = heads // kv_heads
        gen = torch.Generator(device="cpu").manual_seed(head_dim)
        longest = max(args.context, sum(INVARIANT_BIT_CONTEXTS))
        blocks = -(-longest // PAGE) + 64
        k_cache = (torch.randn(blocks, PAGE, kv_heads, head_dim, generator=gen) * head_dim ** -0.25).to(
            device, torch.bfloat16)
        v_cache = torch.randn(blocks, PAGE, kv_heads, head_dim, generator=gen).to(device, torch.bfloat16)
        order = torch.randperm(blocks, generator=gen).to(torch.int32)

        def tables_for(contexts: list[int], order: torch.Tensor = order) -> torch.Tensor:
            width = max(-(-c // PAGE) for c in contexts)
            table = torch.zeros(len(contexts), width, dtype=torch.int32)
            used = 0
            for b, c in enumerate(contexts):
                n = -(-c // PAGE)
                table[b, :n] = order[used : used + n]
                used += n
            return table.to(device)

        def queries(batch: int, heads: int = heads, head_dim: int = head_dim,
                    gen: torch.Generator = gen) -> torch.Tensor:
            return (torch.randn(batch, heads, head_dim, generator=gen) * head_dim ** -0.25).to(device, torch.bfloat16)

        chunk_q = queries(args.chunk)
        chunk_tables = tables_for([args.context])
        cu = torch.tensor([0, args.chunk], dtype=torch.int32, device=device)
        ctx = torch.tensor([args.context], dtype=torch.int32, device=device)
        keys = sum(min(args.context - args.chunk + i + 1, window or args.context) for i in range(args.chunk))
        flops = 4.0 * keys * head_dim * heads
        kind = DecodeKind(name, heads, kv_heads, head_dim, window)
        decode_points = []  # (q, K cache, V cache, a table per copy, lengths) at batch 1 and 64, 512 keys
        for batch in (1, 64):
            copies = rotation(decode_bytes(kind, batch, min(512, window or 512)), device_l2_bytes(device),
                              max_copies=256)
            decode_points.append(decode_case(kind, batch, 512, copies, device))
        bit_q = queries(len(INVARIANT_BIT_CONTEXTS))
        bit_tables = tables_for(list(INVARIANT_BIT_CONTEXTS))
        bit_ctx = torch.tensor(INVARIANT_BIT_CONTEXTS, dtype=torch.int32, device=device)
        today = prefill_attention._prefill_config(head_dim, True)
        candidates = [(today, keys_) for keys_ in INVARIANT_SPLIT_KEYS]
        candidates += [(tile, INVARIANT_SPLIT_KEYS[0]) for tile in INVARIANT_TILES[max(head_dim, 128)]]
        print(f"\n{name}: {heads} heads / {kv_heads} kv heads (G={group}); prefill {args.chunk} queries at the end "
              f"of {args.context} keys; decode 512 keys\n"
              "| BLOCK_M | BLOCK_N | warps | stages | split keys | prefill us (TFLOP/s) | decode B=1 us | "
              "decode B=64 us | bits |\n" + "|---" * 9 + "|", flush=True)
        original = prefill_attention._prefill_config
        for tile, split_keys in candidates:
            if time.monotonic() - started > args.time_limit:
                print(f"| {' | '.join(map(str, tile))} | {split_keys} | skipped past --time-limit |", flush=True)
                continue
            prefill_attention._prefill_config = lambda _d, _small=True, tile=tile: tile
            cells = []
            try:
                prefill = functools.partial(prefill_attention.paged_prefill_attention, chunk_q, k_cache, v_cache,
                                            chunk_tables, cu, ctx, head_dim ** -0.5, window, align_kv=True,
                                            split_keys=split_keys)
                seconds = time_calls([prefill], device, args.reps)
                cells.append(f"{seconds * 1e6:.0f} ({flops / seconds / 1e12:.0f})")
                expected = aligned_prefill_rows(bit_q, k_cache, v_cache, bit_tables, list(INVARIANT_BIT_CONTEXTS),
                                                window, split_keys)
                decode = functools.partial(invariant_decode_attention, scale=head_dim ** -0.5, window=window,
                                           max_context_len=131072, split_keys=split_keys)
                for q, k_point, v_point, tables, lens in decode_points:
                    calls = [functools.partial(decode, q, k_point, v_point, tables[c % len(tables)], lens)
                             for c in range(calls_per_graph(len(tables), at_least=4))]
                    cells.append(f"{time_calls(calls, device, args.reps) * 1e6:.1f}")
                got = decode(bit_q, k_cache, v_cache, bit_tables, bit_ctx)
                cells.append("equal" if torch.equal(got, expected) else
                             f"differ {(got.float() - expected.float()).abs().max().item():.1e}")
            except Exception as err:  # out of shared memory or registers: not a candidate
                cells.append(f"failed: {type(err).__name__}: {str(err)[:80]}")
            finally:
                prefill_attention._prefill_config = original
            print(f"| {' | '.join(map(str, tile))} | {split_keys} | {' | '.join(cells)} |", flush=True)
    print(f"\ninvariant done in {time.monotonic() - started:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=("prefill", "decode", "invariant"), default="prefill")
    parser.add_argument("--context", type=int, default=8192, help="prefill: keys before the chunk's end")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill: queries in the chunk")
    parser.add_argument("--models", default=",".join(DECODE_MODELS), help="decode: presets whose layer kinds to time")
    parser.add_argument("--batches", default="64,256,16,1", help="decode: sequences per call")
    parser.add_argument("--contexts", default="512,2048,8192", help="decode: keys per sequence")
    parser.add_argument("--time-limit", type=float, default=90.0,
                        help="decode: seconds after which no further point starts")
    parser.add_argument("--tiles", action="store_true",
                        help=f"decode: also each DECODE_TILES config from {SWEEP_FROM_BATCH} sequences "
                             "(with fewer --models/--contexts)")
    parser.add_argument("--compile-workers", type=int, default=None,
                        help="decode: processes that compile the kernels before the timing (default 12 on a GPU, "
                             "0 on the CPU; 0: each compiles at its first call)")
    parser.add_argument("--hbm", type=float, default=4.3, help="decode: HBM bandwidth in TB/s, for the %% column")
    parser.add_argument("--reps", type=int, default=None, help="timed replays (default 10 prefill, 5 decode)")
    parser.add_argument("--quick", type=int, default=0, help="time only the first N candidates (dry runs)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.mode == "decode":
        args.reps = args.reps or 5
        run_decode(args, device)
    elif args.mode == "invariant":
        args.reps = args.reps or 10
        run_invariant(args, device)
    else:
        args.reps = args.reps or 10
        run_prefill(args, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
