"""Fixtures the model tests share: a tiny HF test checkpoint made runnable by the engine."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files (the engine wants a tokenizer; prompts in these tests are token ids below the tiny
    models' vocabularies)."""
    from jaxinfer.loading import default_model_path
    from jaxinfer.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    Tokenizer.from_gguf(default_model_path()).save_pretrained(folder)
    return folder


@pytest.fixture
def with_tokenizer(tokenizer_dir: Path, tmp_path: Path) -> Callable[[Path], Path]:
    """A function: a copy of a tiny checkpoint folder, in this test's tmp_path, with SmolLM2's tokenizer files."""
    def copy(folder: Path) -> Path:
        dst = tmp_path / folder.name
        shutil.copytree(folder, dst)
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, dst / f.name)
        return dst
    return copy
