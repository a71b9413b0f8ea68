"""Fixtures for the HTTP tests; the helpers live in ``http_testkit.py`` (this folder goes on ``sys.path``
so that test modules can import it under ``--import-mode=importlib``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from http_testkit import serving, write_tokenizer_folder
from tests.fake_engine import FakeEngine

from inference_server.models.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_folder(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_folder: Path) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(tokenizer_folder)


@pytest.fixture
def serve(tokenizer: Tokenizer, request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``async with serve(model, **overrides) as served``: an engine with the tiny tokenizer, served."""

    def open_serving(model: FakeEngine | None = None, **kwargs: Any) -> Any:
        kwargs.setdefault("tokenizer", tokenizer)
        kwargs.setdefault("separate", request.config.getoption("--engine-process") == "separate")
        return serving(model, **kwargs)

    return open_serving
