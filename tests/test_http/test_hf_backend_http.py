"""The HTTP routes over an engine built by ``build_engine_parts`` with ``BACKEND=hf``: a tiny random Gemma 3
checkpoint folder (transformers ``save_pretrained``) with the word-level test tokenizer; everything above the
runner (admission, streams, stop handling, the OpenAI shim) is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from http_testkit import write_tokenizer_folder

from inference_server.config import Settings
from inference_server.engine_factory import build_engine_parts
from inference_server.http import create_app
from inference_server.server import supervise_engine
from inference_server.startup import finished_phases
from inference_server.supervisor import Engine

TINY_GEMMA3 = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                   layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=1024,
                   query_pre_attn_scalar=16, bos_token_id=2, eos_token_id=1, pad_token_id=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    folder = tmp_path_factory.mktemp("tiny-gemma3-hf")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Gemma3TextConfig(**TINY_GEMMA3)).save_pretrained(folder)
    return write_tokenizer_folder(folder)


@pytest.mark.parametrize("eviction", [("none", 0), ("sink", 16)])
async def test_openai_routes_on_the_hf_backend(checkpoint: Path, eviction: tuple[str, int]) -> None:
    policy, budget = eviction
    settings = Settings(model=str(checkpoint), device="cpu", backend="hf", kv_eviction=policy,
                        kv_budget_tokens=budget, served_model_name="tiny", max_model_len=128)
    built = build_engine_parts(settings)
    assert built.backend == "hf" and not built.parts.kv.prefix_cache
    # llguidance's tokenizer is a start-up phase on the CPU too, not the first constrained request's stall (it
    # refuses this word-level vocabulary: ready then means refused once, no request tries again)
    assert built.parts.grammar is not None and built.parts.grammar.ready
    assert finished_phases()[-1][0] == "building the grammar engine's tokenizer"
    async with trio.open_nursery() as nursery:
        engine = await nursery.start(supervise_engine, Engine(built.parts), lambda code: None)
        app = create_app(engine, settings)
        async with app.test_app() as test_app:
            client = test_app.test_client()
            body = {"model": "tiny", "prompt": "the capital of france is", "max_tokens": 24, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            answer = await response.get_json()
            assert response.status_code == 200, answer
            assert answer["usage"]["completion_tokens"] == 24 and answer["choices"][0]["finish_reason"] == "length"
            stream = await client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}})
            events = [line[len("data: "):] for line in (await stream.get_data(as_text=True)).splitlines()
                      if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 6
        await engine.drain(0)
    engine.check_integrity()
