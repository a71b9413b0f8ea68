"""QUANTIZATION=int8 through the settings and the engine factory: the engine loads an int8 model, gives it the CPU
int8 matmul (its ops table) and serves requests end to end (a tiny preset in CI; the embedded model under
``-m heavy``)."""

from __future__ import annotations

import pytest
import torch
from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch

from inference_server.config import SettingsError, load_settings
from inference_server.kernels.cpu_int8 import cpu_int8_linear
from inference_server.models.architectures.quantized import Int8Embedding, Int8Linear, is_quantized
from inference_server.offline import LLM
from inference_server.records.sampling_params import SamplingParams
from inference_server.runtime import resolve_backend, resolve_quantization

PROMPT = (2, 17, 40, 99, 5, 311)


def _greedy(model, spec, prompt: tuple[int, ...], steps: int) -> list[int]:
    cache, out = ContiguousKVCache(spec), []
    with torch.no_grad():
        hidden = model(torch.tensor(prompt), cache.context(ForwardBatch((0,), (0,), (len(prompt),)), "cpu"))
        for step in range(steps):
            out.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
            batch = ForwardBatch((0,), (len(prompt) + step,), (1,))
            hidden = model(torch.tensor(out[-1:]), cache.context(batch, "cpu"))
    return out


def test_int8_setting_serves_a_tiny_model_end_to_end() -> None:
    settings = load_settings(environ={"MODEL": "gemma-4-e2b-tiny", "DUMMY_WEIGHTS": "true", "DEVICE": "cpu",
                                      "QUANTIZATION": "int8", "KV_CACHE_TOKENS": "512"}, dotenv_path=None)
    llm = LLM(settings)
    model, spec = llm.built.loaded.model, llm.built.loaded.spec
    assert is_quantized(model) and isinstance(model.model.embed_tokens, Int8Embedding)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int8Linear)
    assert model.ops.int8_linear is cpu_int8_linear and model.model.layers[0].self_attn.q_proj.ops is model.ops
    [completion] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert completion.error is None and completion.finish_reason == "length" and len(completion.token_ids) == 8
    # the paged engine's tokens are the int8 model's own greedy tokens through the contiguous reference cache
    assert list(completion.token_ids) == _greedy(model, spec, PROMPT, 8)


def test_int8_is_refused_with_the_hf_backend() -> None:
    settings = load_settings(environ={"QUANTIZATION": "int8", "BACKEND": "hf", "DEVICE": "cpu"}, dotenv_path=None)
    with pytest.raises(SettingsError, match="QUANTIZATION='int8' is invalid with BACKEND='hf'"):
        resolve_backend(settings, torch.device("cpu"))
    for value in ("on", "off"):  # with or without int8 embeddings
        settings = load_settings(environ={"QUANTIZATION": "int8", "INT8_EMBEDDINGS": value, "BACKEND": "hf",
                                          "DEVICE": "cpu"}, dotenv_path=None)
        with pytest.raises(SettingsError, match="QUANTIZATION='int8' is invalid with BACKEND='hf'"):
            resolve_backend(settings, torch.device("cpu"))


@pytest.mark.parametrize("value", ["auto", "on", "off", " on "])
def test_int8_embeddings_setting_parses(value: str) -> None:
    settings = load_settings(environ={"QUANTIZATION": "int8", "INT8_EMBEDDINGS": value}, dotenv_path=None)
    assert settings.int8_embeddings == value.strip()
    assert load_settings(environ={}, dotenv_path=None).int8_embeddings == "auto"


def test_int8_embeddings_on_needs_int8_quantization() -> None:
    settings = load_settings(environ={"INT8_EMBEDDINGS": "on", "QUANTIZATION": "none", "DEVICE": "cpu"},
                             dotenv_path=None)
    with pytest.raises(SettingsError, match="INT8_EMBEDDINGS='on' is invalid with QUANTIZATION='none'"):
        resolve_backend(settings, torch.device("cpu"))
    off = load_settings(environ={"INT8_EMBEDDINGS": "off", "QUANTIZATION": "none", "DEVICE": "cpu"},
                        dotenv_path=None)
    assert resolve_backend(off, torch.device("cpu")) == "reference"
    # the default (auto) is int8 on the CPU, so INT8_EMBEDDINGS=on goes with it there, and not on a GPU
    on = load_settings(environ={"INT8_EMBEDDINGS": "on"}, dotenv_path=None)
    assert resolve_backend(on, torch.device("cpu")) == "reference"
    with pytest.raises(SettingsError, match="INT8_EMBEDDINGS='on' is invalid with QUANTIZATION='auto'"):
        resolve_backend(on, torch.device("cuda"))


def test_default_quantization_is_int8_on_the_cpu_and_none_elsewhere() -> None:
    """QUANTIZATION=auto (the default) as docs/quantization.md states: int8 on the CPU with the engine's model
    classes, none on GPUs and with the hf backend; explicit values are kept."""
    default = load_settings(environ={}, dotenv_path=None)
    assert default.quantization == "auto"
    assert resolve_quantization(default, torch.device("cpu")) == "int8"
    assert resolve_quantization(default, torch.device("cuda"), "custom-cuda") == "none"
    assert resolve_quantization(default, torch.device("mps")) == "none"
    assert resolve_quantization(default, torch.device("cpu"), "hf") == "none"
    hf = load_settings(environ={"BACKEND": "hf", "DEVICE": "cpu"}, dotenv_path=None)
    assert resolve_backend(hf, torch.device("cpu")) == "hf"  # auto is no int8 request: the baseline starts
    for value in ("none", "int8"):
        explicit = load_settings(environ={"QUANTIZATION": value}, dotenv_path=None)
        assert resolve_quantization(explicit, torch.device("cpu")) == value
        assert resolve_quantization(explicit, torch.device("cuda"), "custom-cuda") == value


def test_int8_embeddings_off_keeps_the_cpu_head_float() -> None:
    """``INT8_EMBEDDINGS=off`` on the CPU: every linear layer int8, the tied embedding / lm_head fp32; the engine
    serves it (its greedy tokens are the model's own)."""
    settings = load_settings(environ={"MODEL": "gemma-4-e2b-tiny", "DUMMY_WEIGHTS": "true", "DEVICE": "cpu",
                                      "QUANTIZATION": "int8", "INT8_EMBEDDINGS": "off", "KV_CACHE_TOKENS": "512"},
                             dotenv_path=None)
    llm = LLM(settings)
    model, spec = llm.built.loaded.model, llm.built.loaded.spec
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding) and model.head_weight() is not None
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int8Linear)
    [completion] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert list(completion.token_ids) == _greedy(model, spec, PROMPT, 4)


@pytest.mark.heavy
def test_int8_embedded_model_starts_like_the_fp32_model() -> None:
    """The embedded model with QUANTIZATION=int8 (layers, embedding and lm_head int8; the CPU matmul) continues a
    prompt with the fp32 model's first greedy tokens (measured: the first five agree; docs/quantization.md)."""
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outputs = {}
    for quantization in ("none", "int8"):
        llm = LLM(load_settings(environ={"DEVICE": "cpu", "QUANTIZATION": quantization}, dotenv_path=None))
        assert is_quantized(llm.built.loaded.model) == (quantization == "int8")
        [completion] = llm.generate(["The capital of France is"], params)
        outputs[quantization] = completion.token_ids
    assert outputs["int8"] == outputs["none"]
