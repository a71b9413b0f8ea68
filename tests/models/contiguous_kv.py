"""A contiguous per-sequence KV cache for running a model without the engine (the tests' and ``bench/int8_quality.py``'s
forwards): ``ForwardBatch`` says which tokens a step computes, ``ContiguousKVCache(spec).context(batch, device)`` is
the ``AttentionContext`` (``models/architectures/attention.py``) the model's attention layers call. Attention is
``dense_attention``, transformers' eager op order, so fp32 runs are bitwise comparable with it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import attrs
import torch

from inference_server.models.architectures.ops import Ops, RMSNorm
from inference_server.models.spec import LayerSpec, ModelSpec


@attrs.frozen
class ForwardBatch:
    """Which tokens a step computes. All tuples have one entry per sequence, in packing order."""

    seq_ids: tuple[Hashable, ...]
    cached_lens: tuple[int, ...]  # tokens of each sequence already in the KV cache
    query_lens: tuple[int, ...]  # new tokens of each sequence in this step

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute positions [T] of the packed tokens."""
        ranges = [torch.arange(c, c + q) for c, q in zip(self.cached_lens, self.query_lens, strict=True)]
        return torch.cat(ranges).to(device) if ranges else torch.empty(0, dtype=torch.long, device=device)


def dense_attention(
    q: torch.Tensor,  # [S, nH, D]
    k: torch.Tensor,  # [C, nKV, D]
    v: torch.Tensor,  # [C, nKV, D]
    q_positions: torch.Tensor,  # [S]
    kv_positions: torch.Tensor,  # [C]
    window: int | None,
    scale: float,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [S, nH, D]
    """One sequence's causal (optionally sliding-window) attention, in transformers' eager op order.

    A key is visible when ``kv_pos <= q_pos`` and, with a window W, ``q_pos - kv_pos < W``. Scores are
    computed in the input dtype, softmax in fp32 and cast back, exactly as HF eager does, so fp32 runs are
    bitwise comparable.
    """
    num_heads, num_kv = q.shape[1], k.shape[1]
    groups = num_heads // num_kv
    qh = q.transpose(0, 1)  # [nH, S, D]
    kh = k.transpose(0, 1).repeat_interleave(groups, dim=0)  # [nH, C, D]
    vh = v.transpose(0, 1).repeat_interleave(groups, dim=0)  # [nH, C, D]
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [nH, S, C]
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    delta = q_positions[:, None] - kv_positions[None, :]  # [S, C]
    visible = delta >= 0
    if window is not None:
        visible &= delta < window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)  # [S, nH, D]


class ContiguousKVCache:
    """A simple per-sequence cache: for each sequence and cache layer, K and V tensors [L, nKV, D].

    It is the reference storage of the foundation: correct for any mix of prefill and decode, with no
    memory management. Sequences are created on first use and dropped with ``free``.
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._keys: dict[Hashable, list[torch.Tensor | None]] = {}
        self._values: dict[Hashable, list[torch.Tensor | None]] = {}

    def cached_len(self, seq_id: Hashable) -> int:
        keys = self._keys.get(seq_id)
        if not keys or keys[0] is None:
            return 0
        return keys[0].shape[0]

    def free(self, seq_id: Hashable) -> None:
        self._keys.pop(seq_id, None)
        self._values.pop(seq_id, None)

    def context(self, batch: ForwardBatch, device: torch.device | str) -> _ContiguousContext:
        for seq_id, cached in zip(batch.seq_ids, batch.cached_lens, strict=True):
            if self.cached_len(seq_id) != cached:
                raise ValueError(f"sequence {seq_id!r} has {self.cached_len(seq_id)} cached tokens, not {cached}")
            self._keys.setdefault(seq_id, [None] * len(self.spec.cache_layers))
            self._values.setdefault(seq_id, [None] * len(self.spec.cache_layers))
        return _ContiguousContext(self, batch, batch.positions(device))


class _ContiguousContext:
    def __init__(self, cache: ContiguousKVCache, batch: ForwardBatch, positions: torch.Tensor) -> None:
        self.cache = cache
        self.batch = batch
        self.positions = positions
        starts = [0]
        for q in batch.query_lens:
            starts.append(starts[-1] + q)
        self._starts: Sequence[int] = starts

    def qk_norm_rope(self, ops: Ops, layer: LayerSpec, q_raw: torch.Tensor, k_raw: torch.Tensor | None,
                     v_raw: torch.Tensor | None, q_norm: RMSNorm, k_norm: RMSNorm | None, v_norm: RMSNorm | None,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                    torch.Tensor | None]:
        return ops.qk_norm_rope(q_raw, k_raw, v_raw, q_norm, k_norm, v_norm, cos, sin)

    def attend(
        self,
        layer: LayerSpec,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
        logit_softcap: float | None,
    ) -> torch.Tensor:
        outputs = []
        for b, seq_id in enumerate(self.batch.seq_ids):
            lo, hi = self._starts[b], self._starts[b + 1]
            keys, values = self.cache._keys[seq_id], self.cache._values[seq_id]
            if k is not None and v is not None:
                slot, old_k, old_v = layer.kv_slot, keys[layer.kv_slot], values[layer.kv_slot]
                keys[slot] = k[lo:hi] if old_k is None else torch.cat((old_k, k[lo:hi]))
                values[slot] = v[lo:hi] if old_v is None else torch.cat((old_v, v[lo:hi]))
            seq_k, seq_v = keys[layer.kv_slot], values[layer.kv_slot]
            if seq_k is None or seq_v is None:
                raise RuntimeError(f"KV slot {layer.kv_slot} is read before any layer wrote it")
            kv_positions = torch.arange(seq_k.shape[0], device=q.device)
            outputs.append(dense_attention(q[lo:hi], seq_k, seq_v, self.positions[lo:hi], kv_positions,
                                           layer.window, scale, logit_softcap))
        return torch.cat(outputs)
