"""Logits error of QUANTIZATION=int8 at the released configs cut to a few layers (GPU; CPU works, slowly).

For each preset: the model at its real widths with ``--layers`` decoder layers (the first ones of its layer
pattern), dummy bf16 weights (``init_dummy_weights``, N(0, 1/fan_in)), then an int8 copy made with
``quantize_model_int8_`` (embeddings and lm_head stay bf16, as the engine does on GPUs; ``--embeddings``
quantizes them too, to measure whether the GPU could). One prefill of
``--tokens`` random token ids through the reference contiguous KV cache, then the logits of every position:
float vs int8, with the reference ops (``int8_linear_reference``, the PyTorch MoE reference) and, if given, with
the installed kernels (``--int8-op`` / ``--moe-op``: ``module:function`` installed through ``ops.use_ops``).

Prints per preset and op set: relative error ``|int8 - bf16| / |bf16|`` (Frobenius), max abs error, top-1
agreement over the positions, and the weight bytes of the cut model (bf16 vs int8). Random weights have no
outlier channels, so this measures the format and the kernels' fidelity, not a trained model's sensitivity
(docs/quantization.md has the embedded model's real-weight figures).

    python bench/int8_gpu_quality.py                                   # 4 presets x 4 layers, ~1 min on an H200
    python bench/int8_gpu_quality.py --int8-op inference_server.kernels.int8_linear:int8_linear \\
        --moe-op inference_server.backends.cuda_backend:triton_fused_moe
"""

from __future__ import annotations

import argparse
import copy
import importlib
import time
from collections.abc import Callable
from typing import Any

import torch

from inference_server.models.architectures import ops
from inference_server.models.architectures.attention import ContiguousKVCache, ForwardBatch
from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.architectures.quantized import quantize_model_int8_, weight_bytes
from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import ModelSpec, parse_model_spec

PRESETS = ("gemma-4-31b", "gemma-4-26b-a4b", "qwen3-30b-a3b", "gemma-4-e4b")


def cut_config(name: str, layers: int) -> dict[str, Any]:
    """The preset's config with ``layers`` decoder layers: its first ``layers - 1`` layer types and a full-attention
    layer last (both attention kinds are measured), without KV sharing (the cut has no producer layers to share)."""
    config = dict(preset_config(name), num_hidden_layers=layers)
    if "layer_types" in config:
        types = list(config["layer_types"])
        config["layer_types"] = [*types[:layers - 1], "full_attention"]
    if config.get("num_kv_shared_layers"):
        config["num_kv_shared_layers"] = 0
    return config


def logits(model: CausalLM, spec: ModelSpec, ids: torch.Tensor) -> torch.Tensor:
    cache = ContiguousKVCache(spec)
    with torch.inference_mode():
        hidden = model(ids, cache.context(ForwardBatch((0,), (0,), (ids.shape[0],)), ids.device))
        return model.compute_logits(hidden).float()


def load_op(path: str) -> Callable[..., torch.Tensor]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def compare(reference: torch.Tensor, other: torch.Tensor) -> str:
    relative = float((other - reference).norm() / reference.norm())
    top1 = float((other.argmax(-1) == reference.argmax(-1)).float().mean())
    return f"rel err {relative:.4f}  max abs {float((other - reference).abs().max()):.4f}  top-1 agree {top1:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--int8-op", default="", help="module:function installed as ops.int8_linear")
    parser.add_argument("--moe-op", default="", help="module:function installed as ops.fused_moe")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--embeddings", action="store_true",
                        help="quantize the embeddings and lm_head too (what the CPU engine does; not the GPU default)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    kernels: dict[str, Any] = {}
    if args.int8_op:
        kernels["int8_linear"] = load_op(args.int8_op)
    if args.moe_op:
        kernels["moe"] = load_op(args.moe_op)
    print(f"device {device}, {dtype}, {args.layers} layers, {args.tokens}-token prefill, embeddings/lm_head "
          f"{'int8' if args.embeddings else 'bf16'}; kernels: "
          f"{', '.join(f'{k}={v.__module__}.{v.__name__}' for k, v in kernels.items()) or 'reference only'}")
    for name in args.presets:
        started = time.perf_counter()
        spec = parse_model_spec(cut_config(name, args.layers))
        model = build_model(spec, dtype, device)
        init_dummy_weights(model, seed=0)
        ids = torch.randint(3, spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        int8 = quantize_model_int8_(copy.deepcopy(model), embeddings=args.embeddings)
        with ops.reference_ops():
            reference = logits(model, spec, ids)
            int8_reference = logits(int8, spec, ids)
        print(f"{name} ({args.layers} layers): weights bf16 {weight_bytes(model) / 2**30:.2f} GiB, "
              f"int8 {weight_bytes(int8) / 2**30:.2f} GiB")
        print(f"  int8, reference ops : {compare(reference, int8_reference)}")
        if kernels:
            with ops.reference_ops():
                ops.use_ops(**kernels)
                int8_kernels = logits(int8, spec, ids)
            print(f"  int8, kernels       : {compare(reference, int8_kernels)}")
            print(f"  kernels vs int8 reference: {compare(int8_reference, int8_kernels)}")
        print(f"  ({time.perf_counter() - started:.1f} s)")
        del model, int8
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
