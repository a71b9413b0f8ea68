"""PyTorch reference of the greedy head (``kernels.greedy_head``): the logits, then the sampler's greedy choice.

It is what the runner computes when it does not take the fused path: ``CausalLM.compute_logits`` (the head's
GEMM in the weight dtype, then Gemma's final soft-cap ``tanh(x / cap) * cap`` in that dtype, as
``layers.softcap`` writes it) and ``sampler.sample`` on an all-greedy batch (``log_softmax`` statistics of the
logits in fp32, the first index of the maximum, and the chosen logit minus the log-sum-exp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def logits_reference(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``[N, V]`` logits of hidden rows ``[N, H]`` against the head weight ``[V, H]``, in the weight dtype."""
    logits = F.linear(hidden, weight)
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


def greedy_head_reference(hidden: torch.Tensor, weight: torch.Tensor,
                          softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_ids [N] int64, logprobs [N] fp32)``: each row's argmax (ties: the smallest index) and its
    log-probability under the raw distribution, as ``sampler.sample`` returns them for greedy rows."""
    logits = logits_reference(hidden, weight, softcap)
    work = logits.float()
    lse = torch.logsumexp(work, dim=-1)  # [N]
    token_ids = work.argmax(dim=-1)  # [N]
    logprobs = logits.gather(1, token_ids[:, None]).squeeze(1).float() - lse
    return token_ids, logprobs
