"""GGUF loader: config and tensors of tiny GGUF files written at test time, checked against transformers."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from inference_server.models.loading import gguf_loader
from inference_server.models.loading.gguf_loader import GGUFLoadError, open_gguf


def load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, state_dict)`` of a GGUF file, every tensor dequantised to ``dtype``."""
    checkpoint = open_gguf(path)
    return checkpoint.config, dict(checkpoint.iter_tensors(dtype))


os.environ.setdefault("HF_HUB_OFFLINE", "1")

Q8_0 = gguf.GGMLQuantizationType.Q8_0
Q5_0 = gguf.GGMLQuantizationType.Q5_0
Q4_K = gguf.GGMLQuantizationType.Q4_K

# Keys transformers' config carries that describe no model property (or are bookkeeping).
_NON_MODEL_KEYS = {
    "transformers_version",
    "_model_name_or_path",
    "_name_or_path",
    "initializer_range",
    "use_cache",
    "attention_dropout",
    "_sliding_window_pattern",
    "router_aux_loss_coef",
    "output_router_logits",
}

# --------------------------------------------------------------------------------------- fixtures


def _tokens(vocab_size: int) -> list[str]:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    return specials + [f"tok{i}" for i in range(vocab_size - len(specials))]


def _add_vocab(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(_tokens(vocab_size))
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types([3, 3, 3, 2] + [1] * (vocab_size - 4))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(3)


def _q4_k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Valid random Q4_K data (gguf cannot quantise to K types): random bytes with sane f16 scales."""
    blocks_per_row = cols // 256
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, 144), dtype=np.uint8)
    scales = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)  # d, dmin
    raw[:, :, :4] = scales
    return raw.reshape(rows, blocks_per_row * 144)


def _add(writer: gguf.GGUFWriter, name: str, values: np.ndarray, qtype: Any = None) -> None:
    if qtype is None:
        writer.add_tensor(name, values.astype(np.float32))
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GEMMA3_DIMS = {"hidden": 64, "ffn": 256, "heads": 2, "kv_heads": 1, "head_dim": 32, "layers": 7, "vocab": 96}


def write_tiny_gemma3(path: Path, *, untied: bool = False, omit: frozenset[str] = frozenset()) -> Path:
    """A 7-layer gemma3 GGUF with F32 norms (stored as 1 + w), Q8_0, Q5_0 and Q4_K weights.

    Tensors named in ``omit`` are left out (to make a broken file).
    """
    d = GEMMA3_DIMS
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_name("tiny gemma3")
    writer.add_context_length(1024)
    writer.add_embedding_length(d["hidden"])
    writer.add_block_count(d["layers"])
    writer.add_feed_forward_length(d["ffn"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_key_length(d["head_dim"])
    writer.add_value_length(d["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(16)
    _add_vocab(writer, d["vocab"])

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return 1.0 + 0.1 * normal(size)

    def add(name: str, values: np.ndarray, qtype: Any = None) -> None:
        if name not in omit:
            _add(writer, name, values, qtype)

    h, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    add("token_embd.weight", normal(d["vocab"], h), Q8_0)
    add("output_norm.weight", norm(h))
    if untied:
        add("output.weight", normal(d["vocab"], h), Q8_0)
    for i in range(d["layers"]):
        blk = f"blk.{i}"
        add(f"{blk}.attn_norm.weight", norm(h))
        add(f"{blk}.attn_q.weight", normal(q, h), Q5_0)
        add(f"{blk}.attn_k.weight", normal(kv, h), Q8_0)
        add(f"{blk}.attn_v.weight", normal(kv, h))
        add(f"{blk}.attn_output.weight", normal(h, q), Q8_0)
        add(f"{blk}.attn_q_norm.weight", norm(d["head_dim"]))
        add(f"{blk}.attn_k_norm.weight", norm(d["head_dim"]))
        add(f"{blk}.post_attention_norm.weight", norm(h))
        add(f"{blk}.ffn_norm.weight", norm(h))
        add(f"{blk}.post_ffw_norm.weight", norm(h))
        add(f"{blk}.ffn_gate.weight", normal(d["ffn"], h), Q8_0)
        add(f"{blk}.ffn_up.weight", normal(d["ffn"], h), Q5_0)
        writer.add_tensor(f"{blk}.ffn_down.weight", _q4_k_blocks(rng, h, d["ffn"]), raw_dtype=Q4_K)
    _finish(writer)
    return path


QWEN_DIMS = {"hidden": 64, "ffn": 96, "moe_ffn": 32, "heads": 4, "kv_heads": 2, "head_dim": 32}
QWEN_DIMS |= {"layers": 2, "experts": 4, "top_k": 2, "vocab": 80}


def write_tiny_qwen3moe(path: Path) -> Path:
    """A 2-layer qwen3moe GGUF with stacked per-projection experts (Q8_0) and an untied head."""
    d = QWEN_DIMS
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_context_length(4096)
    writer.add_embedding_length(d["hidden"])
    writer.add_block_count(d["layers"])
    writer.add_feed_forward_length(d["ffn"])
    writer.add_expert_feed_forward_length(d["moe_ffn"])
    writer.add_expert_count(d["experts"])
    writer.add_expert_used_count(d["top_k"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_key_length(d["head_dim"])
    writer.add_value_length(d["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    _add_vocab(writer, d["vocab"])

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    h, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    e, i_moe = d["experts"], d["moe_ffn"]
    _add(writer, "token_embd.weight", normal(d["vocab"], h), Q8_0)
    _add(writer, "output_norm.weight", normal(h))
    _add(writer, "output.weight", normal(d["vocab"], h), Q8_0)
    for layer in range(d["layers"]):
        blk = f"blk.{layer}"
        _add(writer, f"{blk}.attn_norm.weight", normal(h))
        _add(writer, f"{blk}.attn_q.weight", normal(q, h), Q8_0)
        _add(writer, f"{blk}.attn_k.weight", normal(kv, h), Q8_0)
        _add(writer, f"{blk}.attn_v.weight", normal(kv, h), Q8_0)
        _add(writer, f"{blk}.attn_output.weight", normal(h, q), Q8_0)
        _add(writer, f"{blk}.attn_q_norm.weight", normal(d["head_dim"]))
        _add(writer, f"{blk}.attn_k_norm.weight", normal(d["head_dim"]))
        _add(writer, f"{blk}.ffn_norm.weight", normal(h))
        _add(writer, f"{blk}.ffn_gate_inp.weight", normal(e, h))
        _add(writer, f"{blk}.ffn_gate_exps.weight", normal(e, i_moe, h), Q8_0)
        _add(writer, f"{blk}.ffn_down_exps.weight", normal(e, h, i_moe), Q8_0)
        _add(writer, f"{blk}.ffn_up_exps.weight", normal(e, i_moe, h), Q8_0)
    _finish(writer)
    return path


@pytest.fixture(scope="module")
def gemma3_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf")


@pytest.fixture(scope="module")
def qwen3moe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3moe(tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3moe.gguf")


# ------------------------------------------------------------------------------- transformers side


def transformers_load(path: Path, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What transformers' own GGUF path yields: (config.to_dict(), load_gguf_checkpoint tensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=dtype)
    return config.to_dict(), parsed["tensors"]


def assert_config_matches(ours: dict[str, Any], theirs: dict[str, Any], differing: set[str] = frozenset()) -> None:
    """Every key we emit equals transformers'; every model key transformers has, we emit."""
    for key, value in ours.items():
        if key not in differing:
            assert theirs[key] == value, f"config[{key!r}]: ours {value!r} != transformers {theirs[key]!r}"
    defaults_only = {"id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder", "problem_type"}
    defaults_only |= {"architectures", "dtype", "output_hidden_states", "return_dict", "output_attentions"}
    missing = set(theirs) - set(ours) - _NON_MODEL_KEYS - defaults_only
    assert not missing, f"keys transformers sets that we do not: {sorted(missing)}"


def assert_tensors_equal(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """Same names, shapes and values. transformers leaves fused MoE experts in float32 (the model load
    casts them later), so their side is cast to our dtype first: the same single rounding."""
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor, theirs[name].to(tensor.dtype)), name


# ------------------------------------------------------------------------------------------- gemma3


def test_gemma3_config_from_metadata(gemma3_file: Path) -> None:
    config = open_gguf(gemma3_file).config
    assert config["model_type"] == "gemma3_text"
    assert config["num_hidden_layers"] == 7
    assert config["head_dim"] == 32
    assert config["vocab_size"] == GEMMA3_DIMS["vocab"]
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert config["rope_parameters"]["full_attention"] == {"rope_type": "default", "rope_theta": 1e6}
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)
    assert config["final_logit_softcapping"] is None and config["attn_logit_softcapping"] is None


def test_gemma3_tensors_are_hf_named_and_norms_unshifted(gemma3_file: Path) -> None:
    checkpoint = open_gguf(gemma3_file)
    tensors = dict(checkpoint.iter_tensors(torch.float32))
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == (GEMMA3_DIMS["vocab"], GEMMA3_DIMS["hidden"])
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert tensors["model.layers.6.mlp.down_proj.weight"].shape == (64, 256)
    assert len(tensors) == 2 + 13 * GEMMA3_DIMS["layers"]
    reader = gguf.GGUFReader(gemma3_file)
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    expected_norm = torch.from_numpy(stored["blk.3.post_ffw_norm.weight"] - 1)
    assert torch.equal(tensors["model.layers.3.post_feedforward_layernorm.weight"], expected_norm)
    assert torch.equal(
        tensors["model.layers.3.self_attn.v_proj.weight"], torch.from_numpy(stored["blk.3.attn_v.weight"])
    )


def test_untied_gemma3_yields_lm_head(tmp_path: Path) -> None:
    config, tensors = load_gguf(write_tiny_gemma3(tmp_path / "untied.gguf", untied=True))
    assert config["tie_word_embeddings"] is False
    assert tensors["lm_head.weight"].shape == (GEMMA3_DIMS["vocab"], GEMMA3_DIMS["hidden"])


def test_chunked_dequantisation_changes_nothing(gemma3_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = dict(open_gguf(gemma3_file).iter_tensors(torch.bfloat16))
    monkeypatch.setattr(gguf_loader, "_CHUNK_ELEMENTS", 100)
    chunked = dict(open_gguf(gemma3_file).iter_tensors(torch.bfloat16))
    assert_tensors_equal(chunked, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma3_matches_transformers(gemma3_file: Path, dtype: torch.dtype) -> None:
    their_config, their_tensors = transformers_load(gemma3_file, dtype)
    config, tensors = load_gguf(gemma3_file, dtype)
    assert_config_matches(config, their_config)
    assert {t.dtype for t in tensors.values()} == {t.dtype for t in their_tensors.values()} == {dtype}
    assert_tensors_equal(tensors, their_tensors)


# ----------------------------------------------------------------------------------------- qwen3moe


def test_qwen3moe_experts_are_fused_gate_first(qwen3moe_file: Path) -> None:
    d = QWEN_DIMS
    config, tensors = load_gguf(qwen3moe_file)
    assert config["moe_intermediate_size"] == d["moe_ffn"]
    assert config["num_local_experts"] == d["experts"] and config["tie_word_embeddings"] is False
    gate_up = tensors["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (d["experts"], 2 * d["moe_ffn"], d["hidden"])
    assert tensors["model.layers.1.mlp.experts.down_proj"].shape == (d["experts"], d["hidden"], d["moe_ffn"])
    reader = {t.name: t for t in gguf.GGUFReader(qwen3moe_file).tensors}
    gate = gguf.quants.dequantize(reader["blk.1.ffn_gate_exps.weight"].data, Q8_0)
    up = gguf.quants.dequantize(reader["blk.1.ffn_up_exps.weight"].data, Q8_0)
    assert torch.equal(gate_up, torch.from_numpy(np.concatenate([gate, up], axis=1)))


def test_qwen3moe_matches_transformers(qwen3moe_file: Path) -> None:
    their_config, their_tensors = transformers_load(qwen3moe_file, torch.bfloat16)
    config, tensors = load_gguf(qwen3moe_file, torch.bfloat16)
    # transformers' legacy GGUF reader ignores expert_feed_forward_length (class default 768).
    assert their_config["moe_intermediate_size"] == 768
    assert_config_matches(config, their_config, differing={"moe_intermediate_size"})
    assert_tensors_equal(tensors, their_tensors)


# ------------------------------------------------------------------------------------------- errors


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"
    with pytest.raises(GGUFLoadError, match=r"absent\.gguf") as info:
        open_gguf(missing)
    assert info.value.path == missing


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda blob: b"", id="empty"),
        pytest.param(lambda blob: b"NOPE" + blob[4:], id="bad-magic"),
        pytest.param(lambda blob: blob[: len(blob) // 2], id="truncated"),
        pytest.param(lambda blob: blob[:100], id="truncated-header"),
    ],
)
def test_corrupt_file_raises_load_error(gemma3_file: Path, tmp_path: Path, corrupt: Any) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(corrupt(gemma3_file.read_bytes()))
    with pytest.raises(GGUFLoadError, match=r"broken\.gguf"):
        open_gguf(broken)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    _finish(writer)
    with pytest.raises(GGUFLoadError, match="architecture 'llama' is not supported"):
        open_gguf(path)


def test_missing_tensor_is_reported(tmp_path: Path) -> None:
    path = write_tiny_gemma3(tmp_path / "pruned.gguf", omit=frozenset({"blk.2.attn_k.weight"}))
    with pytest.raises(GGUFLoadError, match=r"pruned\.gguf.*missing.*blk\.2\.attn_k\.weight"):
        open_gguf(path)


# -------------------------------------------------------------------------------- embedded (heavy)


@pytest.mark.heavy
def test_embedded_gemma3_matches_transformers() -> None:
    from inference_server.models.loading.embedded import embedded_gguf_path

    path = embedded_gguf_path()
    started = time.perf_counter()
    checkpoint = open_gguf(path)
    opened = time.perf_counter()
    tensors = dict(checkpoint.iter_tensors(torch.float32))
    loaded = time.perf_counter()
    print(f"\nopen (metadata) {opened - started:.1f} s, dequantise {loaded - opened:.1f} s")
    assert sum(t.numel() for t in tensors.values()) == 268_098_176
    their_config, their_tensors = transformers_load(path, torch.float32)
    print(f"transformers config + tensors {time.perf_counter() - loaded:.1f} s")
    assert_config_matches(checkpoint.config, their_config)
    assert_tensors_equal(tensors, their_tensors)
