"""What the CUDA runner decides and what its operator sets: the runner options and the decided constants (MoE decode
GEMV bound, dense GEMV bound, PDL release place by hidden size).
"""

from __future__ import annotations

import attrs

from inference_server.kernels.pdl import loop_classes

EARLY_RELEASE_MAX_HIDDEN = 2048
"""The largest hidden size at which the loop kernels of any class release their PDL dependent right after their wait
(``EARLY_RELEASE_NARROW_CLASSES``); above it every class releases after its loop, where the loops are long enough
that an early release only crowds them (docs/benchmarks.md, PDL release place)."""


EARLY_RELEASE_NARROW_CLASSES: tuple[str, ...] = ("attention", "gemv", "head", "moe")
"""The classes (``kernels.pdl.PDL_LOOP_CLASSES``) that release right after their wait at hidden sizes up to
``EARLY_RELEASE_MAX_HIDDEN``: every class but the router GEMV, which releases after its loop. The results are the
same bits either way; only the overlap moves (docs/benchmarks.md, PDL release place)."""


MOE_DECODE_MAX_TOKENS = 2
"""Steps of at most this many tokens run their routed experts as the decode GEMVs (``kernels.moe_decode``: two
launches, no alignment or k-sum launch, each pair streams its expert's rows); larger ones as the grouped GEMMs, which
read an expert shared by several tokens once (faster from 4 tokens: docs/benchmarks.md, MoE decode GEMVs)."""


DENSE_GEMV_MAX_TOKENS = 16
"""The largest step whose float projections may take the Triton GEMV (``kernels.dense_linear``), at the shapes and
step sizes where this GPU's tuning sweep timed it faster than cuBLAS (``bench/dense_linear.py --sweep --write``)."""


def early_release_classes_for(hidden_size: int) -> frozenset[str]:
    """The loop classes that release right after their PDL wait for a model of ``hidden_size``."""
    return loop_classes(EARLY_RELEASE_NARROW_CLASSES if hidden_size <= EARLY_RELEASE_MAX_HIDDEN else False)


@attrs.frozen
class CudaRunnerOptions:
    """What an operator sets on the CUDA runner (``build_cuda_runner``: ``CUDA_GRAPHS``, ``MAX_BATCH_SIZE``,
    ``DETERMINISTIC``), the tests' and benchmarks' ``pdl``, and ``reference_ops``, the before of
    every before/after. ``max_model_len`` bounds the static block tables and fixes the decode kernel's split choice.
    Graphs are captured on a CUDA device; elsewhere (the CPU tests) graph-eligible steps run eagerly on the same
    static buffers."""

    max_model_len: int
    max_batch_size: int = 256
    eager_warmup_tokens: tuple[int, ...] = ()
    """Token counts of the eager steps run once at start-up (``eager_warmup_sizes``), so Triton compiles the
    kernel variants of prefill-carrying steps then rather than mid-serving; a count above ``max_model_len`` runs as
    several sequences (``runner.warmup_sequence_lengths``)."""
    cuda_graphs: bool = True
    pdl: bool = True
    """Programmatic dependent launch of the step's Triton kernels (``kernels.pdl``; sm_90+, compiled kernels only):
    each may get resident while its predecessor drains, and in the decode graphs the launch gaps between them
    shrink. Scoped to this runner's launches (``kernels.pdl.pdl_mode``). Results are bitwise those without it
    (``tests/backends/test_pdl_runner.py``, every model kind)."""
    reference_ops: bool = False
    """The runner before the small-batch kernels (issue 12): the Triton RMSNorm, RoPE, attention, KV store, grouped
    MoE GEMMs and int8 GEMVs, and PyTorch for everything else (routing, residual adds, gated activations, RoPE
    tables, float projections on cuBLAS, separate q/k/v and gate/up weights, the full logits and the sampler), no
    MoE decode GEMVs, no PDL. The "before" of docs/benchmarks.md's before/after tables (engine_bench's ``before``)."""

    deterministic: bool = attrs.field(default=False)
    """``DETERMINISTIC``: the batch-invariant table (``op_table.cuda_ops``' deterministic branch) and the prefill
    attention kernel with position-aligned key tiles for every step. Needs ``reference_ops`` (no fused greedy head:
    the full logits and the sampler; no PDL; fused weights all the same, ``fuse_weights``);
    ``build_cuda_runner`` sets ``reference_ops`` with it."""

    @deterministic.validator
    def _deterministic_needs_reference_ops(self, _attribute: object, value: bool) -> None:
        if value and not self.reference_ops:
            raise ValueError("CudaRunnerOptions(deterministic=True) needs reference_ops=True")

    @property
    def fuse_weights(self) -> bool:
        """Whether the runner fuses q/k/v and gate/up into one weight each and folds Gemma 4's router scale into its
        norm (``Ops.fused_weights``): everywhere but the reference ops, and in the deterministic table too (one
        invariant GEMM instead of three and two)."""
        return not self.reference_ops or self.deterministic

    @property
    def kernels(self) -> bool:
        """Whether the runner's table has its Triton kernels beyond the reference set (``op_table.cuda_ops``):
        anywhere but ``reference_ops``."""
        return not self.reference_ops
