"""Tiny random checkpoints made with transformers at test time (models.md §5), shared by the parity tests.

Every parameter is perturbed (1-D tensors 1 + 0.3·N(0,1), matrices N(0, 1/fan_in), layer scalars
U(0.5, 1.5)) so that unit norms cannot hide a ``w`` versus ``1 + w`` or a scalar bug.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.loading.loader import build_model, iter_safetensors, load_weights, read_config
from inference_server.models.spec import ModelSpec, parse_model_spec

os.environ.setdefault("HF_HUB_OFFLINE", "1")

S, F = "sliding_attention", "full_attention"
GEMMA4_ROPE = {S: {"rope_type": "default", "rope_theta": 10_000.0},
               F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}

GEMMA4_DENSE_PLE: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, layer_types=[S, S, F, S, S, F], sliding_window=4,
    num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
    use_double_wide_mlp=True, attention_k_eq_v=False, enable_moe_block=False, final_logit_softcapping=30.0,
    rope_parameters=GEMMA4_ROPE, tie_word_embeddings=True, max_position_embeddings=256,
)
GEMMA4_MOE: dict[str, Any] = dict(
    GEMMA4_DENSE_PLE, intermediate_size=48, num_global_key_value_heads=1, layer_types=[S, S, S, S, S, F],
    num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=True, enable_moe_block=True,
    num_experts=8, top_k_experts=2, moe_intermediate_size=24,
)
QWEN3_MOE: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
)
GEMMA3: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
    layer_types=[S, S, S, S, S, F], max_position_embeddings=256, rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0, tie_word_embeddings=True, final_logit_softcapping=None,
    attn_logit_softcapping=None,
)


def perturb_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point() or "inv_freq" in name or "embed_scale" in name:
                continue
            if name.endswith("layer_scalar"):
                tensor.copy_(torch.rand(tensor.shape, generator=gen) + 0.5)
            elif tensor.dim() == 1:
                tensor.copy_(1.0 + 0.3 * torch.randn(tensor.shape, generator=gen))
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * tensor.shape[-1] ** -0.5)


def build_hf(kind: str) -> torch.nn.Module:
    """A perturbed fp32 transformers model of the given fixture kind, eager attention and experts."""
    import transformers

    torch.manual_seed(0)
    if kind.startswith("gemma4"):
        cfg = transformers.Gemma4TextConfig(**(GEMMA4_MOE if kind == "gemma4_moe" else GEMMA4_DENSE_PLE))
        model = transformers.Gemma4ForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**QWEN3_MOE)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(**GEMMA3)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    perturb_(model, seed=1)
    model.config._attn_implementation = "eager"
    if hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"
    return model.eval()


def save_cg_layout(model: torch.nn.Module, folder: Path) -> None:
    """Re-save a Gemma 4 text model with the hub's ``model.language_model.*`` keys and a wrapper config."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        tensors["model.language_model." + name[len("model."):]] = tensor.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    text = model.config.to_dict()
    wrapper = {"model_type": "gemma4", "text_config": text, "tie_word_embeddings": True,
               "architectures": ["Gemma4ForConditionalGeneration"]}
    (folder / "config.json").write_text(json.dumps(wrapper))


def save_qwen_per_expert(model: torch.nn.Module, folder: Path) -> None:
    """Save Qwen3-MoE with hub-style per-expert tensors and the ``num_experts`` config spelling."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :inter].contiguous()
                tensors[f"{prefix}{e}.up_proj.weight"] = tensor[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            tensors[name] = tensor.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["num_experts"] = cfg.pop("num_local_experts", cfg.get("num_experts"))
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="session")
def hf_fixture(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[torch.nn.Module, Path]]:
    """``hf_fixture(kind)`` -> (transformers model, folder of its checkpoint). Kinds: gemma4_dense_ple,
    gemma4_dense_ple_cg (hub key layout), gemma4_moe, qwen3_moe, qwen3_moe_hubformat, gemma3."""
    cache: dict[str, tuple[torch.nn.Module, Path]] = {}

    def make(kind: str) -> tuple[torch.nn.Module, Path]:
        if kind not in cache:
            base = kind.removesuffix("_cg").removesuffix("_hubformat")
            model = build_hf(base)
            folder = tmp_path_factory.mktemp(kind)
            if kind.endswith("_cg"):
                save_cg_layout(model, folder)
            elif kind.endswith("_hubformat"):
                save_qwen_per_expert(model, folder)
            else:
                model.save_pretrained(folder)
            cache[kind] = (model, folder)
        return cache[kind]

    return make


def load_hf_folder(folder: Path, dtype: torch.dtype, device: torch.device | str,
                   quantization: str = "none", int8_embeddings: str = "auto") -> tuple[CausalLM, ModelSpec]:
    """Model and spec from a Hugging Face checkpoint folder (config.json + safetensors, sharded or not), as
    ``models.loading.source`` loads ``MODEL=<folder>``."""
    spec = parse_model_spec(read_config(folder))
    model = build_model(spec, dtype, device, quantization, int8_embeddings)
    load_weights(model, spec, iter_safetensors(folder), str(folder))
    return model, spec
