"""The embedded Gemma 3 270M GGUF through our forward against transformers' own GGUF load (heavy)."""

from __future__ import annotations

import pytest
import torch
from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch

from inference_server.models.loading.embedded import embedded_gguf_path
from inference_server.models.loading.gguf_loader import open_gguf
from inference_server.models.loading.loader import build_model, load_weights
from inference_server.models.spec import parse_model_spec

PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]  # "The capital of France is" with BOS
STEPS = 32


def our_greedy(path) -> list[int]:
    checkpoint = open_gguf(path)
    spec = parse_model_spec(checkpoint.config)
    model = build_model(spec, torch.float32, "cpu")
    load_weights(model, spec, checkpoint.iter_tensors(torch.float32), str(path))
    cache = ContiguousKVCache(spec)
    tokens, out = list(PROMPT_IDS), []
    with torch.no_grad():
        batch = ForwardBatch(seq_ids=(0,), cached_lens=(0,), query_lens=(len(tokens),))
        hidden = model(torch.tensor(tokens), cache.context(batch, "cpu"))
        for step in range(STEPS):
            token = int(model.compute_logits(hidden[-1:]).argmax(-1))
            out.append(token)
            batch = ForwardBatch(seq_ids=(0,), cached_lens=(len(PROMPT_IDS) + step,), query_lens=(1,))
            hidden = model(torch.tensor([token]), cache.context(batch, "cpu"))
    return out


def transformers_greedy(path) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        generated = model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    return generated[0, len(PROMPT_IDS):].tolist()


@pytest.mark.heavy
def test_embedded_gemma3_greedy_tokens_match_transformers_for_32_steps() -> None:
    torch.set_num_threads(2)
    path = embedded_gguf_path()
    ours = our_greedy(path)
    assert ours == transformers_greedy(path)
