#!/usr/bin/env python3
"""How often greedy tokens change with scheduling: solo vs inside a loaded batch vs after a prefix-cache hit.

Runs ``inference_server.schedule_invariance`` (see its docstring for the three runs) on one or more engine
variants and prints, per variant, a table (per prompt: solo and loaded prefill chunks, the cache hit, the
smallest top-2 margin of the solo run, and where each run first differs from the solo run with the top-2
margins there), then one RESULT line per variant with the divergence rate. JSON lines go to
``<out>/schedule_invariance.jsonl`` when ``--out`` is given.

  python3 bench/schedule_invariance.py cpu                       # embedded Gemma 3 270M, fp32 (~1 min)
  python3 bench/schedule_invariance.py gpu --out $OUT            # Gemma-4-26B-A4B, dummy weights:
      # fp32 cut to 6 layers (what the gpu test asserts), bf16 cut to 6 layers, bf16 full (30 layers)
  python3 bench/schedule_invariance.py gpu --variants bf16-full --set OVERLAP=true   # any Settings override

A divergence at a solo top-2 margin far above the dtype's rounding (bf16: ~0.4 % of a logit, i.e. up to
~0.1 nat near the softcap of 30; fp32: ~1e-6) points at a scheduling defect rather than rounding.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the harness
from tests.schedule_invariance import (
    GPU_PRESET,
    WAYS,
    InvarianceConfig,
    InvarianceReport,
    cpu_config,
    cut_model_folder,
    gpu_config,
    run_invariance,
)

GPU_CUT_LAYERS = 6


def variants(mode: str, names: list[str] | None, scratch: Path) -> dict[str, InvarianceConfig]:
    if mode == "cpu":
        return {"cpu-fp32-embedded": cpu_config()}
    cut = str(cut_model_folder(GPU_PRESET, GPU_CUT_LAYERS, scratch / f"{GPU_PRESET}-{GPU_CUT_LAYERS}l"))
    every = {"fp32-6l": gpu_config(cut, "float32"), "bf16-6l": gpu_config(cut, "bfloat16"),
             "bf16-full": gpu_config(GPU_PRESET, "bfloat16")}
    unknown = sorted(set(names or ()) - set(every))
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {sorted(every)}")
    return {name: every[name] for name in (names or every)}


def summary(name: str, report: InvarianceReport, seconds: float) -> str:
    n = len(report.outcomes)
    parts = [f"RESULT {name}:"]
    for way in WAYS:
        divergences = [(i, o.divergence(way)) for i, o in enumerate(report.outcomes)]
        firsts = ", ".join(f"#{i}@{d.position} margin {d.solo_margin:.3g}" for i, d in divergences if d is not None)
        parts.append(f"solo vs {way.replace('_', ' ')} {report.identical(way)}/{n} identical"
                     + (f" ({firsts})" if firsts else "") + ";")
    parts.append(f"{seconds:.0f} s")
    return " ".join(parts)


def records(name: str, report: InvarianceReport) -> list[dict]:
    rows = []
    for i, o in enumerate(report.outcomes):
        row: dict = {"variant": name, "prompt": i, "prompt_len": o.prompt_len, "shared_len": o.shared_len,
                     "solo_chunks": o.solo_chunks, "loaded_chunks": o.loaded_chunks,
                     "cached_prompt_tokens": o.runs["cache_hit"].cached_prompt_tokens,
                     "min_solo_margin": o.min_solo_margin, "solo": list(o.solo.token_ids)}
        for way in WAYS:
            d = o.divergence(way)
            row[way] = list(o.runs[way].token_ids)
            row[f"{way}_divergence"] = None if d is None else {
                "position": d.position, "solo_margin": d.solo_margin, "other_margin": d.other_margin}
        rows.append({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()})
    return rows


def free_device() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except ImportError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("cpu", "gpu"))
    parser.add_argument("--variants", help="comma-separated gpu variants (default: all)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a Settings override for every variant (environment names, e.g. OVERLAP=true)")
    parser.add_argument("--fillers", type=int, help="filler requests of the loaded run (a test prompt arrives "
                        "every 2 x this many streamed tokens, about every 2 steps)")
    parser.add_argument("--out", type=Path, help="folder for schedule_invariance.jsonl")
    args = parser.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        chosen = variants(args.mode, args.variants.split(",") if args.variants else None, Path(scratch))
        for name, config in chosen.items():
            config = attrs.evolve(config, settings={**config.settings, **overrides})
            if args.fillers is not None:
                config = attrs.evolve(config, num_fillers=args.fillers, stagger_tokens=max(1, 2 * args.fillers))
            print(f"== {name}: {dict(config.settings)}", flush=True)
            started = time.perf_counter()
            try:
                report = run_invariance(config)
            except Exception as error:  # one device call runs every variant: report and go on
                traceback.print_exc()
                results.append(f"RESULT {name}: FAILED {error!r}")
                free_device()
                continue
            seconds = time.perf_counter() - started
            print(report.table(), flush=True)
            results.append(summary(name, report, seconds))
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                with (args.out / "schedule_invariance.jsonl").open("a") as f:
                    f.writelines(json.dumps(row) + "\n" for row in records(name, report))
            del report
            free_device()
    print("\n".join(results), flush=True)


if __name__ == "__main__":
    sys.exit(main())
