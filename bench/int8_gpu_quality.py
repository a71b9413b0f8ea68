"""Logits error of QUANTIZATION=int8 at the released configs cut to a few layers (GPU; CPU works, slowly).

For each preset: the model at its real widths with ``--layers`` decoder layers (the first ones of its layer
pattern), dummy bf16 weights (``init_dummy_weights``, N(0, 1/fan_in)), then an int8 copy made with
``quantize_model_int8_``: ``--heads bf16`` (the default) keeps the embeddings and lm_head bf16, as the engine does on
GPUs by default; ``--heads int8`` quantizes them too (``INT8_EMBEDDINGS=on``); ``--heads bf16 int8`` measures both
and the head's own share (the int8-head model against the bf16-head one). One prefill of
``--tokens`` random token ids through the reference contiguous KV cache, then the logits of every position:
float vs int8, with the reference ops (``int8_linear_reference``, the PyTorch MoE reference) and, if given, with
the installed kernels (``--int8-op`` / ``--moe-op``: ``module:function`` installed through ``ops.use_ops``).

Prints per preset, head and op set: relative error ``|int8 - bf16| / |bf16|`` (Frobenius), max abs error, top-1
agreement over the positions, and the weight bytes of the cut model (bf16 vs int8). With an int8 head and the
kernels given, also the fused int8 greedy head (``kernels.greedy_head`` with the head's scales: the CUDA runner's
all-greedy path) on every position's final hidden row: how many of its tokens equal the argmax of the kernels'
unfused logits (``ops.int8_linear`` + the soft-cap), and how many of the rest are top-2 near-ties (within one
bf16 ulp), the only place the two may differ. Random weights have no
outlier channels, so this measures the format and the kernels' fidelity, not a trained model's sensitivity
(docs/quantization.md has the embedded model's real-weight figures).

    python bench/int8_gpu_quality.py                                   # 4 presets x 4 layers, ~1 min on an H200
    python bench/int8_gpu_quality.py --int8-op inference_server.kernels.int8_linear:int8_linear \\
        --moe-op inference_server.backends.cuda.moe_ops:triton_fused_moe
    python bench/int8_gpu_quality.py --heads bf16 int8 --int8-op inference_server.kernels.int8_linear:int8_linear \\
        --moe-op inference_server.backends.cuda.moe_ops:triton_fused_moe   # the int8 head's share, ~2 min
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


def final_hidden(model: CausalLM, spec: ModelSpec, ids: torch.Tensor) -> torch.Tensor:
    """The final hidden rows ``[T, H]`` of one prefill of ``ids``."""
    cache = ContiguousKVCache(spec)
    with torch.inference_mode():
        return model(ids, cache.context(ForwardBatch((0,), (0,), (ids.shape[0],)), ids.device))


def logits(model: CausalLM, spec: ModelSpec, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(final_hidden(model, spec, ids)).float()


def fused_greedy_agreement(model: CausalLM, spec: ModelSpec, ids: torch.Tensor) -> str:
    """The fused int8 greedy head's tokens against the argmax of the installed ops' logits, over every position."""
    from inference_server.kernels.greedy_head import greedy_head

    head = model.int8_head()
    assert head is not None
    with torch.inference_mode():
        hidden = final_hidden(model, spec, ids)
        unfused = model.compute_logits(hidden).float()
        tokens, _ = greedy_head(hidden.contiguous(), head[0], spec.final_logit_softcapping, scale=head[1])
    top2 = unfused.topk(2, dim=-1).values
    ulp = torch.exp2(torch.floor(torch.log2(top2[:, 0].abs().clamp(min=2.0**-126))) - 7)  # one bf16 ulp
    differ = tokens != unfused.argmax(-1)
    near_tie = (top2[:, 0] - top2[:, 1]) <= ulp
    return (f"{int((~differ).sum())}/{len(tokens)} tokens equal; of the {int(differ.sum())} others "
            f"{int((differ & near_tie).sum())} are top-2 near-ties")


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
    parser.add_argument("--heads", nargs="+", default=["bf16"], choices=["bf16", "int8"],
                        help="bf16: embeddings and lm_head stay bf16 (the GPU default); int8: quantized too "
                             "(INT8_EMBEDDINGS=on); both: also the int8 head's own share of the error")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    kernels: dict[str, Any] = {}
    if args.int8_op:
        kernels["int8_linear"] = load_op(args.int8_op)
    if args.moe_op:
        kernels["moe"] = load_op(args.moe_op)
    print(f"device {device}, {dtype}, {args.layers} layers, {args.tokens}-token prefill, embeddings/lm_head "
          f"{' and '.join(args.heads)}; kernels: "
          f"{', '.join(f'{k}={v.__module__}.{v.__name__}' for k, v in kernels.items()) or 'reference only'}")
    for name in args.presets:
        started = time.perf_counter()
        spec = parse_model_spec(cut_config(name, args.layers))
        model = build_model(spec, dtype, device)
        init_dummy_weights(model, seed=0)
        ids = torch.randint(3, spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        with ops.reference_ops():
            reference = logits(model, spec, ids)
        print(f"{name} ({args.layers} layers): weights bf16 {weight_bytes(model) / 2**30:.2f} GiB")
        by_head: dict[str, torch.Tensor] = {}
        for head in args.heads:
            int8 = quantize_model_int8_(copy.deepcopy(model), embeddings=head == "int8")
            with ops.reference_ops():
                int8_reference = logits(int8, spec, ids)
            by_head[head] = int8_reference
            print(f"  head {head}: int8 weights {weight_bytes(int8) / 2**30:.2f} GiB")
            print(f"  head {head}: int8, reference ops : {compare(reference, int8_reference)}")
            if kernels:
                with ops.reference_ops():
                    ops.use_ops(**kernels)
                    int8_kernels = logits(int8, spec, ids)
                    if head == "int8":
                        greedy = fused_greedy_agreement(int8, spec, ids)
                print(f"  head {head}: int8, kernels       : {compare(reference, int8_kernels)}")
                print(f"  head {head}: kernels vs int8 reference: {compare(int8_reference, int8_kernels)}")
                if head == "int8":
                    print(f"  head int8: fused greedy head vs the kernels' logits: {greedy}")
            del int8
        if len(by_head) == 2:
            print(f"  the int8 head's share, head int8 vs head bf16 (reference ops): "
                  f"{compare(by_head['bf16'], by_head['int8'])}")
        print(f"  ({time.perf_counter() - started:.1f} s)")
        del model, by_head
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
