#!/usr/bin/env python3
"""GPU benchmark of programmatic dependent launch (``kernels/pdl.py``): the B=1 decode graph with PDL off and on.

Builds one model (dummy bf16 weights at the real config, optionally cut to ``--layers`` decoder layers) over a
paged KV cache of random K/V, and two ``CudaModelRunner``s on it that differ only in ``CudaRunnerOptions.pdl``
(graphs of bucket 1 only). Each runs the same teacher-forced decode steps to ``--context``, then the bare
bucket-1 graph replay is timed with CUDA events, ``--replays`` replays a round, rounds alternating off/on
(``--rounds``, 3 by default: the median is printed). It prints per setting the µs per replay and the kernels per
step, then the on/off ratio, and checks that one replay's final hidden states are bitwise equal with PDL on and off.
``--triton-gemv`` runs both with ``triton_dense_linear`` (the float projections as Triton kernels too, so fewer
cuBLAS launches break the chains of dependent launches).

  python3 bench/pdl_bench.py --model qwen3-30b-a3b                   # the whole model: ~2-3 min on the H200
  python3 bench/pdl_bench.py --model qwen3-30b-a3b --layers 4        # a few layers: < 1 min
  python3 bench/pdl_bench.py --model gemma-4-26b-a4b --triton-gemv
  python3 bench/pdl_bench.py --model qwen3-30b-a3b-tiny --device cpu # dry run of the script (interpreter, no PDL)

Lines start with ``PDL`` (one JSON object each) so a log can be grepped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

BLOCK = 16


def report(**record: object) -> None:
    print("PDL " + json.dumps(record), flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def replay_seconds(graphs, count: int, device: torch.device) -> float:
    """Mean seconds per bare replay of the bucket-1 graph over ``count`` back-to-back replays."""
    with torch.inference_mode():
        if device.type != "cuda":
            started = time.perf_counter()
            for _ in range(count):
                graphs.run(1)
            return (time.perf_counter() - started) / count
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(count):
            graphs.run(1)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / count


def kernels_per_replay(graphs) -> int | None:
    """CUDA kernels in one bucket-1 replay (torch.profiler), None where the profiler sees none."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs.run(1)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a preset name (models/loading/presets.py)")
    ap.add_argument("--layers", type=int, default=0, help="cut the model to this many decoder layers (0: all)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--replays", type=int, default=200, help="replays per timed round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per setting (the median is reported)")
    ap.add_argument("--triton-gemv", action="store_true", help="both runners with triton_dense_linear")
    ap.add_argument("--device", default="cuda", help="cpu: dry run (tiny preset, interpreter, PDL unsupported)")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

    import triton

    from inference_server.backends.cuda_backend import CudaModelRunner, CudaRunnerOptions
    from inference_server.backends.paged_kv import PagedKVStorage, group_of
    from inference_server.kernels.pdl import pdl_supported, use_pdl
    from inference_server.models.loading.loader import build_model, init_dummy_weights
    from inference_server.models.loading.presets import preset_config
    from inference_server.models.spec import parse_model_spec
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.records.steps import ScheduledSequence, StepPlan

    config = preset_config(a.model)
    if a.layers:
        config["num_hidden_layers"] = a.layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:a.layers]
    spec = parse_model_spec(config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report(kind="env", model=a.model, layers=len(spec.layers),
           torch=torch.__version__, triton=triton.__version__, pdl_supported=pdl_supported(),
           device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", triton_gemv=a.triton_gemv)
    started = time.perf_counter()
    model = build_model(spec, dtype, device)
    init_dummy_weights(model, seed=0)
    sync()
    report(kind="build", seconds=round(time.perf_counter() - started, 1))

    warmup = 3
    blocks = -(-(a.context + warmup + 2) // BLOCK)
    groups = sorted({group_of(layer) for layer in spec.cache_layers})
    storage = PagedKVStorage(spec.cache_layers, dict.fromkeys(groups, blocks), BLOCK, dtype, device)
    for t in storage.keys + storage.values:
        t.normal_()  # random K/V: never time on zeros
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    tables = (tuple(range(blocks)),) * len(groups)

    def plan(k: int) -> StepPlan:  # teacher-forced: the same tokens for both runners
        return StepPlan(step_id=k, sequences=(ScheduledSequence(
            request_id=1, token_ids=(100 + k,), cached_len=a.context + k, block_tables=tables, sample=True,
            sampling=greedy, reset=k == 0, prompt_len=1),))

    runners = {}
    for pdl in (False, True):
        options = CudaRunnerOptions(max_model_len=blocks * BLOCK, max_batch_size=1, capture=device.type == "cuda",
                                    triton_dense_linear=a.triton_gemv, pdl=pdl)
        started = time.perf_counter()
        runners[pdl] = CudaModelRunner(model, spec, storage, device, options)
        report(kind="capture", pdl=pdl, seconds=round(time.perf_counter() - started, 1))

    hidden = {}
    for pdl, runner in runners.items():
        for k in range(warmup):  # stages the bucket-1 inputs; both runners write the same K/V rows
            runner.execute(plan(k))
        runner.forget((1,))
        with torch.inference_mode():  # a bare replay of the last staged step: the same inputs for both
            hidden[pdl] = runner.graphs.run(1).clone()
    sync()
    equal = torch.equal(hidden[False], hidden[True])
    report(kind="check", hidden_bitwise_equal=equal)

    times: dict[bool, list[float]] = {False: [], True: []}
    for pdl in times:
        replay_seconds(runners[pdl].graphs, 10, device)  # warm clocks and caches
    for _ in range(a.rounds):
        for pdl in (False, True):
            times[pdl].append(replay_seconds(runners[pdl].graphs, a.replays, device))
    for pdl in (False, True):
        report(kind="replay", pdl=pdl, kernels=kernels_per_replay(runners[pdl].graphs),
               us=round(statistics.median(times[pdl]) * 1e6, 1), rounds_us=[round(t * 1e6, 1) for t in times[pdl]])
    off, on = statistics.median(times[False]), statistics.median(times[True])
    report(kind="result", model=a.model, off_us=round(off * 1e6, 1), on_us=round(on * 1e6, 1),
           on_over_off=round(on / off, 4), saved_us=round((off - on) * 1e6, 1), hidden_bitwise_equal=equal)
    use_pdl(False)
    if not equal:
        sys.exit("final hidden states differ with PDL on and off")


if __name__ == "__main__":
    main()
