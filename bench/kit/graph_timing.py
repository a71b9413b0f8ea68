"""Device time of kernel calls as a model's decode step runs them, for the kernel benchmarks and tuners
(``int8_kernels.py``, ``tune_triton_launch.py``).

* ``time_calls``: the calls captured in one CUDA graph (no host launch cost, as in the engine's decode graphs),
  replayed and timed with CUDA events; the median per call. On the CPU (dry runs), the wall time of each call.
* ``rotation``: how many copies of the weights to cycle through so that one call's weights are not in L2 from
  the previous read of that copy, as in a model where each layer reads its own weights.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

L2_BYTES = 50 * 2**20  # H200 (read from the device when there is one)


def device_l2_bytes(device: torch.device) -> int:
    """The device's L2 size where torch reports it, else ``L2_BYTES``; 0 off CUDA (a dry run: no device L2 to
    miss, so ``rotation`` keeps one weight copy, as tune_triton_launch does there)."""
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", L2_BYTES) or L2_BYTES


def rotation(call_bytes: int, l2_bytes: int = L2_BYTES, max_copies: int = 16) -> int:
    """Weight copies to cycle through so that at least 2x the L2 lies between two reads of one copy."""
    return max(1, min(max_copies, math.ceil(2 * l2_bytes / max(1, call_bytes))))


def calls_per_graph(copies: int, at_least: int = 10) -> int:
    """Calls in one timed graph: whole rounds over the copies, at least ``at_least``."""
    return copies * math.ceil(at_least / copies)


def time_calls(calls: list[Callable[[], object]], device: torch.device, reps: int) -> float:
    """Median seconds per call. CUDA: a graph replaying ``calls`` in order, CUDA events around each replay.
    CPU (dry run): wall time of each call."""
    for call in calls:  # compile and warm outside the capture
        call()
    if device.type != "cuda":
        times = []
        for _ in range(max(1, reps)):
            for call in calls:
                started = time.perf_counter()
                call()
                times.append(time.perf_counter() - started)
        return statistics.median(times)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # a warm call on the capture stream (cuBLAS workspaces)
        calls[0]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(1, reps)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / len(calls))
    del graph
    return statistics.median(times)
