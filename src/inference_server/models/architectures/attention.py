"""The contract between model code and KV storage.

A forward step runs over a *flat packed batch*: the new tokens of every sequence concatenated, ``T`` in all.
Sequence ``b`` contributes ``query_lens[b]`` tokens at absolute positions
``cached_lens[b] .. cached_lens[b] + query_lens[b] - 1``; a prefill chunk and a single-token decode are the
same thing with different lengths. Model code never sees how K/V are stored: each attention layer asks the
context for its normed and rotated q, k, v (``AttentionContext.qk_norm_rope``), then calls
``AttentionContext.attend``, which stores the layer's new K/V (unless the layer reuses another layer's cache, or
the context already stored them while computing them) and returns the attention output. The paged cache of the
step runner implements it (the tests' contiguous cache, ``tests/models/contiguous_kv.py``, too).
"""

from __future__ import annotations

from typing import Protocol

import torch

from inference_server.models.architectures.ops import Ops, RMSNorm
from inference_server.models.spec import LayerSpec


class AttentionContext(Protocol):
    """What a model's attention layers call during one forward step."""

    positions: torch.Tensor  # [T] absolute positions

    def qk_norm_rope(
        self,
        ops: Ops,  # the calling layer's table
        layer: LayerSpec,
        q_raw: torch.Tensor,  # [T, nH, D]
        k_raw: torch.Tensor | None,  # [T, nKV, D]; None on a layer that reuses another layer's KV
        v_raw: torch.Tensor | None,  # [T, nKV, D]; None under K = V
        q_norm: RMSNorm,
        k_norm: RMSNorm | None,
        v_norm: RMSNorm | None,
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # q, k, v for ``attend``
        """``ops.qk_norm_rope``'s values for ``layer``. A context may also write k and v into its cache in the same
        pass (one kernel instead of two); its ``attend`` of the returned k and v then does not write them again. For
        a layer without K/V it may return q raw, when its ``attend`` of that q norms and rotates it (in the attention
        kernel: one kernel instead of two); model code hands the returned q to ``attend`` and reads it nowhere else."""
        ...

    def attend(
        self,
        layer: LayerSpec,
        q: torch.Tensor,  # [T, nH, D]
        k: torch.Tensor | None,  # [T, nKV, D], None when the layer reuses another layer's cache
        v: torch.Tensor | None,
        scale: float,
        logit_softcap: float | None,
    ) -> torch.Tensor:  # [T, nH, D]
        ...
