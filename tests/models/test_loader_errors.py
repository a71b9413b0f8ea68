"""A missing or corrupt checkpoint is a clear error naming the file; sharded checkpoints load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tests.models.conftest import load_hf_folder

from inference_server.models.loading.loader import CheckpointError, build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import parse_model_spec


def write_checkpoint(folder: Path, shards: int = 1) -> dict[str, torch.Tensor]:
    config = preset_config("gemma-4-31b-tiny")
    spec = parse_model_spec(config)
    model = build_model(spec, torch.float32, "cpu")
    init_dummy_weights(model, seed=1)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(state)
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            part = names[i::shards]
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: state[n] for n in part}, str(folder / file))
            weight_map.update(dict.fromkeys(part, file))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return state


def test_sharded_checkpoint_loads_every_tensor(tmp_path: Path) -> None:
    state = write_checkpoint(tmp_path / "ckpt", shards=3)
    model, _ = load_hf_folder(tmp_path / "ckpt", torch.float32, "cpu")
    loaded = model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name


def test_missing_config_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_hf_folder(tmp_path / "empty", torch.float32, "cpu")


def test_corrupt_safetensors_names_the_file(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or unreadable"):
        load_hf_folder(tmp_path / "ckpt", torch.float32, "cpu")


def test_missing_shard_names_the_file(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", shards=2)
    (tmp_path / "ckpt" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: shard listed in the index"):
        load_hf_folder(tmp_path / "ckpt", torch.float32, "cpu")


def test_missing_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    state = write_checkpoint(tmp_path / "ckpt")
    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model\.norm\.weight'\]"):
        load_hf_folder(tmp_path / "ckpt", torch.float32, "cpu")
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \(3,\), expected \(64,\)"):
        load_hf_folder(tmp_path / "ckpt", torch.float32, "cpu")
