"""The float projection layer of the decoders: an ``nn.Linear`` whose forward goes through its table's ``linear``.

Same parameters, names and ``state_dict`` as ``nn.Linear`` (it is one: ``isinstance`` checks, the int8 conversion
and the loaders see no difference); only the matmul is its ops table's, so the CUDA backend can run a decode
step's projections as its Triton GEMV (``kernels.dense_linear``) while the reference keeps ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from inference_server.models.architectures import ops


class Linear(nn.Linear, ops.OpsUser):
    """``nn.Linear`` through ``ops.linear`` (``F.linear`` in the reference table)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)
