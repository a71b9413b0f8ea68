"""How long one prefill step of N tokens takes on this machine's CPU (the embedded model by default).

The CPU default step budget (``MAX_NUM_BATCHED_TOKENS=0`` -> 256 tokens off CUDA) is chosen from this: aborts,
deadlines and new requests are honoured between steps, so a step should stay around a second on a small CPU.
Prints the median of ``--repeats`` steps per size, and tokens per second.

    uv run python bench/cpu_step_time.py --sizes 64 128 256 512 1024
"""

from __future__ import annotations

import argparse
import statistics
import time

from inference_server.config import Settings
from inference_server.engine_factory import build_engine_parts
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="", help="MODEL setting (empty: the embedded model)")
    args = parser.parse_args()
    built = build_engine_parts(Settings(model=args.model, device="cpu", kv_cache_tokens=4096))
    runner, kv = built.runner, built.parts.kv
    request_id = 0
    print(f"model {built.loaded.name}, device {built.device}, dtype {built.dtype}")
    print(f"{'tokens':>7} {'median s':>9} {'tok/s':>8}")
    for size in args.sizes:
        times = []
        for _ in range(args.repeats):
            request_id += 1
            tokens = tuple(range(100, 100 + size))
            kv.start_sequence(request_id, tokens)
            kv.append_slots(request_id, size)
            tables = kv.block_tables(request_id)
            groups = (tables.full, tables.sliding) if kv.sliding_pool is not None else (tables.full,)
            sequence = ScheduledSequence(request_id, tokens, 0, groups, True, SamplingParams(temperature=0.0),
                                         reset=True, prompt_len=size)
            started = time.perf_counter()
            runner.execute(StepPlan(request_id, (sequence,), finished_request_ids=(request_id,)))
            times.append(time.perf_counter() - started)
            kv.release_sequence(request_id)
        median = statistics.median(times)
        print(f"{size:>7} {median:>9.2f} {size / median:>8.0f}")


if __name__ == "__main__":
    main()
