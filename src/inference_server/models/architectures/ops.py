"""Swappable compute ops used by model code: the PyTorch reference by default, Triton on CUDA.

Model files call ``ops.fused_moe`` and (through ``layers.RMSNorm``) the installed RMSNorm; a backend installs
faster implementations with ``use_ops`` at start-up (the CUDA backend installs the Triton kernels). Keeping
the switch here means model code reads the same on every device. The choice is process-wide: a test that
runs a reference runner beside a CUDA runner wraps the reference steps in ``reference_ops()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from inference_server.models.architectures import layers
from inference_server.models.architectures.layers import NormFn
from inference_server.models.architectures.layers import activation as activation_fn

MoEFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor]


def torch_fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
    act: str,
) -> torch.Tensor:  # [T, H]
    """Routed experts in transformers' eager order: expert by expert, weighted in the weights' dtype,
    accumulated in the activation dtype with ``index_add_``. Only experts that received tokens are read."""
    act_fn = activation_fn(act)
    out = torch.zeros_like(hidden)
    flat_ids = topk_ids.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        token_idx, k_pos = torch.where(topk_ids == expert)
        gate, up = torch.nn.functional.linear(hidden[token_idx], w_gate_up[expert]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(act_fn(gate) * up, w_down[expert])  # [n, H]
        y = y * topk_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


fused_moe: MoEFn = torch_fused_moe


def use_ops(*, moe: MoEFn | None = None, norm: NormFn | None = None, rope: layers.RopeFn | None = None) -> None:
    """Install faster implementations (process-wide; a backend calls it at start-up)."""
    global fused_moe
    if moe is not None:
        fused_moe = moe
    if norm is not None:
        layers.set_norm_impl(norm)
    if rope is not None:
        layers.set_rope_impl(rope)


@contextlib.contextmanager
def reference_ops() -> Iterator[None]:
    """Run the block with the PyTorch reference ops, then restore whatever was installed before."""
    global fused_moe
    previous_moe = fused_moe
    previous_norm = layers.set_norm_impl(layers.rms_norm)
    previous_rope = layers.set_rope_impl(layers.reference_rope_qk)
    fused_moe = torch_fused_moe
    try:
        yield
    finally:
        fused_moe = previous_moe
        layers.set_norm_impl(previous_norm)
        layers.set_rope_impl(previous_rope)
