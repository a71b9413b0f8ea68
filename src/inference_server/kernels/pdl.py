"""Programmatic dependent launch (PDL) of the step's Triton kernels: the one module that knows about it.

A decode step at batch 1 is hundreds of short kernels in one CUDA graph, and between two kernels of a stream the
GPU idles ~1.2 µs (launch, then the first CTAs' set-up). Hopper (sm_90) lets a kernel launched with the
programmatic-stream-serialization attribute start while its predecessor still runs: its CTAs get resident as soon
as every CTA of the predecessor has executed ``griddepcontrol.launch_dependents`` (or exited), and its
``griddepcontrol.wait`` blocks until the predecessor has *completed* and its memory is visible. Stream capture
turns the attribute into programmatic edges of the graph. Triton exposes the attribute as the ``launch_pdl``
launch option and the two instructions as ``tl.extra.cuda.gdc_wait`` / ``gdc_launch_dependents`` (the same names
in Triton 3.6 and 3.9).

Invariant that makes it safe (every kernel taking part keeps it):

* A kernel launched with the PDL attribute calls ``pdl_wait`` in every program, on every path (before any early
  return), before its first global read of data that a predecessor may write and before its first global write
  (or atomic). Write-after-read counts too: a kernel must not overwrite a buffer (its output, a workspace the
  caching allocator hands out again, a counter) that its predecessor may still be reading.
* Before the wait a kernel may read only what no launch of the step still running writes: weights (never written
  during a step) at addresses that depend on shapes alone, and data whose last writer completed before the
  launch just before this one passed its own wait (every kernel here releases after its wait, below, so that is
  any launch two or more back, and anything copied in before the step). The CUDA-core GEMV (``int8_gemv``) loads
  its first weight tile there, ``norm_add`` and ``qk_norm_rope`` their norm weights (and the layer scale), so that
  the DRAM latency of their start overlaps the predecessor's tail. The decode attention (``decode_attention``,
  ``KV_BEFORE_WAIT``) loads its context lengths and block tables (copied in before the step) and its first tile
  of the earlier keys and values (stored by earlier steps); the query's own key and value, which the launch just
  before it writes, it loads after the wait. The MoE decode down launch (``moe_decode``, ``W_BEFORE_WAIT``) loads
  its expert ids (the router's, two launches back) and its first weight tiles. The other kernels' weight loads
  share loops (or depend on indices written by the launch just before, e.g. the gate/up launch's routed expert)
  with data of earlier kernels.

A new kernel takes part by taking ``USE_PDL: tl.constexpr = False``, keeping the invariant, launching with
``**pdl_launch()``, and joining the cases of ``tests/kernels/test_kernels_compile_for_h200.py``'s PDL test (which
fails for a kernel with ``USE_PDL`` that it does not compile). A kernel launched without ``pdl_launch()`` simply
does not take part.

Completion is then transitive along the stream: a kernel completes only after its wait returned, i.e. after its
predecessor completed, so when kernel N's wait returns every earlier kernel of the stream has completed. Kernels
launched without the attribute (cuBLAS, PyTorch, a Triton kernel with the switch off) wait for full completion of
their predecessor as always, so mixing them in is safe.

``pdl_release`` (``launch_dependents``) only says when the dependent may get resident (it fires once every program
of the kernel has called it or exited, so never before the kernel's last wave is resident); where each kernel
places it is a performance choice, commented there. Every kernel here releases after its wait, so at most one
kernel ahead is resident and waiting. Short kernels release right after the wait (the dependent's launch latency
hides behind their whole run). Kernels with a main loop (GEMVs, attention, the expert GEMMs) release where the PDL
mode says (``PdlMode.early_release``): after the loop (``PDL_RELEASE_AFTER_LOOP``, ``USE_PDL=True``: waiting CTAs hold
no shared memory and registers while the loop's programs stream) or right after their wait
(``PDL_RELEASE_AFTER_WAIT``, ``USE_PDL=2``: the dependent's CTAs get resident and load their first weight tiles
while the loop streams). Either is safe: the release fires only once every program of the kernel is resident (or
done), so the waiting CTAs never keep one of its programs off an SM, and it stays after the wait, so the launch
two back has completed when the dependent reads what it may read before its own wait. A loop kernel calls
``pdl_release_after_wait`` right after its wait (on every path) and ``pdl_release_after_loop`` after its loop, and
its launch names its class (``pdl_launch(loop=...)``, one of ``PDL_LOOP_CLASSES``): the mode is chosen per class, so
e.g. the decode attention may release after its wait while the GEMVs release after their loops.

The mode (``PdlMode``) is not process-wide: the CUDA runner launches its steps (eager launches and graph capture)
inside ``pdl_mode(its mode)``, a context variable's scope, so kernels launched elsewhere (a reference runner, a test)
get the default: off. PDL is on only when the mode asks for it AND the current CUDA device is sm_90 or newer AND the
kernels are compiled (not under ``TRITON_INTERPRET``) AND this Triton has the launch option and the instructions.
Off, every kernel compiles to exactly the code it had before (``USE_PDL`` is a constexpr: the instructions are not
emitted) and is launched without the attribute.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Iterable, Iterator

import torch
import triton
import triton.language as tl

__all__ = ["PDL_LOOP_CLASSES", "PDL_OFF", "PDL_RELEASE_AFTER_LOOP", "PDL_RELEASE_AFTER_WAIT", "PdlMode",
           "early_release_classes", "loop_classes", "pdl_enabled", "pdl_launch", "pdl_mode", "pdl_release",
           "pdl_release_after_loop", "pdl_release_after_wait", "pdl_requested", "pdl_supported", "pdl_wait"]

PDL_RELEASE_AFTER_LOOP = 1
"""``USE_PDL`` of a kernel launched as a programmatic dependent whose main loop releases after the loop (``True``)."""
PDL_RELEASE_AFTER_WAIT = 2
"""``USE_PDL`` of a kernel launched as a programmatic dependent whose main loop releases right after its wait."""

PDL_LOOP_CLASSES: tuple[str, ...] = ("attention", "gemv", "head", "moe", "router")
"""The classes of kernels with a main loop, each with its own release place (``PdlMode.early_release``):
``attention`` the paged decode attention; ``gemv`` the CUDA-core GEMVs (``int8_gemv``, ``norm_add_gemv``, the
streamed linear, a GEMV paired with the router); ``head`` the greedy head's vocabulary slices; ``moe`` the routed
experts' launches (the MoE decode GEMVs, the grouped GEMMs, the one-launch experts, the experts' gate/up paired
with a dense GEMV); ``router`` the router GEMV with the routing in its epilogue."""
_LOOP_CLASS_SET = frozenset(PDL_LOOP_CLASSES)


@dataclasses.dataclass(frozen=True)
class PdlMode:
    """How the Triton kernels launched inside ``pdl_mode(...)`` take part in PDL."""

    requested: bool = False
    """Ask for PDL (``CudaRunnerOptions.pdl``); it takes effect only where ``pdl_supported()``."""
    early_release: frozenset[str] = frozenset()
    """The classes of kernels with a main loop (``PDL_LOOP_CLASSES``) that release their dependent right after their
    wait when PDL is on; the others release after their loop (``backends.cuda.options.early_release_classes_for``).
    The results are the same bits either way: only when the next launch's CTAs get resident moves."""

    def __post_init__(self) -> None:
        if unknown := set(self.early_release) - _LOOP_CLASS_SET:
            raise ValueError(f"unknown PDL loop classes {sorted(unknown)}; known: {', '.join(PDL_LOOP_CLASSES)}")


PDL_OFF = PdlMode()
_MODE: contextvars.ContextVar[PdlMode] = contextvars.ContextVar("pdl_mode", default=PDL_OFF)


@contextlib.contextmanager
def pdl_mode(mode: PdlMode) -> Iterator[None]:
    """Launch the kernels of the block (in this thread or task) with ``mode``; the previous mode after it."""
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def pdl_requested() -> bool:
    return _MODE.get().requested


def loop_classes(classes: bool | Iterable[str]) -> frozenset[str]:
    """``classes`` as a set of ``PDL_LOOP_CLASSES``: True every class, False none; an unknown name is a
    ValueError."""
    if classes is True or classes is False:
        return _LOOP_CLASS_SET if classes else frozenset()
    chosen = frozenset(classes)
    if unknown := chosen - _LOOP_CLASS_SET:
        raise ValueError(f"unknown PDL loop classes {sorted(unknown)}; known: {', '.join(PDL_LOOP_CLASSES)}")
    return chosen


def early_release_classes() -> frozenset[str]:
    """The loop classes that release right after their wait in the current mode."""
    return _MODE.get().early_release


@functools.cache
def _triton_has_pdl() -> bool:
    """Whether this Triton has the two instructions and the ``launch_pdl`` launch option (3.6 and 3.9 do)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents") and "launch_pdl" in fields


@functools.lru_cache(maxsize=16)
def _device_supports(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_supported() -> bool:
    """Compiled kernels (no ``TRITON_INTERPRET``), a CUDA device of sm_90 or newer as the current device, and a
    Triton that can launch with PDL."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available():
        return False
    return _device_supports(torch.cuda.current_device()) and _triton_has_pdl()


def pdl_enabled() -> bool:
    """Whether kernels launched now take part in PDL: requested by the current mode and supported (off, one context
    variable read: the eager launches of a step pay nothing for the switch)."""
    return _MODE.get().requested and pdl_supported()


def pdl_launch(loop: str | None = None) -> dict[str, bool | int]:
    """Keyword arguments for a kernel launch: ``{"USE_PDL": True, "launch_pdl": True}`` when PDL is on, else
    ``{"USE_PDL": False}`` (no launch option at all: the launch is the one it was before PDL existed). ``loop``: the
    launched kernel's class if it has a main loop (``PDL_LOOP_CLASSES``); where the current mode's
    ``early_release`` holds that class, ``USE_PDL`` is ``PDL_RELEASE_AFTER_WAIT``. The kernel must take a
    ``USE_PDL: tl.constexpr`` and keep the module docstring's invariant with ``pdl_wait``."""
    if loop is not None and loop not in _LOOP_CLASS_SET:
        raise ValueError(f"unknown PDL loop class {loop!r}; known: {', '.join(PDL_LOOP_CLASSES)}")
    mode = _MODE.get()
    if mode.requested and pdl_supported():
        return {"USE_PDL": PDL_RELEASE_AFTER_WAIT if loop in mode.early_release else True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """``griddepcontrol.wait`` when ``USE_PDL``: block until the previous kernel of the stream has completed and its
    writes are visible. Call it in every program before the first read of non-weight data and the first write."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """``griddepcontrol.launch_dependents`` when ``USE_PDL``: once every program of this kernel has called it (or
    exited), the next kernel may get resident (it still waits for this one's completion before touching data)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_release_after_wait(USE_PDL: tl.constexpr):
    """A loop kernel's release right after its wait, in the ``PDL_RELEASE_AFTER_WAIT`` mode (else nothing)."""
    if USE_PDL == 2:  # PDL_RELEASE_AFTER_WAIT (a jit function reads no plain globals)
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_release_after_loop(USE_PDL: tl.constexpr):
    """A loop kernel's release after its main loop, in the ``PDL_RELEASE_AFTER_LOOP`` mode (``USE_PDL=True``; else
    nothing)."""
    if USE_PDL == 1:  # PDL_RELEASE_AFTER_LOOP, i.e. True
        tl.extra.cuda.gdc_launch_dependents()
