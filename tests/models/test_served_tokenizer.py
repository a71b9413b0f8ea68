"""The embedded model's served tokenizer (heavy: converts the real GGUF tokenizer): its chat turn markers, and
the folder exported for clients, which ``transformers`` loads with identical ids and the same chat prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_server.config import Settings
from inference_server.models.chat_templates import ChatStops
from inference_server.models.loading.source import load_tokenizer
from inference_server.models.tokenizer_export import served_tokenizer_folder

TEXTS = ["The capital of France is", "naïve 😀 中文 text", "  two spaces\nand a line", "<start_of_turn>user\nhi"]


@pytest.mark.heavy
def test_embedded_turn_markers_and_exported_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(Settings(cache_dir=str(tmp_path)))
    assert tokenizer is not None
    stops = ChatStops.of(tokenizer, tokenizer.eos_token_ids)
    assert stops.strings == ("<end_of_turn>", "<start_of_turn>")
    assert stops.token_ids == (105,)  # <end_of_turn> (106) is already an EOS id
    folder = served_tokenizer_folder(tokenizer, tmp_path, "gemma-3-270m", 8192)
    hf = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert hf.encode(text) == tokenizer.encode(text), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        tokenizer.apply_chat_template(messages, tokenize=False)
    assert hf.model_max_length == 8192
