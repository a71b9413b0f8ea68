"""vLLM's utility routes (/tokenize, /detokenize, /tokenizer_info, /version), served-name aliases with vLLM's
model card, and the tokenizer exported for clients (``transformers`` loads it and gives identical ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from http_testkit import CHAT_TEMPLATE, MODEL_NAME

from inference_server.__main__ import main
from inference_server.config import Settings, load_settings
from inference_server.http.utility import package_version
from inference_server.models.tokenizer import Tokenizer
from inference_server.models.tokenizer_export import export_tokenizer, served_tokenizer_folder

HELLO = [{"role": "user", "content": "hello"}]


async def test_tokenize_a_prompt_and_chat_messages(serve, tokenizer) -> None:
    async with serve() as served:
        response = await served.client.post("/tokenize", json={"prompt": "the capital of france"})
        assert response.status_code == 200, await response.get_data()
        payload = await response.get_json()
        assert payload == {"count": 5, "max_model_len": 128, "tokens": tokenizer.encode("the capital of france"),
                           "token_strs": None}
        bare = await (await served.client.post("/tokenize", json={
            "prompt": "the capital", "add_special_tokens": False, "return_token_strs": True})).get_json()
        assert bare["token_strs"] == ["the", "capital"] and bare["count"] == 2
        # Chat: the ids a chat request runs on (generation prompt added, no second BOS).
        chat = await (await served.client.post("/tokenize", json={"messages": HELLO})).get_json()
        assert chat["tokens"] == tokenizer.apply_chat_template(HELLO)
        assert tokenizer.decode(chat["tokens"]).endswith("<start_of_turn> model")
        without = await (await served.client.post("/tokenize", json={
            "messages": HELLO, "add_generation_prompt": False, "return_token_strs": True})).get_json()
        assert without["tokens"] == tokenizer.apply_chat_template(HELLO, add_generation_prompt=False)
        assert without["token_strs"][-1] == "<end_of_turn>"
        doubled = await (await served.client.post("/tokenize", json={
            "messages": HELLO, "add_special_tokens": True})).get_json()
        assert doubled["tokens"][:2] == [tokenizer.bos_token_id] * 2


async def test_detokenize_round_trips(serve, tokenizer) -> None:
    async with serve() as served:
        ids = tokenizer.encode("hello world", add_special_tokens=False)
        response = await served.client.post("/detokenize", json={"tokens": ids, "model": MODEL_NAME})
        assert response.status_code == 200 and await response.get_json() == {"prompt": "hello world"}


@pytest.mark.parametrize(("route", "body", "status", "param", "message"), [
    ("/detokenize", {"tokens": [3, 512]}, 400, "tokens[1]", "token id 512 at tokens[1] is outside the vocabulary "
                                                              "[0, 512)"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]", "[0, 512)"),
    ("/detokenize", {"tokens": ["3"]}, 400, "tokens[0]", "expected a 64-bit integer"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0]", "expected a 64-bit integer"),
    ("/detokenize", {}, 400, "tokens", "'tokens' is required"),
    ("/detokenize", {"tokens": [1], "text": "x"}, 400, "text", "unknown field 'text'"),
    ("/tokenize", {}, 400, "prompt", "exactly one of prompt or messages"),
    ("/tokenize", {"prompt": "a", "messages": HELLO}, 400, "prompt", "exactly one of prompt or messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "expected a string"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt", "messages only"),
    ("/tokenize", {"messages": []}, 400, "messages", "must not be empty"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "unknown role"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model", "does not exist"),
    ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, 400, "return_token_strs", "true or false"),
])
async def test_utility_routes_validate_strictly(serve, route, body, status, param, message) -> None:
    async with serve() as served:
        response = await served.client.post(route, json=body)
        assert response.status_code == status
        error = (await response.get_json())["error"]
        assert error["param"] == param and message in error["message"], error


async def test_tokenizer_routes_without_a_tokenizer(serve) -> None:
    async with serve(tokenizer=None) as served:
        for route, body in [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})]:
            response = await served.client.post(route, json=body)
            assert response.status_code == 400 and "no tokenizer" in (await response.get_json())["error"]["message"]
        assert (await served.client.get("/tokenizer_info")).status_code == 400


async def test_tokenizer_info_and_version(serve) -> None:
    async with serve(tokenizer_folder="/srv/cache/served-tokenizers/tiny") as served:
        info = await (await served.client.get("/tokenizer_info")).get_json()
        assert info["vocab_size"] == 512 and info["model_max_length"] == 128
        assert info["bos_token"] == "<bos>" and info["eos_token"] == "<eos>" and info["eos_token_ids"] == [1]
        assert info["chat_template"] == CHAT_TEMPLATE
        assert info["turn_markers"] == ["<end_of_turn>", "<start_of_turn>"]
        assert "path" not in info and "/srv/cache" not in json.dumps(info)  # no server path reaches a client
        version = await (await served.client.get("/version")).get_json()
        assert version == {"version": package_version()} and version["version"] != "unknown"


async def test_served_model_name_aliases_and_the_model_card(serve) -> None:
    settings = Settings(served_model_name=f"{MODEL_NAME}, tiny ,tiny-alias")
    async with serve(settings=settings, model_root="/models/tiny.gguf") as served:
        cards = (await (await served.client.get("/v1/models")).get_json())["data"]
        assert [card["id"] for card in cards] == [MODEL_NAME, "tiny", "tiny-alias"]
        # root is the reported served name, never the server's file path (SGLang's test_retrieve_model)
        assert all(card["root"] == MODEL_NAME and card["parent"] is None for card in cards)
        assert "/models/tiny.gguf" not in json.dumps(cards)
        alias = await served.client.post("/v1/completions", json={"model": "tiny-alias", "prompt": "hello",
                                                                  "max_tokens": 1})
        assert alias.status_code == 200 and (await alias.get_json())["model"] == MODEL_NAME
        responses = await served.client.post("/v1/responses", json={"model": "tiny", "input": "hello",
                                                                    "max_output_tokens": 1})
        assert responses.status_code == 200 and (await responses.get_json())["model"] == MODEL_NAME
        assert (await (await served.client.get("/v1/models/tiny")).get_json())["id"] == "tiny"
        unknown = await served.client.post("/v1/completions", json={"model": "tin", "prompt": "hello"})
        assert unknown.status_code == 404


def test_served_model_names_setting() -> None:
    assert load_settings({"SERVED_MODEL_NAME": "a, b c,a"}, environ={}, dotenv_path=None).served_model_names() \
        == ("a", "b", "c")
    assert Settings().served_model_names() == ()


TEXTS = ["the capital of france is paris", "hello world w7 w8", "what , said ? !", "unknownword the"]


def _assert_transformers_agrees(folder: Path, tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert hf.encode(text) == tokenizer.encode(text), text
        assert hf.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "system", "content": "be brief"}, *HELLO]
    assert hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        tokenizer.apply_chat_template(messages, tokenize=False)
    assert hf.bos_token == "<bos>" and hf.eos_token == "<eos>"


def test_exported_tokenizer_loads_in_transformers_with_identical_ids(tokenizer, tmp_path: Path) -> None:
    folder = export_tokenizer(tokenizer, tmp_path / "out", model_max_length=128)
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    _assert_transformers_agrees(folder, tokenizer)


def test_served_tokenizer_folder_is_written_once_and_keyed_on_content(tokenizer_folder, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_pretrained_dir(tokenizer_folder)
    first = served_tokenizer_folder(tokenizer, tmp_path, "tiny/model:1", 128)
    assert first.parent == tmp_path / "served-tokenizers" and first.name.startswith("tiny_model_1-")
    written = (first / "tokenizer.json").stat().st_mtime_ns
    assert served_tokenizer_folder(tokenizer, tmp_path, "tiny/model:1", 128) == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == written  # reused, not rewritten
    other = Tokenizer.from_pretrained_dir(tokenizer_folder, chat_template="{{ messages }}")
    assert served_tokenizer_folder(other, tmp_path, "tiny/model:1", 128) != first
    assert not [p for p in (tmp_path / "served-tokenizers").iterdir() if p.name.startswith(".")]


def test_export_tokenizer_command(tokenizer_folder, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "exported"
    assert main(["export-tokenizer", str(out), "--model", str(tokenizer_folder)]) == 0
    assert str(out) in capsys.readouterr().out
    _assert_transformers_agrees(out, Tokenizer.from_pretrained_dir(tokenizer_folder))
    assert main(["export-tokenizer", str(tmp_path / "x"), "--model", "qwen3-30b-a3b", "--dummy-weights"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
