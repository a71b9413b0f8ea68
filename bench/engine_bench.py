#!/usr/bin/env python3
"""GPU benchmark of the custom-cuda backend: steady-state decode and the nano-vllm offline workload.

``run`` measures one model (dummy bf16 weights at the real config) and appends JSON lines to
``<out>/engine_bench.jsonl``; ``table`` turns every line there, the transformers baseline's RESULT lines and
the physical limits of ``roofline.py`` into one markdown table (``<out>/table.md``, also printed).

* build: model construction plus dummy-weight init on the GPU (seconds, GPU memory allocated).
* decode: the runner of the engine (``build_cuda_runner``) over a paged KV cache filled with random K/V,
  ``B`` sequences at context ~``--context``; per batch, ``--steps`` full ``execute`` steps (stage inputs,
  graph replay, logits, sampling, token read-back) timed with synchronize + perf_counter, and the same count
  of bare graph replays timed with CUDA events. Batches whose KV would not fit are skipped (recorded).
  With batch 1 in the list, a ``kernels`` record: the device time of each kernel of the B=1 step (profiler
  over 5 bare replays, summed by kernel name) beside the step's memory-limited time. ``--prefill 8192``: a
  ``prefill`` record per prompt length, one prompt prefilled in eager steps of ``--prefill-chunk`` tokens: wall
  time (median of 3), prompt tok/s, fraction of the compute floor, and each kernel's device time.
* offline: nano-vllm's workload (256 requests, prompt and output lengths U[100, 1024], seed 0, ignore EOS,
  temperature 0.6) through the real engine path, ``offline.LLM.generate`` (admission, scheduler, KV
  allocator, executor thread, runner). Output tokens / wall seconds, after a small warm-up generate.

  python3 bench/engine_bench.py run --model qwen3-30b-a3b --out $OUT
  python3 bench/engine_bench.py run --model qwen3-30b-a3b --smoke --out /tmp/b  # tiny preset, seconds
  python3 bench/engine_bench.py table --out $OUT --hf-log $OUT/hf_qwen.log
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline

GIB = 1 << 30
# Transformers 5.17 static-batch generate() decode tok/s (prompt 512), measured 2026-11-29 on the lent H200 by
# ../shared/bench/hf_baseline.py (../shared/bench/results/README.md); used when no --hf-log is given.
HF_FALLBACK_DECODE = {
    "qwen3-30b-a3b": {1: 6.1, 16: 94.9, 64: 280.8, 256: 392.0},
    "gemma-4-26b-a4b": {1: 7.6, 16: 142.8, 64: 342.0},
    "gemma-4-31b": {1: 6.3, 16: 101.4, 64: 498.5},
}
# transformers' continuous batching (generate_batch), 256 x 512 -> 128 tokens: Qwen only (Gemma 4 fails there).
HF_FALLBACK_OFFLINE = {"qwen3-30b-a3b": 348.0}
HF_PRESET = {"qwen3-30b-a3b": "qwen3-30b-a3b", "gemma4-26b-a4b": "gemma-4-26b-a4b", "gemma4-31b": "gemma-4-31b"}


def emit(out: Path, **record: object) -> None:
    line = json.dumps(record)
    print("BENCH " + line, flush=True)
    with (out / "engine_bench.jsonl").open("a") as f:
        f.write(line + "\n")


def gpu_gib() -> float:
    return torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else 0.0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- decode


def time_replays(graphs, bucket: int, count: int, device: torch.device) -> float:
    """Median over 3 rounds of the mean seconds per bare graph replay (CUDA events; host clock off-GPU)."""
    times = []
    with torch.inference_mode():
        for _ in range(3):
            if device.type != "cuda":
                t0 = time.perf_counter()
                for _ in range(count):
                    graphs.run(bucket)
                times.append((time.perf_counter() - t0) / count)
                continue
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(count):
                graphs.run(bucket)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3 / count)
    return statistics.median(times)


def count_kernels(runner, batch: int) -> int | None:
    """CUDA kernels one eager decode forward of ``batch`` padded rows launches (torch.profiler)."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        ids, step = runner.graphs.step_view(runner.graphs.bucket_for(batch))
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.graphs.forward(ids, step)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as err:  # the count is informative only
        print(f"kernel count failed: {err!r}", flush=True)
        return None


def kernels_by_name(kernels: list) -> list[tuple[str, int, float]]:
    """(name, launches, device µs) per kernel name of profiler CUDA events, the most device time first."""
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        us = getattr(event, "device_time", None)
        entry = by_name.setdefault(event.name[:80], [0, 0.0])
        entry[0] += 1
        entry[1] += event.cuda_time if us is None else us
    return sorted(((name, int(count), us) for name, (count, us) in by_name.items()), key=lambda row: -row[2])


def kernel_times(runner, batch: int, replays: int = 5, top: int = 30) -> dict | None:
    """Device time of each kernel of one decode step at ``batch`` (torch.profiler over ``replays`` bare graph
    replays, or the eager forward when the trace shows no kernels inside graphs), summed by kernel name:
    launches and µs per step, largest first (the ``top`` of them, and the total of every kernel)."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        bucket = runner.graphs.bucket_for(batch)
        ids, step = runner.graphs.step_view(bucket)
        for source in ("graph", "eager"):
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(replays):
                    if source == "graph":
                        runner.graphs.run(bucket)
                    else:
                        runner.graphs.forward(ids, step)
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            if kernels:
                break
        rows = kernels_by_name(kernels)
        return dict(source=source, bucket=bucket, replays=replays,
                    kernels_per_step=round(sum(c for _, c, _ in rows) / replays, 1),
                    us_per_step=round(sum(t for _, _, t in rows) / replays, 1),
                    top=[dict(name=name, per_step=round(c / replays, 2), us_per_step=round(t / replays, 1))
                         for name, c, t in rows[:top]])
    except Exception as err:  # the table is informative only
        print(f"kernel times failed: {err!r}", flush=True)
        return None


def prefill_profile(runner, prompt_len: int, chunk: int, vocab: int, num_groups: int, block_size: int,
                    floor_s: float, repeats: int = 3, top: int = 25) -> dict:
    """One greedy prompt of ``prompt_len`` random tokens prefilled from position 0 in eager steps of ``chunk``
    tokens, as the engine's chunked prefill runs it (blocks 0.. of every group): the wall time of the whole
    prompt (synchronized, median of ``repeats`` after one untimed run), and the device time of each kernel of
    one more run (torch.profiler, summed by name, largest first): what the device computes, and what the wall
    adds to it (host dispatch the device waits for)."""
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.records.steps import ScheduledSequence, StepPlan

    gen = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=1)

    def run() -> None:
        for step, start in enumerate(range(0, prompt_len, chunk)):
            end = min(prompt_len, start + chunk)
            tables = (tuple(range(-(-end // block_size))),) * num_groups
            sequence = ScheduledSequence(request_id=-2, token_ids=tuple(ids[start:end]), cached_len=start,
                                         block_tables=tables, sample=end == prompt_len, sampling=greedy,
                                         reset=start == 0, prompt_len=prompt_len)
            runner.collect(runner.launch(StepPlan(step_id=step, sequences=(sequence,))))
        runner.forget((-2,))
        sync()

    run()
    walls = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        walls.append(time.perf_counter() - started)
    wall = statistics.median(walls)
    record = dict(prompt_len=prompt_len, chunk=chunk, wall_ms=round(wall * 1e3, 1),
                  tok_s=round(prompt_len / wall), floor_fraction=round(floor_s / wall, 3))
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
        rows = kernels_by_name([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA])
        record.update(kernel_ms=round(sum(t for _, _, t in rows) / 1e3, 1), launches=sum(c for _, c, _ in rows),
                      top=[dict(name=n, launches=c, ms=round(t / 1e3, 2)) for n, c, t in rows[:top]])
    return record


# Runner options per --variants entry: "after" is the engine's default; "before" is the runner with its reference
# ops (CudaRunnerOptions.reference_ops: the Triton norm, RoPE, attention, KV store, grouped MoE GEMMs and int8 GEMVs,
# PyTorch for the rest, no PDL) and the untuned MoE configs; "untuned" is the default without the tuned MoE configs;
# "no-pdl" is the default without programmatic dependent launch of the Triton kernels (kernels/pdl.py);
# "deterministic" is DETERMINISTIC=true's batch-invariant table (which runs on the reference ops). The experiments
# that had a variant of their own (torch.compile among them) are decided; their figures are in docs/benchmarks.md
# and in the commits that removed them.
VARIANTS: dict[str, dict[str, bool]] = {
    "after": {},
    "untuned": {},
    "before": dict(reference_ops=True),
    "no-pdl": dict(pdl=False),
    "deterministic": dict(reference_ops=True, deterministic=True),
}
UNTUNED = ("before", "untuned")


def bench_decode(name: str, preset: str, batches: list[int], context: int, steps: int, out: Path,
                 device: torch.device, variants: tuple[str, ...] = ("after",), repeats: int = 1,
                 quantization: str = "none", profile_batches: tuple[int, ...] = (1,),
                 int8_embeddings: str = "auto", max_model_len: int | None = None, warmup: int = 3,
                 prefill_lens: tuple[int, ...] = (), prefill_chunks: tuple[int, ...] = (2048,)) -> None:
    """Per variant: build the runner (graphs captured), count the B=1 kernels and time each kernel of a step at
    ``profile_batches``, then per batch ``repeats`` timed loops of ``steps`` steps (median reported, every run
    listed). ``max_model_len``: the runner's model length (default: just what the timed steps need); the decode
    attention's split count follows it, so a server's length (e.g. 8192) times the splits it would run."""
    from inference_server.backends.cuda.options import CudaRunnerOptions
    from inference_server.backends.cuda.runner import CudaModelRunner
    from inference_server.backends.paged_kv import PagedKVStorage, group_of
    from inference_server.models.loading.loader import build_model, init_dummy_weights
    from inference_server.models.loading.presets import preset_config
    from inference_server.models.spec import parse_model_spec
    from inference_server.records.sampling_params import SamplingParams

    spec = parse_model_spec(preset_config(preset))
    free_gpu()
    started = time.perf_counter()
    model = build_model(spec, torch.bfloat16, device, quantization, int8_embeddings)
    init_dummy_weights(model, seed=0)
    weight_bytes = roofline.engine_weight_bytes(quantization, model.int8_head() is not None)
    sync()
    load_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    emit(out, kind="build", model=name, preset=preset, seconds=round(load_s, 2), params=params,
         gpu_gib=round(gpu_gib(), 2))

    bs = 16
    blocks_per_seq = -(-(context + 2 * (warmup + steps) + 2) // bs)  # serial steps, then as many overlapped
    groups = sorted({group_of(layer) for layer in spec.cache_layers})
    block_bytes = sum(PagedKVStorage.bytes_per_block(spec.cache_layers, bs, 2).values())
    free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else 8 * GIB
    fits = [b for b in batches if b * blocks_per_seq * block_bytes <= 0.75 * free]
    for b in sorted(set(batches) - set(fits)):
        emit(out, kind="decode", model=name, batch=b, skipped=f"KV for {b} x {blocks_per_seq * bs} tokens "
             f"({b * blocks_per_seq * block_bytes / GIB:.0f} GiB) does not fit beside the weights")
    if not fits:
        return
    max_b = max(fits)
    prefill_blocks = -(-max(prefill_lens, default=0) // bs)
    storage = PagedKVStorage(spec.cache_layers, {g: max(max_b * blocks_per_seq, prefill_blocks) for g in groups}, bs,
                             torch.bfloat16, device)
    for t in storage.keys + storage.values:
        t.normal_()  # random K/V: never time on zeros
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    from inference_server.kernels import moe_configs

    for variant in variants:
        with moe_configs.tuned_configs(variant not in UNTUNED):  # the kernels launched in the block
            options = CudaRunnerOptions(max_model_len=max(max_model_len or 0, blocks_per_seq * bs, *prefill_lens),
                                        max_batch_size=max_b, **VARIANTS[variant])
            runner = CudaModelRunner(model, spec, storage, device, options)
            emit(out, kind="capture", model=name, variant=variant, buckets=list(runner.graphs.captured),
                 seconds=round(runner.capture_seconds, 2), gpu_gib=round(gpu_gib(), 2),
                 kernels_b1=count_kernels(runner, 1))
            decode_batches(runner, name, variant, sorted(fits), spec.vocab_size, len(groups), blocks_per_seq, context,
                           steps, repeats, greedy, out, device, weight_bytes, warmup)
            # Profiled after the timed steps: each bucket's static inputs then hold its last step (context
            # ~``context``). Right after capture they hold the capture's inputs, whose context is a few tokens, so the
            # attention was profiled at no context at all (every kernels record before 2026-12-01's fifth session).
            for batch in (b for b in profile_batches if b in fits):
                times = kernel_times(runner, batch)
                if times is not None:
                    emit(out, kind="kernels", model=name, variant=variant, batch=batch,
                         limit_us=round(1e6 * batch / roofline.decode_tok_s(name, batch, context, *weight_bytes), 1),
                         **times)
            for prompt_len, chunk in itertools.product(prefill_lens, prefill_chunks):
                emit(out, kind="prefill", model=name, variant=variant,
                     **prefill_profile(runner, prompt_len, chunk, spec.vocab_size, len(groups), bs,
                                       roofline.prefill_floor(roofline.MODELS[name], prompt_len).seconds))
            del runner
            free_gpu()
    del storage, model
    free_gpu()


def decode_batches(runner, name: str, variant: str, batches: list[int], vocab: int, num_groups: int,
                   blocks_per_seq: int, context: int, steps: int, repeats: int, greedy, out: Path,
                   device: torch.device, weight_bytes: tuple[float, float] = (2.0, 2.0), warmup: int = 3) -> None:
    """Time ``repeats`` loops of ``steps`` full steps per batch (after ``warmup`` steps), and the bare graph
    replays."""
    from inference_server.records.steps import PENDING_TOKEN, ScheduledSequence, StepPlan

    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        first_ids = torch.randint(100, vocab - 100, (batch,), generator=gen).tolist()
        tables = [(tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),) * num_groups for i in range(batch)]
        last = list(first_ids)

        def plan(k: int, batch: int = batch, tables: list = tables, last: list = last,
                 pending: bool = False) -> StepPlan:
            # pending: the token is the one the step launched before this one sampled (the engine's overlap)
            return StepPlan(step_id=k, sequences=tuple(ScheduledSequence(
                request_id=batch * 100_000 + i, token_ids=(PENDING_TOKEN if pending else last[i],),
                cached_len=context + k, block_tables=tables[i], sample=True, sampling=greedy, reset=k == 0,
                prompt_len=1) for i in range(batch)))

        def step(k: int, last: list = last) -> None:
            result = runner.execute(plan(k))
            for i, token in enumerate(result.tokens):
                last[i] = token.token_id

        def overlapped(first: int, count: int, last: list = last) -> None:
            """``count`` steps as the engine runs them with OVERLAP on (``actors/executor.RunnerPipeline``): step
            k+1 is launched, its token ids pending on the device, before step k's tokens are collected."""
            in_flight = runner.launch(plan(first))
            for k in range(first + 1, first + count):
                launched = runner.launch(plan(k, pending=True))
                runner.collect(in_flight)
                in_flight = launched
            for i, token in enumerate(runner.collect(in_flight).tokens):
                last[i] = token.token_id

        runs: list[float] = []
        overlapped_runs: list[float] = []
        replays: list[float] = []
        bucket = runner.graphs.bucket_for(batch)
        for _ in range(repeats):
            # Every repeat restarts the sequences at the same context (reset on the first step), so the runs
            # time the same work.
            for k in range(warmup):
                step(k)
            sync()
            t0 = time.perf_counter()
            for k in range(warmup, warmup + steps):
                step(k)
            sync()
            runs.append((time.perf_counter() - t0) / steps)
            overlapped(warmup + steps, warmup)  # its own warm-up: the first pending steps do one-time work
            sync()
            t0 = time.perf_counter()
            overlapped(2 * warmup + steps, steps)
            sync()
            overlapped_runs.append((time.perf_counter() - t0) / steps)
            replays.append(time_replays(runner.graphs, bucket, steps, device))
            runner.forget(tuple(batch * 100_000 + i for i in range(batch)))
        step_s, replay_s = statistics.median(runs), statistics.median(replays)
        overlap_s = statistics.median(overlapped_runs)
        ctx_mid = context + warmup + steps // 2
        limit = roofline.decode_tok_s(name, batch, ctx_mid, *weight_bytes)
        emit(out, kind="decode", model=name, variant=variant, batch=batch, bucket=bucket, context=ctx_mid,
             steps=steps, repeats=repeats, tok_s_runs=[round(batch / s, 1) for s in runs],
             step_ms=round(step_s * 1e3, 3), tok_s=round(batch / step_s, 1), replay_ms=round(replay_s * 1e3, 3),
             replay_tok_s=round(batch / replay_s, 1), overlap_ms=round(overlap_s * 1e3, 3),
             overlap_tok_s=round(batch / overlap_s, 1),
             overlap_tok_s_runs=[round(batch / s, 1) for s in overlapped_runs],
             overlap_fraction=round(batch / overlap_s / limit, 3), limit_tok_s=round(limit, 1),
             fraction=round(batch / step_s / limit, 3), replay_fraction=round(batch / replay_s / limit, 3),
             graph_steps=runner.graph_steps)


# -------------------------------------------------------------------------------------------- offline


def bench_offline(name: str, preset: str, num_requests: int, out: Path, smoke: bool, device: torch.device,
                  overlaps: tuple[bool, ...] = (True,), quantization: str = "none",
                  int8_embeddings: str = "auto") -> None:
    from inference_server.config import Settings
    from inference_server.offline import LLM
    from inference_server.records.sampling_params import SamplingParams

    free_gpu()
    backend = "custom-cuda" if device.type == "cuda" else "reference"  # off-GPU: a dry run of the script
    settings = Settings(model=preset, dummy_weights=True, device=device.type, backend=backend, max_batch_size=256,
                        max_model_len=4096 if not smoke else 1024, kv_cache_memory_fraction=0.85, seed=0,
                        kv_cache_tokens=65_536 if smoke else 0, quantization=quantization,
                        int8_embeddings=int8_embeddings)
    started = time.perf_counter()
    llm = LLM(settings)
    runner = llm.built.runner
    kv = llm.built.parts.kv
    emit(out, kind="engine_build", model=name, seconds=round(time.perf_counter() - started, 2),
         load_seconds=round(llm.built.loaded.load_seconds, 2),
         capture_seconds=round(getattr(runner, "capture_seconds", 0.0), 2),
         gpu_gib=round(gpu_gib(), 2), kv_full_blocks=kv.full_pool.num_blocks,
         kv_sliding_blocks=kv.sliding_pool.num_blocks if kv.sliding_pool else 0, block_size=kv.block_size)
    # Warm-up (nano-vllm does one too): a smaller draw of the same workload, 8 tokens each, so the Triton
    # kernels of the prefill-chunk and decode shapes are compiled before the clock starts.
    warm_prompts, _ = roofline.nano_vllm_workload(32, seed=1, max_input=1024 if not smoke else 200)
    vocab = llm.built.loaded.spec.vocab_size
    llm.generate([[t % vocab for t in p] for p in warm_prompts], SamplingParams(max_tokens=8, ignore_eos=True))
    prompts, outputs = roofline.nano_vllm_workload(num_requests, seed=0, max_input=1024 if not smoke else 200,
                                                   max_output=1024 if not smoke else 120)
    if smoke:  # the tiny presets' vocabulary is smaller than nano-vllm's ids
        prompts = [[t % llm.built.loaded.spec.vocab_size for t in p] for p in prompts]
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outputs]
    built = llm.built
    for overlap in overlaps:  # OVERLAP on and off on the same loaded model (the engine is rebuilt per generate)
        llm.built = attrs.evolve(built, parts=attrs.evolve(built.parts, overlap=overlap))
        if kv.prefix_cache is not None:  # each run starts cold: no prefix-cache hits on the previous run's prompts
            kv.prefix_cache.evict_full(kv.full_pool.num_cached)
        graph0, eager0 = getattr(runner, "graph_steps", 0), getattr(runner, "eager_steps", 0)
        started = time.perf_counter()
        completions = llm.generate(prompts, params)
        seconds = time.perf_counter() - started
        generated = sum(len(c.token_ids) for c in completions)
        short = sum(1 for c, o in zip(completions, outputs, strict=True) if len(c.token_ids) != o)
        errors = [c.error for c in completions if c.error][:3]
        prompt_lens = [len(p) for p in prompts]
        limit_s, _ = roofline.offline_floor(roofline.MODELS[name], prompt_lens, outputs)
        emit(out, kind="offline", model=name, overlap=overlap, requests=num_requests, prompt_tokens=sum(prompt_lens),
             output_tokens=generated, expected_tokens=sum(outputs), short_requests=short, errors=errors,
             seconds=round(seconds, 2), tok_s=round(generated / seconds, 1),
             limit_tok_s=round(sum(outputs) / limit_s, 1),
             fraction=round(generated / seconds / (sum(outputs) / limit_s), 3),
             graph_steps=getattr(runner, "graph_steps", 0) - graph0,
             eager_steps=getattr(runner, "eager_steps", 0) - eager0)
    llm.built = built
    del llm, runner, kv
    free_gpu()


# ---------------------------------------------------------------------------------------------- table


def hf_results(paths: list[Path]) -> tuple[dict[str, dict[int, float]], dict[str, float]]:
    """decode tok/s per model and batch, and continuous-batching tok/s, from hf_baseline.py RESULT lines."""
    decode: dict[str, dict[int, float]] = {}
    offline: dict[str, float] = {}
    for path in paths:
        if not path.is_file():
            continue
        model = None
        for line in path.read_text().splitlines():
            if not line.startswith("RESULT "):
                continue
            rec = json.loads(line[7:])
            if rec.get("kind") == "build":
                model = HF_PRESET.get(rec["preset"], rec["preset"])
            elif rec.get("kind") == "hf_static_generate" and "decode_tok_s" in rec and model:
                decode.setdefault(model, {})[rec["batch"]] = rec["decode_tok_s"]
            elif rec.get("kind") == "hf_generate_batch" and "out_tok_s" in rec and model:
                offline[model] = rec["out_tok_s"]
    return decode, offline


def table(out: Path, hf_logs: list[Path]) -> str:
    records = [json.loads(line) for line in (out / "engine_bench.jsonl").read_text().splitlines() if line]
    hf_decode, hf_offline = hf_results(hf_logs)
    source = {m: "measured in this run" for m in hf_decode}
    for model, values in HF_FALLBACK_DECODE.items():
        if model not in hf_decode:
            hf_decode[model], source[model] = values, "shared results of 2026-11-29"
    for model, value in HF_FALLBACK_OFFLINE.items():
        hf_offline.setdefault(model, value)
    rows = ["| model | workload | ours tok/s (serial steps) | overlapped steps tok/s | graph-replay tok/s | "
            "limit tok/s | fraction of limit | transformers tok/s | ours / transformers |",
            "|---|---|---|---|---|---|---|---|---|"]
    for rec in records:
        model = rec.get("model")
        if rec["kind"] == "decode" and "skipped" in rec:
            rows.append(f"| {model} | decode B={rec['batch']} | skipped: {rec['skipped']} | | | | | | |")
        elif rec["kind"] == "decode":
            hf = hf_decode.get(model, {}).get(rec["batch"])
            ratio = f"{rec['tok_s'] / hf:,.1f}x" if hf else "n/a"
            variant = f" ({rec['variant']})" if rec.get("variant", "after") != "after" else ""
            runs = f", median of {rec['repeats']}" if rec.get("repeats", 1) > 1 else ""
            rows.append(f"| {model} | decode B={rec['batch']} ctx {rec['context']}{variant}{runs} | "
                        f"{rec['tok_s']:,.0f} | {rec.get('overlap_tok_s', 0):,.0f} | "
                        f"{rec['replay_tok_s']:,.0f} | {rec['limit_tok_s']:,.0f} | {rec['fraction']:.2f} "
                        f"(overlapped {rec.get('overlap_fraction', 0):.2f}, replay {rec['replay_fraction']:.2f}) | "
                        f"{hf if hf else 'n/a'} | {ratio} |")
        elif rec["kind"] == "offline":
            hf = hf_offline.get(model)
            ratio = f"{rec['tok_s'] / hf:,.1f}x (different workload)" if hf else "n/a"
            overlap = {True: ", overlap on", False: ", overlap off"}.get(rec.get("overlap"), "")
            rows.append(f"| {model} | offline{overlap} {rec['requests']} req, {rec['output_tokens']:,} out tok in "
                        f"{rec['seconds']:.1f} s | {rec['tok_s']:,.0f} | | | {rec['limit_tok_s']:,.0f} | "
                        f"{rec['fraction']:.2f} | {hf if hf else 'n/a'} | {ratio} |")
    builds = [f"- {r['model']}: {r['kind']} {r['seconds']} s, GPU memory {r['gpu_gib']} GiB"
              + (f", graphs captured in {r['capture_seconds']} s" if "capture_seconds" in r else "")
              for r in records if r["kind"] in ("build", "engine_build")]
    captures = [f"- {r['model']}{' (' + r['variant'] + ')' if 'variant' in r else ''}: decode graphs "
                f"{r['buckets']} captured in {r['seconds']} s; "
                f"{r['kernels_b1']} kernels per eager B=1 decode forward" for r in records if r["kind"] == "capture"]
    notes = [f"- transformers numbers for {m}: {s}" for m, s in sorted(source.items())]
    text = "\n".join([*rows, "", *builds, *captures, *notes])
    (out / "table.md").write_text(text + "\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("--model", choices=sorted(roofline.MODELS))
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--variants", default="after",
                    help="decode runner variants, comma separated: " + ", ".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=1, help="decode: timed loops per batch (the median is reported)")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--profile-batches", default="1",
                    help="decode: batches whose step is profiled kernel by kernel (comma separated; empty: none)")
    ap.add_argument("--prefill", default="",
                    help="decode: prompt lengths whose chunked eager prefill is timed and profiled (comma separated)")
    ap.add_argument("--prefill-chunk", default="2048",
                    help="tokens a prefill step (MAX_NUM_BATCHED_TOKENS); a comma list times each prompt at each")
    ap.add_argument("--overlap", default="on", help="offline runs: on, off, or a list such as on,off,on,off")
    ap.add_argument("--smoke", action="store_true", help="the -tiny preset and a small workload (checks the script)")
    ap.add_argument("--hf-log", type=Path, action="append", default=[])
    ap.add_argument("--device", default="cuda", help="cpu: dry run of the script (tiny preset, interpreter)")
    ap.add_argument("--quantization", default="none", choices=("none", "int8"), help="QUANTIZATION of the model")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="decode: the runner's model length (default: what the timed steps need); the decode "
                         "attention's split count follows it")
    ap.add_argument("--int8-embeddings", default="auto", choices=("auto", "on", "off"),
                    help="INT8_EMBEDDINGS of the model (on: the lm_head int8 too, and the fused int8 greedy head)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.what == "table":
        print(table(a.out, a.hf_log))
        return
    import triton

    preset = a.model + ("-tiny" if a.smoke else "")
    device = torch.device(a.device)
    emit(a.out, kind="env", model=a.model, quantization=a.quantization, int8_embeddings=a.int8_embeddings,
         torch=torch.__version__,
         triton=triton.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
         date=time.strftime("%Y-%m-%d %H:%M"))
    if not a.skip_decode:
        bench_decode(a.model, preset, [int(b) for b in a.batches.split(",")], a.context, a.steps, a.out, device,
                     tuple(v.strip() for v in a.variants.split(",")), a.repeats, a.quantization,
                     tuple(int(b) for b in a.profile_batches.split(",") if b.strip()), a.int8_embeddings,
                     a.max_model_len, warmup=1 if a.smoke else 3,  # a smoke run checks calls, not timings
                     prefill_lens=tuple(int(n) for n in a.prefill.split(",") if n.strip()),
                     prefill_chunks=tuple(int(n) for n in a.prefill_chunk.split(",")))
    if not a.skip_offline:
        overlaps = tuple(v.strip() == "on" for v in a.overlap.split(","))
        bench_offline(a.model, preset, a.requests, a.out, a.smoke, device, overlaps, a.quantization,
                      a.int8_embeddings)


if __name__ == "__main__":
    main()
