"""PyTorch reference of the greedy head (``kernels.greedy_head``): the logits, then the sampler's greedy choice.

It is what the runner computes when it does not take the fused path: ``CausalLM.compute_logits`` (the head's
GEMM in the activation dtype, then Gemma's final soft-cap ``tanh(x / cap) * cap`` in that dtype, as
``layers.softcap`` writes it; an int8 head's GEMM is ``ops.int8_linear``'s contract,
``reference_int8.int8_linear_reference``: fp32 sums times the row scale, rounded once) and ``sampler.sample`` on
an all-greedy batch (``log_softmax`` statistics of the logits in fp32, the first index of the maximum, and the
chosen logit minus the log-sum-exp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_server.kernels.reference_int8 import int8_linear_reference


def logits_reference(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None,
                     scale: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, V]`` logits of hidden rows ``[N, H]`` against the head weight ``[V, H]`` (float, or int8 with its
    per-row ``scale [V]``), in hidden's dtype."""
    logits = F.linear(hidden, weight) if scale is None else int8_linear_reference(hidden, weight, scale)
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


def greedy_head_reference(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None,
                          scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_ids [N] int64, logprobs [N] fp32)``: each row's argmax (ties: the smallest index) and its
    log-probability under the raw distribution, as ``sampler.sample`` returns them for greedy rows. ``scale``:
    the head is int8 (``reference_int8``'s format)."""
    logits = logits_reference(hidden, weight, softcap, scale)
    work = logits.float()
    lse = torch.logsumexp(work, dim=-1)  # [N]
    token_ids = work.argmax(dim=-1)  # [N]
    logprobs = logits.gather(1, token_ids[:, None]).squeeze(1).float() - lse
    return token_ids, logprobs
