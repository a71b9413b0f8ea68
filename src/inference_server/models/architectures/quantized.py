"""int8 weight-only layers and the conversion of a model to them (``QUANTIZATION=int8``).

The format is ``kernels/reference_int8.py``'s: an int8 ``qweight`` of the float weight's shape and one scale per
output channel (``qweight.shape[:-1]``) in the model dtype. What becomes int8:

* every ``nn.Linear`` of the decoders: attention q/k/v/o, dense MLP gate/up/down, Gemma 4's PLE projections
  (``per_layer_input_gate``, ``per_layer_projection``, ``per_layer_model_projection``) -> ``Int8Linear``;
* the MoE experts' fused ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (``FusedExperts.quantize_``);
* with ``embeddings=True`` (the CPU engine): the token embeddings (``Int8Embedding``, which dequantises only the
  gathered rows, and is the tied lm_head) and an untied ``lm_head``.

Routers stay float: ``Gemma4Router.proj`` and Qwen3-MoE's ``mlp.gate`` are tiny ([E, H], 0.1 % of the weights)
and their error would move top-k decisions, which changes which experts run rather than perturbing a value.

Quantized tensors are parameters (``requires_grad=False``) registered where the float weight was, so
``named_parameters`` keeps its order: ``logical_tensors`` maps them back to their float names, which is how the
loader fills a quantized model straight from a float checkpoint (each weight quantized on the device as it is
read, ``QuantizedWeight.copy_``) and how dummy weights come out equal to quantizing the float dummy model.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from inference_server.kernels.reference_int8 import dequantize_int8, quantize_int8_per_channel
from inference_server.models.architectures import ops


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class Int8Linear(nn.Module, ops.OpsUser):
    """A bias-free linear layer with int8 weights: ``ops.int8_linear(x, qweight, scale)`` over the last dim."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or tuple(scale.shape) != tuple(qweight.shape[:1]):
            raise ValueError(f"Int8Linear needs int8 [N, K] and scale [N], got {qweight.dtype} "
                             f"{tuple(qweight.shape)} and {tuple(scale.shape)}")
        self.qweight = _frozen(qweight)  # [N, K] int8
        self.scale = _frozen(scale)  # [N] model dtype

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 version of ``linear`` (quantized on its device; scales in its dtype; works on ``meta``)."""
        if linear.bias is not None:
            raise ValueError("Int8Linear has no bias; the supported models have none")
        return cls(*quantize_int8_per_channel(linear.weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # [T, K] already: no reshape either way
            return self.ops.int8_linear(x, self.qweight, self.scale)
        flat = x.reshape(-1, x.shape[-1])  # [T, K]
        return self.ops.int8_linear(flat, self.qweight, self.scale).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8Embedding(nn.Module, ops.OpsUser):
    """Token embeddings with int8 rows: a lookup dequantises only the gathered rows (in the scale's dtype, the
    value ``dequantize_int8`` gives); ``as_lm_head`` is the tied output projection through ``ops.int8_linear``."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.qweight = _frozen(qweight)  # [V, H] int8
        self.scale = _frozen(scale)  # [V]

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> Int8Embedding:
        return cls(*quantize_int8_per_channel(embedding.weight.detach()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_int8(self.qweight[ids], self.scale[ids], self.scale.dtype)

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        return self.ops.int8_linear(hidden, self.qweight, self.scale)


@attrs.frozen
class QuantizedWeight:
    """Where one float weight (or a row slice of it) lives once quantized: ``qweight`` and its ``scale`` rows.

    ``copy_`` stands in for ``Tensor.copy_`` in the loader: the float value is cast to the model dtype on the
    model's device, then quantized per output row there, so only one float tensor exists at a time. Because the
    scales are per row, quantizing a row slice (one expert's gate rows) gives the rows of the whole."""

    qweight: torch.Tensor  # [..., N, K] int8
    scale: torch.Tensor  # [..., N]

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype the weight had before quantization (the scale's)."""
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def __getitem__(self, index: int | slice | tuple[int | slice, ...]) -> QuantizedWeight:
        """The same rows of qweight and scale (an index over the leading dims, never over K)."""
        return QuantizedWeight(self.qweight[index], self.scale[index])

    def copy_(self, weight: torch.Tensor) -> None:
        q, scale = quantize_int8_per_channel(weight.to(device=self.device, dtype=self.dtype))
        self.qweight.copy_(q)
        self.scale.copy_(scale)


def projection_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, scale)`` of a bias-free projection, for ``Ops.project`` and the ops that take weights: an
    ``Int8Linear``'s int8 values and scales, or a float ``nn.Linear``'s weight and None."""
    if isinstance(module, Int8Linear):
        return module.qweight, module.scale
    if isinstance(module, nn.Linear) and module.bias is None:
        return module.weight, None
    raise TypeError(f"not a bias-free projection: {module!r}")


def quantize_model_int8_(model: nn.Module, *, embeddings: bool = False) -> nn.Module:
    """Convert ``model`` to int8 weights in place, module by module (see the module docstring for what is
    converted); returns it. Each float weight is quantized on its own device and released as soon as its
    int8 replacement is in place, so the peak is the float model plus one layer's int8 copy. On a model built
    on the ``meta`` device nothing is computed: only the structure changes (the loader then fills it).
    Idempotent. Must run before ``fuse_qkv`` / ``fuse_gate_up`` (fusing after quantizing fuses the int8
    weights and scales).

    Modules opt in or out by attribute (no import of the model files, which import this one): a module with
    ``keeps_float_weights = True`` (the routers) is left alone, one with a ``quantize_()`` method (the MoE
    experts) quantizes its own weights, and ``model.lm_head`` follows ``embeddings``."""
    for parent in list(model.modules()):
        if getattr(parent, "keeps_float_weights", False):
            continue
        quantize_own = getattr(parent, "quantize_", None)
        if callable(quantize_own):
            quantize_own()
            continue
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if parent is model and child_name == "lm_head" and not embeddings:
                    continue
                setattr(parent, child_name, Int8Linear.from_linear(child))
            elif isinstance(child, nn.Embedding) and embeddings:
                setattr(parent, child_name, Int8Embedding.from_embedding(child))
    return model


def is_quantized(model: nn.Module) -> bool:
    """Whether any weight of ``model`` is int8."""
    return any(p.dtype == torch.int8 for p in model.parameters())


def logical_tensors(model: nn.Module) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every parameter and buffer under its float checkpoint name, in ``named_parameters`` order (then
    buffers): an int8 weight appears once, as a ``QuantizedWeight`` under the float weight's name
    (``...q_proj.weight``, ``...experts.gate_up_proj``); its scale does not appear on its own. An int8
    parameter ``X`` of another module (the MoE experts) is paired with that module's ``X_scale``."""
    renamed: dict[str, tuple[str, QuantizedWeight] | None] = {}  # parameter name -> (float name, weight) / skip
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, (Int8Linear, Int8Embedding)):
            renamed[f"{dot}qweight"] = (f"{dot}weight", QuantizedWeight(module.qweight, module.scale))
            renamed[f"{dot}scale"] = None
            continue
        own = dict(module.named_parameters(recurse=False))
        for name, parameter in own.items():
            scale = own.get(f"{name}_scale")
            if parameter.dtype == torch.int8 and scale is not None:
                renamed[f"{dot}{name}"] = (f"{dot}{name}", QuantizedWeight(parameter, scale))
                renamed[f"{dot}{name}_scale"] = None
    named: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name not in renamed:
            named[name] = tensor
            continue
        entry = renamed[name]
        if entry is not None:
            named[entry[0]] = entry[1]
    return named


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter (int8 weights, their scales, float weights) of ``model``."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
