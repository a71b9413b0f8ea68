"""Weights into L2 while the step's latency-bound kernels run: one launch of bulk L2 prefetches.

At a few tokens a decode layer alternates kernels that stream weights at the memory limit (the GEMVs, the
experts) with kernels that are latency (the q/k norm + RoPE + KV store, the attention, the router: a few MB of
reads over 2-8 µs each). While the latency kernels run, HBM idles. A weight the next streaming kernel reads is
known ahead (its address depends on shapes only), so it can be in L2 by the time that kernel starts: the
attention output projection of Qwen3-30B-A3B is 16.8 MB, the H200's L2 50 MB.

``l2_prefetch`` launches programs whose threads each issue one ``cp.async.bulk.prefetch.L2.global`` (sm_90: the
SM's TMA unit fetches a contiguous range into L2, asynchronously, with no registers or shared memory held) over
a chunk of the weight. The kernel reads nothing and writes nothing, so it cannot change a result; a prefetch is
a hint the memory system may drop.

PDL (``kernels.pdl``): the programs release first (the next kernel may get resident at once: nothing here
holds an SM), issue their prefetches (weights only, which nothing in a step writes, so before the wait), then
wait, so that this kernel completes only after its predecessor did and completion stays transitive along the
stream. This one kernel releases before its wait, so two kernels ahead of a running one may be resident; each
still waits for its predecessor's completion before it touches data.

Only compiled kernels on sm_90 or newer prefetch (the interpreter has no PTX); elsewhere ``l2_prefetch`` does
nothing.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from inference_server.kernels.pdl import pdl_launch, pdl_release, pdl_wait

__all__ = ["DEFAULT_CHUNK_BYTES", "l2_prefetch", "l2_prefetch_supported", "prefetch_grid"]

DEFAULT_CHUNK_BYTES = 16 * 1024
"""Bytes one thread's bulk prefetch asks for (a multiple of 16)."""
_THREADS = 32
"""Prefetches a program issues: one warp, one each."""


@triton.jit
def _bulk_prefetch_l2(addresses, sizes):
    """One ``cp.async.bulk.prefetch.L2.global`` per element: ``sizes`` bytes (a multiple of 16) from ``addresses``
    (16-byte aligned, as int64) into L2. The result is a dummy; the asm is not pure, so it is kept."""
    return tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                     [addresses, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(
    base_ptr,  # *u8: the first byte of the range (16-byte aligned)
    nbytes,  # i64: the range's length, a multiple of 16
    CHUNK: tl.constexpr,  # bytes a thread asks for (a multiple of 16)
    THREADS: tl.constexpr,  # prefetches a program issues
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL: release at once (this kernel holds no SM resources worth keeping the next one out for); the prefetches
    # touch weights only, so they go before the wait; the wait keeps completion transitive (module docstring).
    pdl_release(USE_PDL)
    offs = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64) * CHUNK
    inside = offs < nbytes
    start = tl.where(inside, offs, 0)  # lanes past the end ask for the first chunk again (a no-op in L2)
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    _bulk_prefetch_l2((base_ptr + start).to(tl.int64, bitcast=True), size)
    pdl_wait(USE_PDL)


@functools.cache
def _compiled_for(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def l2_prefetch_supported(device: torch.device) -> bool:
    """Compiled kernels (no ``TRITON_INTERPRET``) on a CUDA device of sm_90 or newer."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _compiled_for(index)


def prefetch_grid(nbytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Programs ``l2_prefetch`` launches for ``nbytes``: one chunk a thread, ``_THREADS`` threads a program."""
    return max(1, triton.cdiv(triton.cdiv(nbytes, chunk_bytes), _THREADS))


def l2_prefetch(weight: torch.Tensor, max_bytes: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> bool:
    """Ask for the first ``max_bytes`` (all, if None) of ``weight``'s storage in L2, asynchronously; returns whether
    a launch was made. Nothing happens (False) off sm_90+, under the interpreter, for a non-contiguous tensor, a
    start not 16-byte aligned, or nothing to fetch. CUDA-graph capturable (no host sync)."""
    if chunk_bytes <= 0 or chunk_bytes % 16 or not weight.is_contiguous() or not l2_prefetch_supported(weight.device):
        return False
    nbytes = weight.numel() * weight.element_size()
    if max_bytes is not None:
        nbytes = min(nbytes, max_bytes)
    nbytes -= nbytes % 16
    if nbytes <= 0 or weight.data_ptr() % 16:
        return False
    raw = weight.view(-1).view(torch.uint8)
    _l2_prefetch_kernel[(prefetch_grid(nbytes, chunk_bytes),)](raw, nbytes, CHUNK=chunk_bytes, THREADS=_THREADS,
                                                              num_warps=1, **pdl_launch())
    return True
