"""Weight memory of every preset in bf16 and with QUANTIZATION=int8 on a GPU, and the KV capacity (tokens) that
leaves at the default KV_CACHE_MEMORY_FRACTION. No device needed: the models are built on ``meta``.

Weights: the engine's own model classes at the real configs, bf16 vs int8 as ``build_model(..., "int8")`` makes
them on a GPU (linear layers and experts int8 with bf16 per-channel scales; embeddings, lm_head, routers and norms
bf16). KV: the engine's sizing (``backends/factory.build_kv``): ``KV_CACHE_MEMORY_FRACTION`` (0.9) of the memory
free after the weights, split window-aware between the full and sliding pools for 2048-token sequences
(``plan_pool_sizes``); the tokens reported are the full-attention pool's (what one sequence can reach; sliding
layers need only their window). Free memory is assumed to be ``--device-gib`` minus the weights minus
``--reserve-gib`` (CUDA context, activations, graphs: what ``torch.cuda.mem_get_info`` would not report free).

    uv run python bench/int8_memory.py            # H200: 139 GiB, 4 GiB reserved
"""

from __future__ import annotations

import argparse

import torch

from inference_server.config import Settings
from inference_server.core.kv_capacity import KVGeometry, plan_pool_sizes
from inference_server.models.architectures.quantized import weight_bytes
from inference_server.models.loading.loader import build_model
from inference_server.models.loading.presets import PRESETS, preset_config
from inference_server.models.spec import parse_model_spec

GIB = 2 ** 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device-gib", type=float, default=139.0)
    parser.add_argument("--reserve-gib", type=float, default=4.0)
    args = parser.parse_args()
    settings = Settings()
    print(f"device {args.device_gib:g} GiB, {args.reserve_gib:g} GiB reserved, KV fraction "
          f"{settings.kv_cache_memory_fraction}, block {settings.kv_block_size}, bf16 KV")
    print("| model | weights bf16 | weights int8 | saved | KV tokens bf16 weights | KV tokens int8 weights | gain |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in sorted(PRESETS):
        spec = parse_model_spec(preset_config(name))
        geometry = KVGeometry.from_cache_layers(spec.cache_layers, dtype_bytes=2, block_size=settings.kv_block_size)
        row = [name]
        tokens = []
        sizes = {}
        for quantization in ("none", "int8"):
            model = build_model(spec, torch.bfloat16, "meta", quantization)
            sizes[quantization] = weight_bytes(model)
        for quantization in ("none", "int8"):
            free = args.device_gib * GIB - sizes[quantization] - args.reserve_gib * GIB
            budget = int(free * settings.kv_cache_memory_fraction)
            pools = plan_pool_sizes(geometry, budget, settings.kv_expected_sequence_tokens)
            tokens.append(pools.num_full_blocks * settings.kv_block_size)
        row += [f"{sizes['none'] / GIB:.1f} GiB", f"{sizes['int8'] / GIB:.1f} GiB",
                f"{(sizes['none'] - sizes['int8']) / GIB:.1f} GiB", f"{tokens[0]:,}", f"{tokens[1]:,}",
                f"{tokens[1] / tokens[0]:.2f}x"]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
