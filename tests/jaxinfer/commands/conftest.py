"""Fixtures of the commands' tests: the tiny chat model (`tiny_chat.py`) as a folder for the CLI and as an in-process
`LLM`, the reference the CLI's outputs are compared with."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.jaxinfer.commands.tiny_chat import ENGINE_OPTIONS, make_tiny_chat_model


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("chat") / "tiny")


@pytest.fixture(scope="session")
def tiny_llm(tiny_chat_model):
    from jaxinfer import LLM

    return LLM(tiny_chat_model, **ENGINE_OPTIONS)
