#!/usr/bin/env python3
"""The fused residual add + RMSNorm (``ops.add_rms_norm``, ``CudaRunnerOptions.triton_add_norm``) on and off.

For each model (dummy bf16 weights at the real config) the CUDA runner is built twice on the same weights and
KV cache, with the op off (torch add + Triton norm: the launch count of the code before the op) and on, twice
each, alternating. Per build: kernels of one eager B=1 decode forward (torch.profiler), the bare graph replay
at each batch (median of 3 rounds, CUDA events) and the greedy tokens of ``--steps`` teacher-free decode steps
(on the GPU the two settings give the same tokens: the kernel's add rounds fp32 to nearest, as torch's bf16
add; the CPU interpreter truncates fp32 -> bf16, so there they may differ).
JSON lines to stdout and ``<out>/add_norm_bench.jsonl``.

  python3 bench/add_norm_bench.py --out $OUT
  python3 bench/add_norm_bench.py --models qwen3-30b-a3b --batches 1 --out /tmp/b
  python3 bench/add_norm_bench.py --device cpu --models qwen3-30b-a3b-tiny --batches 1,2 --context 16 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import count_kernels, free_gpu, time_replays


def run_model(preset: str, batches: list[int], context: int, steps: int, out: Path, device: torch.device) -> None:
    from inference_server.backends.cuda_backend import CudaModelRunner, CudaRunnerOptions
    from inference_server.backends.paged_kv import PagedKVStorage, group_of
    from inference_server.models.loading.loader import build_model, init_dummy_weights
    from inference_server.models.loading.presets import preset_config
    from inference_server.models.spec import parse_model_spec
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.records.steps import ScheduledSequence, StepPlan

    spec = parse_model_spec(preset_config(preset))
    model = build_model(spec, torch.bfloat16, device)
    init_dummy_weights(model, seed=0)
    bs, max_b = 16, max(batches)
    blocks_per_seq = -(-(context + steps + 2) // bs)
    groups = sorted({group_of(layer) for layer in spec.cache_layers})
    storage = PagedKVStorage(spec.cache_layers, {g: max_b * blocks_per_seq for g in groups}, bs, torch.bfloat16,
                             device)
    for t in storage.keys + storage.values:
        t.normal_()  # random K/V: never time on zeros
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    tokens: dict[tuple[int, bool], list[list[list[int]]]] = {}  # (batch, fused) -> per build, step, row
    for fused in (False, True, False, True):
        options = CudaRunnerOptions(max_model_len=blocks_per_seq * bs, max_batch_size=max_b, triton_add_norm=fused,
                                    capture=device.type == "cuda")
        runner = CudaModelRunner(model, spec, storage, device, options)
        assert runner.graphs is not None
        record: dict = dict(model=preset, triton_add_norm=fused, layers=spec.num_layers,
                            kernels_b1=count_kernels(runner, 1))
        for batch in batches:
            tables = [(tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),) * len(groups)
                      for i in range(batch)]
            last = [100 + 7 * i for i in range(batch)]
            produced: list[list[int]] = []
            for k in range(steps):
                plan = StepPlan(step_id=k, sequences=tuple(ScheduledSequence(
                    request_id=batch * 100_000 + i, token_ids=(last[i],), cached_len=context + k,
                    block_tables=tables[i], sample=True, sampling=greedy, reset=k == 0, prompt_len=1)
                    for i in range(batch)))
                last = [token.token_id for token in runner.execute(plan).tokens]
                produced.append(last)
            runner.forget(tuple(batch * 100_000 + i for i in range(batch)))
            replays = 50 if device.type == "cuda" else 1
            replay_s = time_replays(runner.graphs, runner.graphs.bucket_for(batch), replays, device)
            record[f"replay_ms_b{batch}"] = round(replay_s * 1e3, 4)
            tokens.setdefault((batch, fused), []).append(produced)
        line = json.dumps(record)
        print(line, flush=True)
        with (out / "add_norm_bench.jsonl").open("a") as f:
            f.write(line + "\n")
        del runner
        free_gpu()
    summary = dict(model=preset, greedy_tokens={f"b{b}": dict(
        repeatable=all(run == tokens[(b, fused)][0] for fused in (False, True) for run in tokens[(b, fused)]),
        on_equals_off=tokens[(b, True)][0] == tokens[(b, False)][0]) for b in batches})
    print(json.dumps(summary), flush=True)
    with (out / "add_norm_bench.jsonl").open("a") as f:
        f.write(json.dumps(summary) + "\n")
    del model, storage
    free_gpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-30b-a3b,gemma-4-26b-a4b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--device", default="cuda", help="cpu: dry run of the script (use -tiny presets; interpreter)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    for preset in args.models.split(","):
        run_model(preset, [int(b) for b in args.batches.split(",")], args.context, args.steps, args.out,
                  torch.device(args.device))


if __name__ == "__main__":
    main()
