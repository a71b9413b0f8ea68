"""How fast this GPU's HBM can be *read*, the ceiling of a weight-streaming GEMV (which reads the weights once and
writes almost nothing), beside the device-to-device copy that ``bench/roofline.py``'s 4.3 TB/s comes from.

Three readers of the same bytes, each timed as the median of ``--reps`` CUDA-event-timed runs after a warm-up:

* ``copy``: ``dst.copy_(src)``; its traffic is counted both ways (read + write), as the roofline counts it;
* ``torch sum``: ``src.view(int32).sum()`` (PyTorch's reduction; the result is one number);
* ``triton read``: a streaming kernel where each program reads a contiguous chunk as 16-byte vectors and writes one
  int32, at several chunk sizes and warp counts (the best is printed).

Usage (on the GPU; ~20 s): ``python3 bench/read_bandwidth.py [--gib 2] [--reps 20]``
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(src_ptr, out_ptr, words_per_program, BLOCK: tl.constexpr):
    """Sum (wrapping int32) a contiguous chunk of ``words_per_program`` int32 words: every byte is read once."""
    pid = tl.program_id(0)
    base = src_ptr + pid.to(tl.int64) * words_per_program
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, words_per_program, BLOCK):
        acc += tl.load(base + start + tl.arange(0, BLOCK))
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def _median_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="bytes read per run, GiB")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    n_bytes = int(a.gib * 2**30) // 2**20 * 2**20
    src = torch.randint(-128, 127, (n_bytes,), dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    words = src.view(torch.int32)
    rows = []
    ms = _median_ms(lambda: dst.copy_(src), a.reps)
    rows.append(("copy (read + write counted)", 2 * n_bytes / ms / 1e9))
    ms = _median_ms(lambda: words.sum(), a.reps)
    rows.append(("torch sum (read)", n_bytes / ms / 1e9))
    best = (0.0, "")
    for words_per_program in (4096, 16384, 65536):
        programs = words.numel() // words_per_program
        out = torch.empty(programs, dtype=torch.int32, device="cuda")
        for block, warps in ((512, 4), (1024, 4), (2048, 8)):
            ms = _median_ms(functools.partial(_read_kernel[(programs,)], words, out, words_per_program, BLOCK=block,
                                              num_warps=warps), a.reps)
            tbps = n_bytes / ms / 1e9
            if tbps > best[0]:
                best = (tbps, f"{words_per_program * 4 // 1024} KiB a program, block {block}, {warps} warps")
    rows.append((f"triton read, best ({best[1]})", best[0]))
    print(f"# HBM bandwidth on {torch.cuda.get_device_name()}: {n_bytes / 2**30:.2f} GiB, median of {a.reps}")
    for name, tbps in rows:
        print(f"{name:60s} {tbps:6.2f} TB/s")


if __name__ == "__main__":
    main()
