"""The attention side of the CUDA runner's ops: q/k norms + RoPE (+ value norm) in one launch, that launch writing the
paged KV, and the decode attention norming and rotating a raw q.
"""

from __future__ import annotations

import attrs
import torch

from inference_server.backends.cuda.norm_ops import TRITON_NORM_MODE
from inference_server.kernels.decode_attention import QueryNormRope, paged_decode_attention
from inference_server.kernels.qk_norm_rope import PagedKVWrite, qk_norm_rope
from inference_server.kernels.rmsnorm import NormMode
from inference_server.models.architectures.ops import RMSNorm


def _qk_norm_rope_kernel_mode(q_raw: torch.Tensor, k_raw: torch.Tensor | None, v_in: torch.Tensor | None,
                              q_norm: RMSNorm, k_norm: RMSNorm | None,
                              v_norm: RMSNorm | None) -> NormMode | None:
    """The ``kernels.qk_norm_rope`` norm mode for these inputs, or None where the kernel does not apply: the gemma3
    norm style, norms that differ in eps or style, a weighted value norm, weights of another dtype, strided last
    dims, an odd head_dim."""
    mode = TRITON_NORM_MODE.get(q_norm.style)
    norms = [n for n in (q_norm, k_norm, v_norm) if n is not None]
    weights = [q_norm.weight] + ([k_norm.weight] if k_raw is not None and k_norm is not None else [])
    if (mode is None or q_norm.weight is None or any(n.style != q_norm.style or n.eps != q_norm.eps for n in norms)
            or (k_raw is not None and k_norm is None) or (v_norm is not None and v_norm.weight is not None)
            or any(w is None or w.dtype != q_raw.dtype for w in weights) or q_raw.shape[-1] % 2
            or any(t is not None and t.stride(-1) != 1 for t in (q_raw, k_raw, v_in))):
        return None
    return mode


def triton_qk_norm_rope(q_raw: torch.Tensor, k_raw: torch.Tensor | None, v_raw: torch.Tensor | None,
                        q_norm: RMSNorm, k_norm: RMSNorm | None, v_norm: RMSNorm | None,
                        cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                       torch.Tensor | None] | None:
    """``Ops.qk_norm_rope`` in one Triton launch (``kernels.qk_norm_rope``): q/k norms, RoPE and the value norm;
    None (the table's norm and RoPE) where the kernel does not apply (``_qk_norm_rope_kernel_mode``)."""
    v_in = (v_raw if v_raw is not None else k_raw) if v_norm is not None else None
    mode = _qk_norm_rope_kernel_mode(q_raw, k_raw, v_in, q_norm, k_norm, v_norm)
    if mode is None:
        return None
    assert q_norm.weight is not None  # checked by the mode
    q, k, v = qk_norm_rope(q_raw, k_raw, v_in, q_norm.weight, k_norm.weight if k_norm is not None else None,
                           q_norm.eps, mode, cos, sin)
    if v_norm is None and k_raw is not None:
        v = v_raw if v_raw is not None else k_raw
    return q, k, v


def triton_qk_norm_rope_store(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor | None,
                              q_norm: RMSNorm, k_norm: RMSNorm, v_norm: RMSNorm | None,
                              cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                   torch.Tensor | None] | None:
    """``paged_kv.NormRopeStoreFn``: ``triton_qk_norm_rope`` whose launch also writes k and v into the paged caches,
    bit for bit what ``store_kv`` writes (``kernels.qk_norm_rope.PagedKVWrite``), so the KV store's own launch
    goes; None (nothing written) where the kernel does not apply or the caches are not ``store_kv``'s layout."""
    value = v_raw if v_raw is not None else k_raw  # what the layer stores as its value, before any value norm
    v_in = value if v_norm is not None else None
    mode = _qk_norm_rope_kernel_mode(q_raw, k_raw, v_in, q_norm, k_norm, v_norm)
    if (mode is None or value.stride(-1) != 1 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape
            or k_cache.dtype != v_cache.dtype or tuple(k_cache.shape[2:]) != tuple(k_raw.shape[1:])
            or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        return None
    write = PagedKVWrite(k_cache, v_cache, slot_mapping, value=None if v_norm is not None else value)
    assert q_norm.weight is not None and k_norm.weight is not None  # checked by the mode
    q, k, v = qk_norm_rope(q_raw, k_raw, v_in, q_norm.weight, k_norm.weight, q_norm.eps, mode, cos, sin, cache=write)
    return q, k, v if v_norm is not None else value


@attrs.frozen
class TritonNormRopeDecode:
    """``paged_kv.NormRopeDecodeFn``: the Triton decode attention that norms and rotates a raw q in its own launch
    (``decode_attention.QueryNormRope``), at the runner's ``max_context_len`` (its split choice, as the plain
    decode's), where ``kernels.qk_norm_rope`` would take q: the gemma4 or qwen norm style with a weight of q's
    dtype, an even head_dim, contiguous rows, RoPE tables of one layout with a row per sequence."""

    max_context_len: int

    def accepts(self, q_raw: torch.Tensor, q_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        return (q_raw.dim() == 3 and _qk_norm_rope_kernel_mode(q_raw, None, None, q_norm, None, None) is not None
                and cos.shape == (q_raw.shape[0], q_raw.shape[2]) and sin.shape == cos.shape
                and cos.stride() == sin.stride() and cos.stride(-1) == 1 and cos.dtype == q_raw.dtype)

    def __call__(self, q_raw: torch.Tensor, q_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        assert q_norm.weight is not None  # accepts() checked it
        norm = QueryNormRope(q_norm.weight, q_norm.eps, q_norm.style == "gemma4", cos, sin)
        return paged_decode_attention(q_raw, k_cache, v_cache, block_tables, context_lens, scale, window,
                                      max_context_len=self.max_context_len, q_norm_rope=norm)
